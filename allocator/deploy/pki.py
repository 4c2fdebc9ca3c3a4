"""The site's CA and the server certificates it signs (the broker's, the hub's).

Files, in a folder made 0700 (keys 0600, certificates 0644)::

    ca.pem  ca.key            the site's CA (10 years); its key signs nothing else
    <name>.pem  <name>.key    a server certificate (825 days) and its key

:func:`ensure_server` makes each once and reuses it on the next run. A certificate is made
again only when it is missing, not signed by the CA, not for its key, expiring within
:data:`RENEW_BEFORE`, or for other names than asked; a new CA (missing or expiring) makes
every certificate again. Writes are a temporary file and a rename: an interrupted run leaves
the old file or the new one, never half of one.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CA_DAYS", "RENEW_BEFORE", "SERVER_DAYS", "Issued", "ensure_ca", "ensure_server",
           "names_of", "private_folder", "write_private"]

CA_DAYS = 3650
SERVER_DAYS = 825  # what browsers and most TLS stacks accept for a server certificate
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class Issued:
    """A certificate on disk: its files, and whether this run made it."""

    certificate: Path
    key: Path
    made: bool


def private_folder(folder: Path) -> Path:
    """``folder``, made if missing, readable by its owner only (0700)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    return folder


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``data`` into ``path`` with ``mode``, through a temporary file and a rename."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(temporary, mode)  # the umask may have narrowed it
    temporary.replace(path)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_bytes(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load(certificate: Path, key: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey
                                                 ] | None:
    """The pair on disk, or None where either is missing or unreadable."""
    try:
        cert = x509.load_pem_x509_certificate(certificate.read_bytes())
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        return None
    return cert, private


def _fresh(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    """Whether ``cert`` is ``key``'s and lasts beyond :data:`RENEW_BEFORE`."""
    return (cert.public_key() == key.public_key()
            and cert.not_valid_after_utc - RENEW_BEFORE > _now())


def ensure_ca(folder: Path) -> Issued:
    """The site's CA in ``folder`` (``ca.pem``, ``ca.key``), made when missing or expiring."""
    private_folder(folder)
    certificate, key_path = folder / "ca.pem", folder / "ca.key"
    loaded = _load(certificate, key_path)
    if loaded is not None and _fresh(*loaded):
        return Issued(certificate, key_path, made=False)
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm-gpu site CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    # The key first: a CA certificate without its key would be a CA nobody can renew from.
    write_private(key_path, _key_bytes(key))
    write_private(certificate, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(certificate, key_path, made=True)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def names_of(cert: x509.Certificate) -> frozenset[str]:
    """The DNS names and addresses a certificate is for (its subjectAltName)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset([*san.get_values_for_type(x509.DNSName),
                      *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))])


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def ensure_server(folder: Path, name: str, hosts: list[str], ca: Issued) -> Issued:
    """``<name>.pem`` and ``<name>.key`` in ``folder``: a server certificate for ``hosts``
    (DNS names and IP addresses, the first its common name) signed by ``ca``; kept when it
    still is all of that and lasts beyond :data:`RENEW_BEFORE`, made again otherwise."""
    if not hosts:
        raise ValueError(f"{name}: a certificate needs at least one name")
    wanted = frozenset(str(ipaddress.ip_address(h)) if _is_ip(h) else h for h in hosts)
    certificate, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    ca_pair = _load(ca.certificate, ca.key)
    if ca_pair is None:
        raise ValueError(f"{ca.certificate}: the CA cannot be read")
    ca_cert, ca_key = ca_pair
    loaded = _load(certificate, key_path)
    if (not ca.made and loaded is not None and _fresh(*loaded)
            and names_of(loaded[0]) == wanted and _signed_by(loaded[0], ca_cert)):
        return Issued(certificate, key_path, made=False)
    key = _new_key()
    now = _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(min(now + dt.timedelta(days=SERVER_DAYS),
                                 ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([_general_name(h) for h in hosts]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    write_private(key_path, _key_bytes(key))
    write_private(certificate, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(certificate, key_path, made=True)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
