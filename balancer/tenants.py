"""Prefix-cache isolation between tenants. A replica shares cached prompt blocks among requests with the same
`cache_salt`, and replies say how many prompt tokens were cached, so whoever shares a salt with another caller can
probe which prefixes that caller sent. When the deployment gives each tenant its own API key (--api-keys-file with
more than one key), the balancer salts every request with a hash of the caller's key: prefixes are shared within a
tenant only. A salt the caller set partitions further within its tenant.

With a single key (or none) every caller is one tenant and the cache stays shared, as before: callers holding the
same key can see each other's cached prefixes (through cached_tokens and timing). Give tenants separate keys, or
have them set their own cache_salt, where that matters.
"""

from __future__ import annotations

import hashlib

from ..proto import fastgen_pb2

TENANT_SALT_PREFIX = "tenant-"


def tenant_salt(key: str, own_salt: str = "") -> str:
    """The salt of a caller holding `key`: a hash (the key itself never travels to the replicas), stable across
    balancers and restarts so that a tenant keeps its cache."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16, person=b"fastgen-tenant")
    digest.update(b"\x00" + own_salt.encode("utf-8"))
    return TENANT_SALT_PREFIX + digest.hexdigest()


def salted_for(request: fastgen_pb2.GenerateRequest, key: str | None, per_tenant: bool) -> fastgen_pb2.GenerateRequest:
    """The request with its tenant's salt when keys are per tenant; otherwise the request itself. The caller's
    message is left as it is."""
    if not per_tenant or not key:
        return request
    salted = fastgen_pb2.GenerateRequest()
    salted.CopyFrom(request)
    salted.params.cache_salt = tenant_salt(key, request.params.cache_salt)
    return salted
