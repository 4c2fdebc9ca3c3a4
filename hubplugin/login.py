"""Who may log in to the hub: NativeAuthenticator's accounts, each authorized by an admin.

JupyterHub's NativeAuthenticator (``jupyterhub-nativeauthenticator``) keeps a name and a
bcrypt hash of the password per account, in the hub's database: people sign up at
``/hub/signup`` and an admin authorizes each new account at ``/hub/authorize``.
:class:`AdminAuthorizedAuthenticator` changes three things, so that a name a person types
never grants anything by itself:

- A signup is authorized by an admin only (or by ``open_signup``, off by default), never
  because its name is already known to the hub. NativeAuthenticator itself authorizes a
  signup at once when its name is in ``allowed_users`` or ``admin_users``, and JupyterHub
  puts every user of its database into ``allowed_users`` whenever ``allow_existing_users``
  is on: a user an admin created, or put into a group such as ``staff``, before the person
  signed up would belong to whoever signs up with that name first.
- Who may log in is exactly who holds an authorized account (:meth:`check_allowed`): no
  ``allow_all``, no list of names.
- The first admin's account is made when the hub starts, from a password file (a Docker
  secret), so an admin exists before anyone can sign up. It is made once and left alone
  afterwards: the admin may change the password at ``/hub/change-password``, and a restart
  does not put the old one back.

Its login form is :class:`NativeLoginHandler`: NativeAuthenticator 1.3's own handler fails
every login on JupyterHub 6 (it times the login with JupyterHub's statsd client, which
JupyterHub 6 removed). Authorizing and discarding an account are plain links
(``/hub/authorize/<name>``, ``/hub/discard/<name>``), which a browser follows without the
hub's XSRF check: :class:`FromTheAuthorizePage` takes them only from the list at
``/hub/authorize`` itself, so an image in a notebook or a link elsewhere that an admin opens
cannot authorize an account.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import bcrypt
from jupyterhub.handlers import BaseHandler
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator import handlers as native_handlers
from nativeauthenticator.orm import UserInfo
from tornado import web
from traitlets import Unicode

__all__ = [
    "AdminAuthorizedAuthenticator",
    "DiscardHandler",
    "FirstAdminError",
    "FromTheAuthorizePage",
    "NativeLoginHandler",
    "ToggleAuthorizationHandler",
]


class FirstAdminError(ValueError):
    """The first admin's password file is configured but cannot be used."""


class NativeLoginHandler(native_handlers.LoginHandler):  # type: ignore[misc]
    """NativeAuthenticator's login form (``/hub/login``), working on JupyterHub 5 and 6."""

    async def post(self) -> None:
        """Log in, or show the form again (status 403) with what went wrong: a password that
        is right for an account no admin has authorized yet says so."""
        data = {name: self.get_argument(name, strip=name == "username")
                for name in self.request.body_arguments if name != "_xsrf"}
        data.setdefault("username", "")
        data.setdefault("password", "")
        user = await self.login_user(data)
        if user:
            self._jupyterhub_user = user
            self.redirect(self.get_next_url(user))
            return
        username = data["username"]
        error = "Invalid username or password."
        record = self.authenticator.get_user(username)
        if (record is not None and not record.is_authorized
                and record.is_valid_password(data["password"])):
            error = f"User {username} has not been authorized by an administrator yet."
        self.set_status(403)
        self.finish(await self._render(login_error=error, username=username))

    def render_template(self, name: str, **namespace: Any) -> Any:
        """Error pages as every hub page has them: JupyterHub's login handler would render
        them through ``_render``, whose NativeAuthenticator version takes other arguments."""
        return BaseHandler.render_template(self, name, **namespace)


class FromTheAuthorizePage:
    """A link of the list at ``/hub/authorize`` that changes an account: taken only when the
    browser came from that list on this hub (its ``Referer``; browsers send the full address
    within one origin). The admin's login is checked by the handler, as before."""

    request: Any
    hub: Any

    def prepare_from_the_authorize_page(self) -> None:
        came_from = urlsplit(self.request.headers.get("Referer", ""))
        if (came_from.netloc != self.request.host
                or came_from.path != self.hub.base_url + "authorize"):
            raise web.HTTPError(
                403, "Authorize or discard an account from the list at /hub/authorize")


class ToggleAuthorizationHandler(FromTheAuthorizePage,
                                 native_handlers.ToggleAuthorizationHandler):  # type: ignore[misc]
    """``/hub/authorize/<name>``: authorize the account, or take the authorization back."""

    async def prepare(self) -> None:
        await super().prepare()
        self.prepare_from_the_authorize_page()


class DiscardHandler(FromTheAuthorizePage,
                     native_handlers.DiscardHandler):  # type: ignore[misc]
    """``/hub/discard/<name>``: delete an account no admin authorized, freeing its name."""

    async def prepare(self) -> None:
        await super().prepare()
        self.prepare_from_the_authorize_page()


REPLACED_HANDLERS: dict[str, type] = {
    r"/login": NativeLoginHandler,
    r"/authorize/([^/]*)": ToggleAuthorizationHandler,
    r"/discard/([^/]*)": DiscardHandler,
}
"""NativeAuthenticator's routes whose handler this module replaces."""


class AdminAuthorizedAuthenticator(NativeAuthenticator):  # type: ignore[misc]
    """NativeAuthenticator where only an admin's authorization lets an account in."""

    first_admin = Unicode(
        "admin",
        config=True,
        help="The name of the first admin, whose account is made from first_admin_password_file.",
    )
    first_admin_password_file = Unicode(
        "",
        config=True,
        help="""A file holding the first admin's password (a Docker secret). When set, the
        hub makes that admin's account at its start unless it exists already; the name is
        added to admin_users. Empty: no account is made, and an admin must be made another way.""",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.make_first_admin()

    def make_first_admin(self) -> None:
        """Make the first admin's authorized account from its password file, once."""
        if not self.first_admin_password_file:
            self.log.warning(
                "No first admin: AdminAuthorizedAuthenticator.first_admin_password_file is "
                "not set, so nobody can authorize signups until an admin account exists")
            return
        name = self.normalize_username(self.first_admin)
        self.admin_users.add(name)  # JupyterHub makes it an admin of the hub at its start
        if self.get_user(name) is not None:
            self.log.info("First admin %r: the account exists; %s is not read again",
                          name, self.first_admin_password_file)
            return
        password = self._first_admin_password()
        record = UserInfo(username=name, is_authorized=True,
                          password=bcrypt.hashpw(password.encode(), bcrypt.gensalt()))
        self.db.add(record)
        self.db.commit()
        self.log.info("First admin %r: account made with the password in %s",
                      name, self.first_admin_password_file)

    def _first_admin_password(self) -> str:
        path = Path(self.first_admin_password_file)
        try:
            password = path.read_text().rstrip("\r\n")
        except OSError as exc:
            raise FirstAdminError(
                f"the first admin's password file {path} cannot be read: {exc.strerror}") from exc
        if len(password) < self.minimum_password_length:
            raise FirstAdminError(
                f"the first admin's password in {path} is shorter than "
                f"{self.minimum_password_length} characters (minimum_password_length)")
        return password

    def get_authed_users(self) -> set[str]:
        """The names whose accounts an admin authorized: NativeAuthenticator authorizes a
        signup at once when its name is in this set, so it holds no configured name."""
        return {info.username for info in UserInfo.all_users(self.db) if info.is_authorized}

    def check_allowed(self, username: str, authentication: Any = None) -> bool:
        """Only a holder of an authorized account may log in."""
        record = self.get_user(username)
        return record is not None and bool(record.is_authorized)

    def get_handlers(self, app: Any) -> list[tuple[str, type]]:
        """NativeAuthenticator's pages, with this module's handlers where it has one."""
        return [(route, REPLACED_HANDLERS.get(route, handler))
                for route, handler in super().get_handlers(app)]

    def check_allow_config(self) -> None:
        """The allow rule is the admin's authorization: JupyterHub's warning about a missing
        allow setting does not apply; ``open_signup`` lets in everyone who signs up."""
        if self.open_signup:
            self.log.warning(
                "NativeAuthenticator.open_signup is on: everyone who signs up may log in "
                "without an admin's authorization")
