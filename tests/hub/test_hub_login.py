"""Logging in to the hub of ``compose/jupyterhub_config.py``: NativeAuthenticator's accounts,
each let in by an admin's authorization only (``hubplugin/login.py``).

The real hub (one start, through ``hub_harness``): the first admin logs in with the password
from the secret file; a signup waits until the admin authorizes it; a name the admin put
into ``staff`` before its person signed up belongs to nobody who merely signs up with it.
The authenticator itself, on a real SQLite database: a signup is never authorized by its
name, and the first admin's password file is read once, with a clear error when it cannot be.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nativeauthenticator import NativeAuthenticator
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from hubplugin.login import AdminAuthorizedAuthenticator, FirstAdminError
from tests.support.hub_harness import Hub

TEST_BUDGET_S = 120


# ------------------------------------------------------------------------- the real hub


@pytest.mark.hub
async def test_only_an_admins_authorization_lets_a_signup_in(
    tmp_path: Path, chp_path: Path,
) -> None:
    """The hub as shipped: ``admin`` logs in with the secret's password; ``erin`` signs up and
    is refused until the admin authorizes her in /hub/authorize; whoever signs up as
    ``carol`` (whom the admin put in ``staff`` before she signed up) or as ``admin`` is not
    let in; a name in the old ``HUB_STAFF`` variable makes no user."""
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url="amqp://guest:guest@127.0.0.1:1/",
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users={"carol": ["staff"]}, first_admin=True)
    hub.env["HUB_STAFF"] = "mallory"
    async with asyncio.timeout(TEST_BUDGET_S):
        try:
            await hub.start()
            await the_hub_refuses_what_no_admin_authorized(hub)
        finally:
            await hub.stop()


async def the_hub_refuses_what_no_admin_authorized(hub: Hub) -> None:
    # The first admin: the password from the secret file, a hub admin, in staff.
    assert await hub.log_in("admin", "not-" + hub.admin_password) == 403
    admin_session = aiohttp.CookieJar(unsafe=True)
    assert await hub.log_in("admin", hub.admin_password, admin_session) == 302
    status, admin = await hub.api("GET", "/users/admin")
    assert status == 200 and admin["admin"] is True and admin["groups"] == ["staff"], admin

    # Nobody takes the admin's name: it has its account already.
    page = await hub.sign_up("admin", "another-long-password-1")
    assert "already" in page.lower(), page
    assert await hub.log_in("admin", "another-long-password-1") == 403

    # A newcomer waits for the admin.
    await hub.sign_up("erin", "erins-long-password-1")
    status, page = await hub.form_post("/hub/login?next=", {
        "username": "erin", "password": "erins-long-password-1"})
    assert status == 403 and "has not been authorized by an administrator" in page, page
    status, erin = await hub.api("GET", "/users/erin")
    assert status == 404, erin  # not even a hub user yet
    status, listing = await as_admin(hub, admin_session, "/hub/authorize")
    assert status == 200 and "erin" in listing
    # The authorize link works from that list only: the same link in an image of a notebook
    # the admin looks at, or in a mail, changes nothing.
    for elsewhere in (f"{hub.url}/user/mallory/lab", "https://example.org/hub/authorize", None):
        status, _ = await as_admin(hub, admin_session, "/hub/authorize/erin", elsewhere)
        assert status == 403, elsewhere
    assert await hub.log_in("erin", "erins-long-password-1") == 403
    status, _ = await as_admin(hub, admin_session, "/hub/authorize/erin",
                               f"{hub.url}/hub/authorize")
    assert status == 200
    assert await hub.log_in("erin", "erins-long-password-1") == 302
    status, erin = await hub.api("GET", "/users/erin")
    assert status == 200 and erin["groups"] == [] and erin["admin"] is False, erin

    # carol is in staff by the admin's hand, but has no account: signing up with her name
    # gets the signup's author nothing until the admin, knowing who asked, authorizes it.
    await hub.sign_up("carol", "not-carols-password-1")
    assert await hub.log_in("carol", "not-carols-password-1") == 403
    status, carol = await hub.api("GET", "/users/carol")
    assert status == 200 and carol["groups"] == ["staff"], carol

    # HUB_STAFF is read no more: its name is no hub user and in no group, and the hub says so.
    status, _ = await hub.api("GET", "/users/mallory")
    assert status == 404
    status, staff = await hub.api("GET", "/groups/staff")
    assert status == 200 and sorted(staff["users"]) == ["admin", "carol"], staff
    assert "HUB_STAFF is no longer read" in hub.log_tail(lines=2000)


async def as_admin(hub: Hub, jar: aiohttp.CookieJar, path: str,
                   came_from: str | None = None) -> tuple[int, str]:
    """A page of the hub as the logged-in admin's browser gets it, having come from the page
    ``came_from`` (its Referer; redirects followed): its status and text."""
    headers = {"Referer": came_from} if came_from else {}
    async with (
        aiohttp.ClientSession(cookie_jar=jar) as session,
        session.get(f"{hub.url}{path}", headers=headers) as response,
    ):
        return response.status, await response.text()


# ----------------------------------------------------------------- the authenticator alone


@pytest.fixture
def db(tmp_path: Path) -> Any:
    """A session on a real SQLite file, as the hub's database is."""
    engine = create_engine(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    with Session(engine) as session:
        yield session
    engine.dispose()


def authenticator(cls: type[NativeAuthenticator], db: Session, **settings: Any) -> Any:
    return cls(_deprecated_db_session=db, db=db, **settings)


def test_a_signup_is_never_authorized_by_its_name(db: Session) -> None:
    """JupyterHub fills ``allowed_users`` with every user of its database whenever
    ``allow_existing_users`` is on, and NativeAuthenticator itself authorizes a signup at once
    when its name is in there or in ``admin_users``; this authenticator waits for an admin."""
    names = {"allowed_users": {"carol"}, "admin_users": {"boss"}}
    stock = authenticator(NativeAuthenticator, db, **names)
    assert stock.create_user("carol", "carols-long-password").is_authorized, (
        "NativeAuthenticator changed: it no longer authorizes a known name at signup")
    ours = authenticator(AdminAuthorizedAuthenticator, db, **names)
    boss = ours.create_user("boss", "not-the-boss-password")
    assert not boss.is_authorized
    assert not ours.check_allowed("boss") and ours.check_allowed("carol")
    assert ours.get_authed_users() == {"carol"}


def test_the_first_admin_is_made_once_from_its_file(db: Session, tmp_path: Path) -> None:
    secret = tmp_path / "swarm-gpu-hub-admin-password"
    secret.write_text("first-admin-password\n")
    first = authenticator(AdminAuthorizedAuthenticator, db,
                          first_admin_password_file=str(secret))
    assert "admin" in first.admin_users
    assert first.get_user("admin").is_valid_password("first-admin-password")
    assert first.check_allowed("admin")

    # A restart with another password in the file leaves the account as it is (the admin
    # may have changed the password since).
    secret.write_text("a-later-password\n")
    authenticator(AdminAuthorizedAuthenticator, db, first_admin_password_file=str(secret))
    assert first.get_user("admin").is_valid_password("first-admin-password")


def test_a_first_admin_file_that_cannot_be_used_stops_the_hub(
    db: Session, tmp_path: Path,
) -> None:
    with pytest.raises(FirstAdminError, match="cannot be read"):
        authenticator(AdminAuthorizedAuthenticator, db,
                      first_admin_password_file=str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(FirstAdminError, match="shorter than 10 characters"):
        authenticator(AdminAuthorizedAuthenticator, db, first_admin_password_file=str(short),
                      minimum_password_length=10)
    assert authenticator(AdminAuthorizedAuthenticator, db).get_user("admin") is None
