"""The site's CA and server certificates: real files, chains checked by cryptography's own
verifier."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from allocator.deploy import pki


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def verify(ca: Path, leaf: Path, name: x509.DNSName | x509.IPAddress) -> None:
    """The chain from ``leaf`` to ``ca`` for a TLS server named ``name``, as a client checks
    it (raises :class:`VerificationError` when it does not hold)."""
    verifier = PolicyBuilder().store(Store([load(ca)])).build_server_verifier(name)
    verifier.verify(load(leaf), [])


def test_a_ca_and_a_server_certificate_that_clients_accept(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    hub = pki.ensure_server(folder, "hub", ["hub.example.org", "10.0.0.11"], ca)
    assert ca.made and hub.made
    verify(ca.certificate, hub.certificate, x509.DNSName("hub.example.org"))
    verify(ca.certificate, hub.certificate, x509.IPAddress(ipaddress.ip_address("10.0.0.11")))
    with pytest.raises(VerificationError):
        verify(ca.certificate, hub.certificate, x509.DNSName("other.example.org"))
    key = serialization.load_pem_private_key(hub.key.read_bytes(), password=None)
    assert key.public_key() == load(hub.certificate).public_key()


def test_keys_and_the_folder_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    broker = pki.ensure_server(folder, "broker", ["rabbitmq"], ca)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(ca.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(broker.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(broker.certificate.stat().st_mode) == 0o644


def test_a_second_run_reuses_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    first = pki.ensure_server(folder, "broker", ["rabbitmq", "127.0.0.1"], ca)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    again_ca = pki.ensure_ca(folder)
    again = pki.ensure_server(folder, "broker", ["rabbitmq", "127.0.0.1"], again_ca)
    assert not again_ca.made and not again.made
    assert again == pki.Issued(first.certificate, first.key, made=False)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_changed_names_make_a_new_certificate(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    pki.ensure_server(folder, "broker", ["rabbitmq"], ca)
    again = pki.ensure_server(folder, "broker", ["rabbitmq", "10.0.0.12"], pki.ensure_ca(folder))
    assert again.made
    assert pki.names_of(load(again.certificate)) == {"rabbitmq", "10.0.0.12"}


def test_a_missing_key_or_certificate_is_made_again(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    hub = pki.ensure_server(folder, "hub", ["hub.example.org"], ca)
    hub.key.unlink()
    again = pki.ensure_server(folder, "hub", ["hub.example.org"], pki.ensure_ca(folder))
    assert again.made
    verify(ca.certificate, again.certificate, x509.DNSName("hub.example.org"))


def test_an_expiring_certificate_is_renewed(tmp_path: Path) -> None:
    """A certificate within RENEW_BEFORE of its end, signed by the site's CA with the right
    names and key, is still made again."""
    folder = tmp_path / "tls"
    ca = pki.ensure_ca(folder)
    hub = pki.ensure_server(folder, "hub", ["hub.example.org"], ca)
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    old = load(hub.certificate)
    now = dt.datetime.now(dt.UTC)
    expiring = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.issuer)
                .public_key(old.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(days=800))
                .not_valid_after(now + pki.RENEW_BEFORE - dt.timedelta(days=1))
                .add_extension(old.extensions.get_extension_for_class(
                    x509.SubjectAlternativeName).value, critical=False)
                .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    hub.certificate.write_bytes(expiring.public_bytes(serialization.Encoding.PEM))
    again = pki.ensure_server(folder, "hub", ["hub.example.org"], pki.ensure_ca(folder))
    assert again.made
    assert load(again.certificate).not_valid_after_utc > now + pki.RENEW_BEFORE


def test_a_new_ca_signs_every_certificate_again(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    pki.ensure_server(folder, "hub", ["hub.example.org"], pki.ensure_ca(folder))
    (folder / "ca.key").unlink()
    ca = pki.ensure_ca(folder)
    assert ca.made
    hub = pki.ensure_server(folder, "hub", ["hub.example.org"], ca)
    assert hub.made
    verify(ca.certificate, hub.certificate, x509.DNSName("hub.example.org"))
