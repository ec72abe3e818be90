"""TLS material for gRPC and HTTP: server and channel credentials and ssl contexts from PEM files.

`TlsFiles(cert, key, ca)`: a process's certificate chain and private key, and the CA that signed its peers. A server
with `ca` requires client certificates signed by it (mutual TLS); a client with `ca` verifies the server against it
(else against the system's roots) and presents `cert`/`key` when it has them.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import grpc


@dataclass(frozen=True)
class TlsFiles:
    cert: str | None = None  # PEM certificate chain
    key: str | None = None  # PEM private key of cert
    ca: str | None = None  # PEM CA certificate(s): mutual TLS on a server, the trust root on a client

    def problems(self, role: str = "server") -> list[str]:
        """What is wrong with the set, each saying what to change; empty when it is usable."""
        problems = []
        if bool(self.cert) != bool(self.key):
            problems.append("--tls-cert and --tls-key go together: give both or neither")
        if role == "server" and self.ca and not self.cert:
            problems.append("--tls-ca needs --tls-cert and --tls-key (the certificate this process presents)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).expanduser().is_file():
                problems.append(f"{flag} {path}: no such file")
        return problems

    def check(self, role: str = "server") -> TlsFiles:
        """Self, or ValueError listing every problem."""
        problems = self.problems(role)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def read_pem(path: str | None) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Serves tls.cert; with tls.ca, requires client certificates signed by it."""
    key, cert = read_pem(tls.key), read_pem(tls.cert)
    assert key is not None and cert is not None, "a server's TlsFiles has cert and key (TlsFiles.check)"
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=read_pem(tls.ca), require_client_auth=bool(tls.ca)
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Verifies the server against tls.ca (the system's roots without one); presents tls.cert when it has one."""
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls.ca), private_key=read_pem(tls.key), certificate_chain=read_pem(tls.cert)
    )


def server_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """For an HTTPS server (aiohttp): serves tls.cert; with tls.ca, requires client certificates signed by it."""
    assert tls.cert and tls.key, "a server's TlsFiles has cert and key (TlsFiles.check)"
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(Path(tls.cert).expanduser()), str(Path(tls.key).expanduser()))
    if tls.ca:
        context.load_verify_locations(str(Path(tls.ca).expanduser()))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """For an HTTPS client: trusts tls.ca (the system's roots without one), presents tls.cert when it has one."""
    context = ssl.create_default_context(cafile=str(Path(tls.ca).expanduser()) if tls.ca else None)
    if tls.cert:
        assert tls.key, "cert and key go together (TlsFiles.problems)"
        context.load_cert_chain(str(Path(tls.cert).expanduser()), str(Path(tls.key).expanduser()))
    return context


def channel_options(options: Sequence[tuple[str, object]], server_name: str | None) -> Sequence[tuple[str, object]]:
    """`options` plus the name to verify the server's certificate against when the address does not carry it."""
    return [*options, ("grpc.ssl_target_name_override", server_name)] if server_name else options


@overload
def open_channel(
    address: str,
    options: Sequence[tuple[str, object]],
    tls: TlsFiles | None = None,
    server_name: str | None = None,
    aio: Literal[False] = False,
) -> grpc.Channel: ...
@overload
def open_channel(
    address: str,
    options: Sequence[tuple[str, object]],
    tls: TlsFiles | None = None,
    server_name: str | None = None,
    *,
    aio: Literal[True],
) -> grpc.aio.Channel: ...
def open_channel(
    address: str,
    options: Sequence[tuple[str, object]],
    tls: TlsFiles | None = None,
    server_name: str | None = None,
    aio: bool = False,
) -> grpc.Channel | grpc.aio.Channel:
    """A plaintext channel, or a TLS one when `tls` is given (see channel_credentials)."""
    module = grpc.aio if aio else grpc
    if tls is None:
        return module.insecure_channel(address, options=options)
    return module.secure_channel(address, channel_credentials(tls), options=channel_options(options, server_name))
