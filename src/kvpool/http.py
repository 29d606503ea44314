"""Helpers shared by the admin HTTP apps (:mod:`kvpool.master.admin`,
:mod:`kvpool.node.admin`): binding an aiohttp site, JSON and Prometheus replies.

The apps start only with ``--http-port`` (0 = a free port); the bound address goes into
the process's ready file as ``"http_addr"``."""

from __future__ import annotations

import errno
import hmac

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpool.auth import http_token
from kvpool.config import format_addr
from kvpool.errors import UserError


async def start_site(app: web.Application, host: str, port: int,
                     secret: bytes | None = None) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on host:port (0 = a free port) on the running loop; with ``secret``
    every request needs ``Authorization: Bearer <kvpool.auth.http_token(secret)>``
    (else 401).

    Returns (runner, "host:port" actually bound); ``await runner.cleanup()`` stops it.
    Raises UserError when the port is in use or the address cannot be bound.
    """
    app.middlewares.append(_json_errors)
    if secret is not None:
        app.middlewares.append(_bearer(http_token(secret)))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"admin HTTP port {port} on {host} is already in use") from None
        raise UserError(f"cannot serve admin HTTP on {format_addr(host, port)}: {exc.strerror or exc}") from None
    bound_port = runner.addresses[0][1]
    return runner, format_addr(host, bound_port)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """aiohttp's own refusals (an unknown path: 404, a method other than GET: 405) as the
    same JSON error body as every other error of these apps, naming the paths served
    (aiohttp answers them in plain text, which a client parsing JSON fails on)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        paths = sorted({r.resource.canonical for r in request.app.router.routes() if r.resource is not None})
        reply = error_response(exc.status, f"{exc.reason}: {request.method} {request.path} "
                                           f"(this server answers GET {', '.join(paths)})")
        if "Allow" in exc.headers:  # a 405 names the methods allowed (RFC 9110)
            reply.headers["Allow"] = exc.headers["Allow"]
        return reply


def _bearer(token: str):
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return error_response(401, "this admin server needs Authorization: Bearer <token> "
                                  "(kvpool.auth.http_token of the shared secret)")
        return await handler(request)

    return check


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """The Prometheus text exposition (format 0.0.4) of ``registry``."""
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def error_response(status: int, message: str, code: int | None = None) -> web.Response:
    """A JSON error body ``{"error": message, "code": ErrorCode int}`` with HTTP ``status``."""
    body = {"error": message}
    if code is not None:
        body["code"] = int(code)
    return web.json_response(body, status=status)
