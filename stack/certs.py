"""A local certificate authority and the gateways' certificates, kept in the state directory.

The gateway could make its own self-signed certificate (`--self-signed`), but it would be a new
one in a temporary folder on every start. Here the CA is made once and kept, so a client told to
trust `tls/ca.pem` keeps trusting every PoP across restarts; each PoP's certificate (for
localhost, 127.0.0.1, ::1, the PoP's own address and the API's DNS name) is re-issued when it
nears expiry or its names change. Both carry the extensions strict
verifiers ask for (key usage, key identifiers), so Python's and curl's default checks pass.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gateway.tls import certificate_builder, write_key

CA_VALIDITY: Final = datetime.timedelta(days=3650)
CERT_VALIDITY: Final = datetime.timedelta(days=365)
RENEW_BEFORE: Final = datetime.timedelta(days=30)


@dataclass(frozen=True, slots=True)
class GatewayTls:
    ca_cert: Path
    cert: Path
    key: Path


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _make_ca(cert_path: Path, key_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Meridian local stack CA")])
    cert = (
        certificate_builder(name, name, key, _now() + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _names_of(extra_names: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    for name in extra_names:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    return names


def _issue(
    ca_cert_path: Path,
    ca_key_path: Path,
    cert_path: Path,
    key_path: Path,
    names: list[x509.GeneralName],
) -> None:
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path} is not an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meridian-gateway")])
    not_valid_after = min(_now() + CERT_VALIDITY, ca_cert.not_valid_after_utc)
    cert = (
        certificate_builder(subject, ca_cert.subject, key, not_valid_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _expires_soon(cert_path: Path, names: list[x509.GeneralName] | None = None) -> bool:
    """Whether the certificate is missing, unreadable, near expiry or (if `names` is given)
    for other names."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError):
        return True
    if names is not None:
        try:
            issued = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return True
        if set(issued) != set(names):
            return True
    return cert.not_valid_after_utc - _now() < RENEW_BEFORE


def ensure_pop_tls(
    directory: Path, certificates: Mapping[str, tuple[str, ...]]
) -> dict[str, GatewayTls]:
    """The CA (made once) and, for each name, a current certificate `name`.pem signed by it,
    under `directory`, for the loopback names and its extra names (IP addresses or DNS names).
    A new CA re-issues every certificate."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = directory / "ca.pem", directory / "ca-key.pem"
    made_ca = False
    if not ca_key.exists() or _expires_soon(ca_cert):
        _make_ca(ca_cert, ca_key)
        made_ca = True
    issued = {}
    for name, extra_names in certificates.items():
        cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
        names = _names_of(extra_names)
        if made_ca or not key.exists() or _expires_soon(cert, names):
            _issue(ca_cert, ca_key, cert, key, names)
        issued[name] = GatewayTls(ca_cert, cert, key)
    return issued


def ensure_gateway_tls(directory: Path) -> GatewayTls:
    """The CA and one gateway certificate for the loopback names."""
    return ensure_pop_tls(directory, {"gateway": ()})["gateway"]
