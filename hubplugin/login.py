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
JupyterHub 6 removed). Failed logins are counted per name **and** client address, each try
beyond the first few waiting twice as long as the last (:mod:`hubplugin.login_throttle`), so
a stranger guessing at ``admin`` cannot lock the admin out; NativeAuthenticator's own
lockout, per name alone, is not used. Signups are limited per client address and in total
(:class:`SignupHandler`).

Authorizing and discarding an account are forms at ``/hub/authorize`` that POST with the
hub's XSRF token (:class:`ToggleAuthorizationHandler`, :class:`DiscardHandler`); a GET of
``/hub/authorize/<name>`` or ``/hub/discard/<name>``, which an image in a notebook or a link
elsewhere that an admin opens would send, changes nothing (405).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import bcrypt
from jinja2 import ChoiceLoader, FileSystemLoader
from jupyterhub.handlers import BaseHandler
from nativeauthenticator import NativeAuthenticator
from nativeauthenticator import handlers as native_handlers
from nativeauthenticator.orm import UserInfo
from tornado import web
from traitlets import Float, Int, Unicode

from hubplugin.login_throttle import LoginBackoff, SignupThrottle

__all__ = [
    "AdminAuthorizedAuthenticator",
    "AuthorizationAreaHandler",
    "DiscardHandler",
    "FirstAdminError",
    "NativeLoginHandler",
    "SignupHandler",
    "ToggleAuthorizationHandler",
]

TEMPLATES = Path(__file__).resolve().parent / "templates"
AUTHORIZATION_TEMPLATE = "swarm-gpu-authorization-area.html"
"""The list at ``/hub/authorize`` with a form per change (a name of its own, so no other
template path can shadow it)."""


def client_address(handler: Any) -> str:
    """The client's address as the hub sees it (behind its proxy: the proxy's
    ``X-Forwarded-For``, as JupyterHub reads it)."""
    return str(getattr(getattr(handler, "request", None), "remote_ip", "") or "")


def in_words(wait_s: float) -> str:
    """``wait_s`` rounded up, for a person: ``"5 s"``, ``"3 min"``."""
    if wait_s < 120:
        return f"{math.ceil(wait_s)} s"
    return f"{math.ceil(wait_s / 60)} min"


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
        wait_s = self.authenticator.login_wait_s(data["username"], client_address(self))
        if wait_s > 0:
            self.set_status(429)
            self.finish(await self._render(
                login_error=f"Too many failed logins for this name from your address: try "
                f"again in {in_words(wait_s)}.", username=data["username"]))
            return
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


class SignupHandler(native_handlers.SignUpHandler):  # type: ignore[misc]
    """``/hub/signup``, at most so many signups per client address and in total
    (:class:`hubplugin.login_throttle.SignupThrottle`); more get status 429 and the time to
    wait."""

    async def post(self) -> None:
        """Sign up, unless this address (or everyone together) signed up too often."""
        if not self.authenticator.enable_signup:
            raise web.HTTPError(404)
        address = client_address(self)
        now = time.monotonic()
        wait_s = self.authenticator.signup_throttle.wait_s(address, now)
        if wait_s > 0:
            self.set_status(429)
            self.finish(await self.render_template(
                "signup.html", ask_email=self.authenticator.ask_email_on_signup,
                result_message=f"Too many signups: try again in {in_words(wait_s)}.",
                alert="alert-danger", two_factor_auth=self.authenticator.allow_2fa,
                recaptcha_key=self.authenticator.recaptcha_key, tos=self.authenticator.tos))
            return
        self.authenticator.signup_throttle.signed_up(address, now)
        await super().post()


class AuthorizationAreaHandler(native_handlers.AuthorizationAreaHandler):  # type: ignore[misc]
    """``/hub/authorize``: the list of accounts, each change a form that POSTs with the hub's
    XSRF token (:data:`AUTHORIZATION_TEMPLATE`)."""

    _templates_added = False

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        if not AuthorizationAreaHandler._templates_added:
            # After the hub's own paths, as NativeAuthenticator adds its folder: the
            # template's name is this module's own, so nothing else answers to it.
            env = self.settings["jinja2_env"]
            env.loader = ChoiceLoader([env.loader, FileSystemLoader([str(TEMPLATES)])])
            AuthorizationAreaHandler._templates_added = True

    @native_handlers.admin_users_scope  # type: ignore[untyped-decorator]
    async def get(self) -> None:
        """The list, with a form per account."""
        self.finish(await self.render_template(
            AUTHORIZATION_TEMPLATE, ask_email=self.authenticator.ask_email_on_signup,
            users=self.db.query(UserInfo).all()))


class ToggleAuthorizationHandler(native_handlers.ToggleAuthorizationHandler):  # type: ignore[misc]
    """``POST /hub/authorize/<name>``: authorize the account, or take the authorization back.
    The hub checks the POST's XSRF token before this runs; a GET changes nothing."""

    async def get(self, slug: str) -> None:
        """Refused: a link must not change an account."""
        raise web.HTTPError(405, "Authorize an account with the form at /hub/authorize")

    post = native_handlers.ToggleAuthorizationHandler.get


class DiscardHandler(native_handlers.DiscardHandler):  # type: ignore[misc]
    """``POST /hub/discard/<name>``: delete an account no admin authorized, freeing its name.
    The hub checks the POST's XSRF token before this runs; a GET changes nothing."""

    async def get(self, user_name: str) -> None:
        """Refused: a link must not delete an account."""
        raise web.HTTPError(405, "Discard an account with the form at /hub/authorize")

    post = native_handlers.DiscardHandler.get


REPLACED_HANDLERS: dict[str, type] = {
    r"/login": NativeLoginHandler,
    r"/signup": SignupHandler,
    r"/authorize": AuthorizationAreaHandler,
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

    login_free_failures = Int(
        3, config=True,
        help="Failed logins in a row, per name and client address, that cost no wait.")
    login_first_wait_s = Float(
        2.0, config=True,
        help="The wait after the first failed login beyond login_free_failures (per name and "
        "client address); each further failure doubles it.")
    login_max_wait_s = Float(
        900.0, config=True, help="The longest wait between two logins of one name from one "
        "address.")
    signups_per_address = Int(
        3, config=True, help="Signups one client address may make in signup_window_s.")
    signups_in_total = Int(
        30, config=True, help="Signups all addresses together may make in signup_window_s.")
    signup_window_s = Float(3600.0, config=True, help="The window of the signup limits.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.login_backoff = LoginBackoff(
            free_failures=self.login_free_failures, first_wait_s=self.login_first_wait_s,
            max_wait_s=self.login_max_wait_s)
        self.signup_throttle = SignupThrottle(
            per_address=self.signups_per_address, in_total=self.signups_in_total,
            window_s=self.signup_window_s)
        self.make_first_admin()

    def login_wait_s(self, username: str, address: str) -> float:
        """Seconds until ``address`` may try to log in as ``username`` again."""
        return self.login_backoff.wait_s(self.normalize_username(username), address,
                                         time.monotonic())

    async def authenticate(self, handler: Any, data: dict[str, Any]) -> str | None:
        """The account's name when its password (and second factor) is right and an admin
        authorized it; a failure, for a name with or without an account, counts against that
        name from the client's address only (:class:`LoginBackoff`)."""
        username = self.normalize_username(data["username"])
        address = client_address(handler)
        now = time.monotonic()
        if self.login_backoff.wait_s(username, address, now) > 0:
            return None
        user = self.get_user(username)
        if user is not None and user.is_authorized and user.is_valid_password(
                data["password"]) and (not user.has_2fa or user.is_valid_token(data.get("2fa"))):
            self.login_backoff.succeeded(username, address)
            return str(username)
        self.login_backoff.failed(username, address, now)
        return None

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
