"""Logging in to the hub of ``compose/jupyterhub_config.py``: NativeAuthenticator's accounts,
each let in by an admin's authorization only (``hubplugin/login.py``).

The real hub (one start, through ``hub_harness``): the first admin logs in with the password
from the secret file; a signup waits until the admin authorizes it, with the list's form (a
POST with the XSRF token; a link changes nothing); a name the admin put into ``staff`` before
its person signed up belongs to nobody who merely signs up with it. Another start: failed
logins wait per name and client address, and signups per address are limited.
The authenticator itself, on a real SQLite database: a signup is never authorized by its
name, the first admin's password file is read once, with a clear error when it cannot be,
and a stranger's failed logins as ``admin`` slow only that stranger's address; the list at
/hub/authorize changes accounts by POST forms with the XSRF token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
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
    assert 'method="post"' in listing and 'name="_xsrf"' in listing, listing
    assert 'href="/hub/authorize/erin"' not in listing and "/hub/discard/erin" in listing
    # Authorizing is the list's form, a POST with the hub's XSRF token: the address as a link
    # (an image in a notebook the admin looks at, a mail), even from the list itself, or a
    # POST without the token (a form on another site), changes nothing.
    for came_from in (f"{hub.url}/user/mallory/lab", f"{hub.url}/hub/authorize", None):
        status, _ = await as_admin(hub, admin_session, "/hub/authorize/erin", came_from)
        assert status == 405, came_from
    status, _ = await hub.form_post("/hub/authorize", {}, admin_session,
                                    action="/hub/authorize/erin", xsrf=False)
    assert status == 403
    assert await hub.log_in("erin", "erins-long-password-1") == 403
    status, _ = await hub.form_post("/hub/authorize", {}, admin_session,
                                    action="/hub/authorize/erin")
    assert status == 302
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


@pytest.mark.hub
async def test_the_hub_keys_failed_logins_by_name_and_address_and_limits_signups(
    tmp_path: Path, chp_path: Path,
) -> None:
    """The hub as shipped, its login form posted to the hub's own port with the address the
    proxy would forward (``X-Forwarded-For``): a stranger's guesses at ``admin`` get 429 with
    the time to wait, while the admin logs in from another address; a fourth signup from one
    address within the hour gets 429."""
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url="amqp://guest:guest@127.0.0.1:1/",
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users={}, first_admin=True)
    async with asyncio.timeout(TEST_BUDGET_S):
        try:
            await hub.start()
            direct = f"http://127.0.0.1:{hub.settings['hub_api_port']}"

            async def log_in(address: str, password: str) -> tuple[int, str]:
                jar = aiohttp.CookieJar(unsafe=True)
                headers = {"X-Forwarded-For": address}
                async with aiohttp.ClientSession(cookie_jar=jar, headers=headers) as session:
                    async with session.get(f"{direct}/hub/login") as response:
                        await response.text()
                    token = next((c.value for c in jar if c.key == "_xsrf"), "")
                    async with session.post(f"{direct}/hub/login?next=", allow_redirects=False,
                                            data={"username": "admin", "password": password,
                                                  "_xsrf": token}) as response:
                        return response.status, await response.text()

            statuses = [(await log_in("203.0.113.7", "a-guess"))[0] for _ in range(6)]
            assert statuses[:3] == [403, 403, 403] and statuses[-1] == 429, statuses
            status, page = await log_in("203.0.113.7", hub.admin_password)
            assert status == 429 and "try again in" in page, page
            assert (await log_in("10.0.0.2", hub.admin_password))[0] == 302

            pages = [await hub.sign_up(f"new{n}", f"new-long-password-{n}") for n in range(3)]
            assert not any("Too many signups" in page for page in pages)
            status, page = await hub.form_post("/hub/signup", {
                "username": "new3", "signup_password": "new-long-password-3",
                "signup_password_confirmation": "new-long-password-3"})
            assert status == 429 and "Too many signups" in page, page
        finally:
            await hub.stop()


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


def test_the_authorize_list_changes_accounts_by_post_forms_with_the_xsrf_token() -> None:
    """The template of /hub/authorize (``AUTHORIZATION_TEMPLATE``) as the hub renders it,
    over a stand-in for JupyterHub's ``page.html``: every change is a POST form carrying the
    token; no link of it changes an account."""
    from jinja2 import ChoiceLoader, DictLoader, Environment, FileSystemLoader

    from hubplugin.login import AUTHORIZATION_TEMPLATE, TEMPLATES

    env = Environment(autoescape=True, loader=ChoiceLoader([
        DictLoader({"page.html": "{% block main %}{% endblock %}"}),
        FileSystemLoader(str(TEMPLATES))]))
    users = [SimpleNamespace(username="erin", is_authorized=False, has_2fa=False, email=""),
             SimpleNamespace(username="admin", is_authorized=True, has_2fa=False, email=""),
             SimpleNamespace(username='x"><b>', is_authorized=False, has_2fa=False, email="")]
    page = env.get_template(AUTHORIZATION_TEMPLATE).render(
        base_url="/hub/", xsrf="TOKEN-1", users=users, ask_email=False)
    for action in ("/hub/authorize/erin", "/hub/discard/erin", "/hub/authorize/admin"):
        assert f'<form method="post" action="{action}"' in page, action
    assert "/hub/discard/admin" not in page  # an authorized account is not discarded
    assert page.count('name="_xsrf" value="TOKEN-1"') == 5, page
    assert 'href="/hub/authorize/' not in page and 'href="/hub/discard/' not in page
    assert "<b>" not in page


STRANGER, ADMIN_DESK = "203.0.113.7", "10.0.0.2"


def from_address(address: str) -> Any:
    """What the authenticator reads of the login's request: the client's address."""
    return SimpleNamespace(request=SimpleNamespace(remote_ip=address))


async def test_a_stranger_guessing_at_admin_does_not_lock_the_admin_out(
        db: Session, tmp_path: Path) -> None:
    secret = tmp_path / "swarm-gpu-hub-admin-password"
    secret.write_text("the-admins-password\n")
    hub = authenticator(AdminAuthorizedAuthenticator, db,
                        first_admin_password_file=str(secret), login_free_failures=3,
                        login_first_wait_s=60.0)
    for _ in range(20):
        assert await hub.authenticate(from_address(STRANGER), {
            "username": "admin", "password": "guess"}) is None
    assert hub.login_wait_s("admin", STRANGER) > 0
    # even the right password waits, from the stranger's address
    assert await hub.authenticate(from_address(STRANGER), {
        "username": "admin", "password": "the-admins-password"}) is None
    # the admin, from another address, is let in at once
    assert hub.login_wait_s("admin", ADMIN_DESK) == 0
    assert await hub.authenticate(from_address(ADMIN_DESK), {
        "username": "Admin", "password": "the-admins-password"}) == "admin"
    # guesses at a name with no account count too (the form does not say which names exist)
    for _ in range(4):
        await hub.authenticate(from_address(STRANGER), {"username": "nobody",
                                                        "password": "x"})
    assert hub.login_wait_s("nobody", STRANGER) > 0
