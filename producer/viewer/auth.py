"""Who may read the viewer. On a loopback address with no token, only requests naming a
loopback host (a page of another site that rebinds its name to 127.0.0.1 is refused); with a
token (needed off loopback), every request carries it: `?token=T` once (then a cookie), or
`Authorization: Bearer T`. Every answer says not to send its address elsewhere, runs no script
but the viewer's own, and is never framed."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Collection

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

COOKIE = "cchatq_view_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
}


def is_loopback(host: str) -> bool:
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header, without its port (an IPv6 address keeps no brackets)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Gate:
    """ASGI middleware: the token rule, the Host check and the security headers."""

    def __init__(
        self, app: ASGIApp, token: str | None = None, hosts: Collection[str] | None = None
    ) -> None:
        self.app = app
        self.token = token or None
        self.hosts = None if hosts is None else {h.strip("[]").lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        set_cookie = False
        if self.hosts is not None:
            name = host_name(request.headers.get("host", "")).lower()
            if name not in self.hosts:
                await _refuse(400, f"cchatq view: unexpected Host {name!r}", scope, receive, send)
                return
        if self.token is not None:
            given = request.query_params.get("token")
            set_cookie = given is not None and self._valid(given)
            if not set_cookie and not self._valid(request.cookies.get(COOKIE)):
                bearer = request.headers.get("authorization", "")
                if not (bearer.startswith("Bearer ") and self._valid(bearer[7:].strip())):
                    message = "cchatq view: this viewer needs its token (?token=... once)"
                    await _refuse(401, message, scope, receive, send)
                    return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
                if set_cookie and self.token is not None:
                    headers.append(
                        "set-cookie", f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
                    )
            await send(message)

        await self.app(scope, receive, with_headers)

    def _valid(self, given: str | None) -> bool:
        if given is None or self.token is None:
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())


async def _refuse(status: int, text: str, scope: Scope, receive: Receive, send: Send) -> None:
    response = PlainTextResponse(text + "\n", status_code=status, headers=SECURITY_HEADERS)
    await response(scope, receive, send)
