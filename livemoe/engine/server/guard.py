"""The checks every HTTP request passes before the app sees it (an ASGI middleware), in this order:

- Host header: exactly one, one of the accepted names (ServerConfig.host_names), else 400;
- API key: on /v1 routes, the tokenizer routes and the weight/sleep routes (admin.py) when one is set, `Authorization: Bearer KEY`, else 401;
- admin routes that change the server (weights, sleep, wake_up): 403 unless `--enable-admin-routes` or a key;
- body: a declared Content-Length over max_body_bytes gets a 413 before a byte is kept (the rest is read and
  dropped before the answer, up to DRAIN_MAX_BYTES, so that clients that send it all first read the 413); a body read in
  full must stay under it (413 as soon as it passes) and arrive within body_timeout_s (else 408), so a
  huge or trickled body cannot hold memory or a connection. The app then reads the buffered body;
- JSON: a body nested deeper than MAX_JSON_DEPTH, or whose text holds a lone surrogate (a `\ud800` escape), gets a
  400 naming it, on every route (the parser and everything after it would fail on it, some with a 500).
"""
import asyncio
import hmac
import json
import re

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from livemoe.engine.server.admin import ADMIN_PATHS, ADMIN_WRITE_PATHS
from livemoe.engine.server.config import ServerConfig
from livemoe.engine.server.protocol import error_body
from livemoe.engine.server.tokenizer_routes import TOKENIZER_PATHS
from livemoe.engine.text.json_limits import depth_message, lone_surrogate, too_deep

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only such bodies are parsed here, to look for a lone one


class BodyTooLarge(Exception):
    pass


class RequestGuard:
    def __init__(self, app, config: ServerConfig, host_names: set[str] | None):
        self.app, self.config, self.host_names = app, config, host_names
        self.api_key = None if config.api_key is None else config.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        body_read = scope["method"] not in ("POST", "PUT", "PATCH")
        if refusal is None and not body_read:
            try:
                async with asyncio.timeout(self.config.body_timeout_s):  # (wait_for would start a task per request)
                    body = await read_body(receive, self.config.max_body_bytes)
            except BodyTooLarge:
                refusal = _too_large(self.config.max_body_bytes)
            except TimeoutError:
                refusal = 408, error_body(f"the request body did not arrive within {self.config.body_timeout_s:g} s")
                body_read = True  # (a client this slow is not waited for again)
            else:
                if body is None:
                    return  # the client left while sending
                body_read = True
                refusal = _bad_json(body)
                receive = replay(body, receive)
        if refusal is not None:
            status, content = refusal
            # answered before the body was read (413, 401, ...): the rest is read and dropped first, so a client
            # that sends its whole body before reading (urllib, httpx: no `Expect: 100-continue`) reads the answer
            # rather than a broken pipe; bounded in bytes and time (past them the connection closes as before)
            if not body_read and headers.get("expect", "").lower() != "100-continue":
                await drain(receive, DRAIN_MAX_BYTES, self.config.body_timeout_s)
            response = JSONResponse(content, status_code=status,
                                    headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    def _refusal(self, scope, headers: Headers) -> tuple[int, dict] | None:
        if len(headers.getlist("host")) > 1:  # RFC 9112 3.2: a request with more than one Host is a 400
            return 400, error_body(f"the request has {len(headers.getlist('host'))} Host headers; send one")
        if self.host_names is not None and _host_name(headers.get("host", "")) not in self.host_names:
            return 400, error_body(f"Host header {headers.get('host', '')!r} is not one this server answers to "
                                   f"({sorted(self.host_names)}; see --allowed-hosts)")
        path = scope["path"]
        if self.api_key is not None and (path == "/v1" or path.startswith("/v1/") or path in ADMIN_PATHS
                                        or path in TOKENIZER_PATHS):
            # the scheme is case-insensitive (RFC 7235): "bearer KEY" is as good as "Bearer KEY"
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return 401, error_body("missing or wrong API key (send `Authorization: Bearer KEY`)",
                                       code="invalid_api_key")
        if path in ADMIN_WRITE_PATHS and not self.config.admin_routes:
            return 403, error_body(f"{path} is an admin route, off on this server: start it with "
                                   "--enable-admin-routes (or --api-key KEY, which enables them behind the key)",
                                   kind="permission_error", code="admin_routes_disabled")
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return 400, error_body(f"bad Content-Length {length!r}")
            if int(length) > self.config.max_body_bytes:
                return _too_large(self.config.max_body_bytes)
        return None


def _bad_json(body: bytes) -> tuple[int, dict] | None:
    """A 400 for a JSON body nested too deep or holding a lone surrogate; None otherwise (a body that is not
    JSON is the route's to refuse)."""
    if too_deep(body) is not None:
        return 400, error_body(depth_message())
    if SURROGATE_ESCAPE.search(body):
        try:
            why = lone_surrogate(json.loads(body))
        except ValueError:
            return None
        if why is not None:
            return 400, error_body(why)
    return None


def _too_large(limit: int) -> tuple[int, dict]:
    return 413, error_body(f"the request body is over the server's limit of {limit} bytes (--max-body-bytes)")


def _host_name(host: str) -> str:
    """The name of a Host header value, without its port ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """A request's whole body from its ASGI receive, or None if the client left; BodyTooLarge past `limit`."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if limit is not None and len(body) > limit:
            raise BodyTooLarge
        if not message.get("more_body", False):
            return bytes(body)


DRAIN_MAX_BYTES = 64 * 2**20  # at most this much of a refused body is read (and dropped)


async def drain(receive, max_bytes: int, timeout_s: float) -> None:
    """Reads and drops the rest of a request's body, up to max_bytes and timeout_s."""
    seen = 0
    try:
        async with asyncio.timeout(timeout_s):
            while seen <= max_bytes:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def replay(body: bytes, receive):
    """A receive that gives the buffered body once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
