"""The files ``deploy`` makes in the secrets folder: once, private, and the first admin's
password given until it was shown."""

from __future__ import annotations

import stat
from pathlib import Path

from allocator.deploy.plan import passwords, secret_files
from allocator.deploy.site import Site, load_site
from allocator.deploy.steps import admin_password_shown, digests, make_files
from tests.support.site_files import write_site


def site_in(tmp_path: Path) -> Site:
    return load_site(write_site(tmp_path))


def test_every_file_is_made_once_and_private(tmp_path: Path) -> None:
    site = site_in(tmp_path)
    first = make_files(site)
    assert set(passwords(site)) | {"CA", "broker certificate", "hub certificate"} \
        == set(first.made)
    assert stat.S_IMODE(site.secrets.stat().st_mode) == 0o700
    for key, path in secret_files(site).items():
        expected = 0o644 if path.suffix == ".pem" else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == expected, key
    before = digests(site, secret_files(site))
    again = make_files(site)
    assert again.made == ()
    assert digests(site, secret_files(site)) == before


def test_the_first_admins_password_is_given_until_shown(tmp_path: Path) -> None:
    site = site_in(tmp_path)
    password = make_files(site).admin_password
    assert password is not None and len(password) == 24
    # A run that failed before showing it: the next still has it to show.
    assert make_files(site).admin_password == password
    admin_password_shown(site, password)
    assert make_files(site).admin_password is None
    # Rotated (its file deleted): the new one is shown once again.
    (site.secrets / "passwords" / "hub-admin-password").unlink()
    new = make_files(site).admin_password
    assert new is not None and new != password
