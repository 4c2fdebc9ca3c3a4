"""Headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``).

No extra package: Chromium reads NUL-terminated JSON commands on fd 3 and writes replies and
events on fd 4. Synchronous on purpose; async tests call it through ``asyncio.to_thread`` so
the event loop (which may run the allocator) keeps going.

The browser is kept on loopback: background networking, component updates and sync are off,
and every host name except 127.0.0.1/localhost resolves to nothing.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
]


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium; ``page()`` opens a tab and returns its session id."""

    def __init__(self, chromium: Path, user_data_dir: Path, *, width: int = 1200,
                 height: int = 900, timeout: float = 30.0,
                 hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> None:
        self.chromium = chromium
        self.user_data_dir = user_data_dir
        self.width = width
        self.height = height
        self.timeout = timeout
        self.hosts = hosts
        """The only hosts pages may reach (every other name resolves to nothing)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.log_path = user_data_dir.parent / "chromium.log"

    # ---------------------------------------------------------------- process

    def __enter__(self) -> Browser:
        self.user_data_dir.mkdir(parents=True, exist_ok=True)
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        # move the child's ends out of the way of 3 and 4 before dup2 puts them there
        child_in = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
        child_out = fcntl.fcntl(res_w, fcntl.F_DUPFD, 10)
        os.close(cmd_r)
        os.close(res_w)

        def wire_fds() -> None:
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        args = [
            str(self.chromium), *CHROMIUM_FLAGS,
            "--host-resolver-rules=MAP * ~NOTFOUND , "
            + ", ".join(f"EXCLUDE {host}" for host in self.hosts),
            f"--user-data-dir={self.user_data_dir}",
            f"--window-size={self.width},{self.height}",
            "--remote-debugging-pipe", "about:blank",
        ]
        log = open(self.log_path, "wb")
        try:
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                preexec_fn=wire_fds, pass_fds=(3, 4, child_in, child_out),
            )
        finally:
            log.close()
            os.close(child_in)
            os.close(child_out)
        self._write_fd = cmd_w
        self._read_fd = res_r
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        for fd in (self._write_fd, self._read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._proc = None

    # ---------------------------------------------------------------- protocol

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("Chromium did not answer in time")
            ready, _, _ = select.select([self._read_fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the pipe (see {self.log_path})")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, *,
             session: str | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One command; returns its result (events that arrive meanwhile are kept)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            msg["sessionId"] = session
        os.write(self._write_fd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def wait_event(self, method: str, *, session: str | None = None,
                   timeout: float | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for i, event in enumerate(self._events):
                if event["method"] == method and (
                    session is None or event.get("sessionId") == session
                ):
                    return self._events.pop(i)
            self._events.append(self._read_message(deadline))

    # ---------------------------------------------------------------- pages

    def page(self) -> str:
        """Open a tab; returns its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        sid = session["sessionId"]
        self.send("Page.enable", session=sid)
        self.send("Runtime.enable", session=sid)
        self.send("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False,
        }, session=sid)
        return sid

    def navigate(self, session: str, url: str) -> None:
        self._events = [e for e in self._events if e["method"] != "Page.loadEventFired"]
        result = self.send("Page.navigate", {"url": url}, session=session)
        if result.get("errorText"):
            raise BrowserError(f"navigating to {url}: {result['errorText']}")
        self.wait_event("Page.loadEventFired", session=session)

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True,
        }, session=session)
        if "exceptionDetails" in result:
            raise BrowserError(f"script failed: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def submit(self, session: str, expression: str) -> None:
        """Run a script that submits a form, and wait for the next page to load."""
        self._events = [e for e in self._events if e["method"] != "Page.loadEventFired"]
        self.evaluate(session, expression)
        self.wait_event("Page.loadEventFired", session=session)

    def log_in(self, session: str, hub_url: str, user: str, password: str) -> None:
        """Log in to the hub at ``hub_url`` through its login form, as a person does."""
        self.navigate(session, f"{hub_url}/hub/login")
        self.submit(session, f"""
            document.querySelector('#username_input').value = {json.dumps(user)};
            document.querySelector('#password_input').value = {json.dumps(password)};
            document.querySelector('form').submit();
        """)

    def url(self, session: str) -> str:
        return str(self.evaluate(session, "location.href"))

    def screenshot(self, session: str, path: Path, *, full_page: bool = False) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            height = int(self.evaluate(
                session, "Math.ceil(document.documentElement.scrollHeight)"))
            params["clip"] = {"x": 0, "y": 0, "width": self.width,
                              "height": max(height, self.height), "scale": 1}
            params["captureBeyondViewport"] = True
        data = self.send("Page.captureScreenshot", params, session=session)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
