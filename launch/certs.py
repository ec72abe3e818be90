"""A deployment's secrets on disk, and how local tools (the supervisor's health checks, `status`, `generate`) reach
its processes with them.

    <state dir>/auth-token      the internal token the balancer sends to the replicas (0600)
    <state dir>/tls/ca.pem      a private CA (`fastgen-deploy certs`, or `start --tls auto`)
    <state dir>/tls/ca-key.pem  its key (0600): only needed to sign more certificates
    <state dir>/tls/cert.pem    the deployment's certificate, signed by the CA, for serving and as a client
    <state dir>/tls/key.pem     its key (0600)

The certificate names 127.0.0.1, ::1, localhost and the deployment's --host, and is good for both server and client
authentication: the balancer serves it on its public port and presents it to the replicas, which serve it too and
require it (mutual TLS). `cryptography` is imported only when certificates are made or read.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from ..server.auth import bearer_metadata, read_token_file, write_token_file
from ..server.client import ChannelSecurity
from ..server.tls import TlsFiles
from .config import DeployConfig, connect_host

TOKEN_FILE = "auth-token"
TLS_DIR = "tls"
VALID_DAYS = 825  # the longest validity that browsers and Apple's TLS stack still accept for a leaf certificate


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    ca_key: Path
    cert: Path
    key: Path

    def exist(self) -> bool:
        return all(p.is_file() for p in (self.ca, self.ca_key, self.cert, self.key))

    def tls(self) -> TlsFiles:
        return TlsFiles(str(self.cert), str(self.key), str(self.ca))


def cert_files(root: Path) -> CertFiles:
    d = root / TLS_DIR
    return CertFiles(d / "ca.pem", d / "ca-key.pem", d / "cert.pem", d / "key.pem")


# ---- the internal token ----
def ensure_token_file(root: Path, given: str | None) -> Path:
    """The token file the deployment uses: `given` (checked), or a fresh token in the state directory."""
    if given:
        path = Path(given).expanduser().resolve()
        read_token_file(path)  # ValueError when missing or empty
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            raise ValueError(f"--auth-token-file {path} is readable by others: chmod 600 {path}")
        return path
    path = root / TOKEN_FILE
    write_token_file(path)  # a new token at every start: a stopped deployment's token opens nothing
    return path


# ---- certificates ----
def san_names(hosts: list[str]) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a deployment's certificate names: loopback, localhost, and the hosts given (a
    wildcard bind adds this machine's name)."""
    dns, ips = ["localhost"], ["127.0.0.1", "::1"]
    for host in hosts:
        host = host.strip("[]")
        if host in ("", "0.0.0.0", "::"):
            dns.append(socket.gethostname())
            continue
        try:
            ips.append(str(ipaddress.ip_address(host)))
        except ValueError:
            dns.append(host)
    return list(dict.fromkeys(dns)), list(dict.fromkeys(ips))


def generate(root: Path, hosts: list[str], days: int = VALID_DAYS) -> CertFiles:
    """Makes a private CA and a certificate it signs for the deployment under root/tls (replacing any there)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    files = cert_files(root)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # tolerate clock skew
    name = root.name
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fastgen {name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(x509, cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    dns, ips = san_names(hosts)
    sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"fastgen {name}")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(x509, cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files.ca.parent.mkdir(parents=True, exist_ok=True)
    _write(files.ca_key, _private_pem(ca_key), private=True)
    _write(files.key, _private_pem(key), private=True)
    _write(files.ca, _public_pem(ca))
    _write(files.cert, _public_pem(cert))
    return files


def _key_usage(x509, cert_sign: bool):
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _private_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _public_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def cert_info(path: str) -> tuple[bool, list[str], list[str]]:
    """(self-signed, DNS names, IP addresses) of a PEM certificate."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(path).expanduser().read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = sans.get_values_for_type(x509.DNSName), [str(i) for i in sans.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        dns, ips = [], []
    return cert.issuer == cert.subject, dns, ips


# ---- how local tools reach the processes ----
def local_access(config: DeployConfig) -> dict[str, ChannelSecurity]:
    """For role "balancer" and "replica": the token and TLS a local tool presents. The internal token opens the
    balancer too; health checks need only the TLS."""
    token = read_token_file(config.auth_token_file) if config.auth_token_file else None
    metadata = bearer_metadata(token)
    if not config.tls_cert:
        return {"balancer": ChannelSecurity(metadata), "replica": ChannelSecurity(metadata)}
    self_signed, dns, ips = cert_info(config.tls_cert)
    # The server is verified against the deployment's CA, or a self-signed certificate against itself (else the
    # system's roots); under the name the certificate carries when it does not name the address we dial.
    roots = config.tls_ca or (config.tls_cert if self_signed else None)
    host = connect_host(config.host).strip("[]")
    server_name = None if host in dns + ips or not dns else dns[0]
    balancer = ChannelSecurity(metadata, TlsFiles(config.tls_cert, config.tls_key, roots), server_name)
    if not config.tls_ca:  # TLS on the public port only: the replicas speak plaintext
        return {"balancer": balancer, "replica": ChannelSecurity(metadata)}
    return {"balancer": balancer, "replica": balancer}
