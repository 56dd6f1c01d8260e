"""TLS for the gateway: a server context that refuses anything older than TLS 1.2, and a
self-signed certificate for local use (its builder and key writer also make the local stack's
CA and certificates, stack/certs.py).

The self-signed certificate (ECDSA P-256, valid for a year, for `localhost`, 127.0.0.1, ::1 and
the listening host) is written with its key to a private temporary directory at start; clients
must be told to trust it (its path is logged) or run with verification off. Real deployments
pass `--tls-cert` and `--tls-key`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALIDITY_DAYS = 365


def _names(host: str) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    addresses = {"127.0.0.1", "::1"}
    try:
        ipaddress.ip_address(host)
        addresses.add(host)
    except ValueError:
        if host and host != "localhost":
            names.append(x509.DNSName(host))
    names.extend(x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(addresses))
    return names


def certificate_builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    not_valid_after: datetime.datetime,
) -> x509.CertificateBuilder:
    """A certificate for `key`, valid from five minutes ago (clocks differ a little) until
    `not_valid_after`; the caller adds its extensions and signs it."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(not_valid_after)
    )


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Write `key` as PEM to a new file at `path` (any old one replaced) that only its owner
    can read, from the moment it exists."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


def make_self_signed(host: str, directory: Path) -> tuple[Path, Path]:
    """Write a fresh self-signed certificate and key into `directory`; return their paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meridian-gateway (self-signed)")])
    not_valid_after = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=VALIDITY_DAYS)
    cert = (
        certificate_builder(subject, subject, key, not_valid_after)
        .add_extension(x509.SubjectAlternativeName(_names(host)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "gateway.crt", directory / "gateway.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_key(key_path, key)
    return cert_path, key_path


def self_signed_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="meridian-gateway-tls-"))


def server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """TLS 1.2 or newer, the certificate and key loaded (errors name the file)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_path, key_path)
    return context


def control_plane_ssl(ca_file: Path | None) -> ssl.SSLContext | bool:
    """How to verify an https:// control plane: by its private CA, else by the system's."""
    if ca_file is None:
        return True
    return ssl.create_default_context(cafile=str(ca_file))
