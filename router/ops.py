"""Operations endpoints: /metrics, /health, /ready, /debug/route, /debug/index, and logging.

/health says the process serves; /ready says it can route (at least one healthy instance), so
a Kubernetes readiness probe keeps traffic away from a router whose whole fleet is down.
Debug routes reveal fleet internals, so they take ``Authorization: Bearer <admin token>``
when one is configured, compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.errors import RouterError, error_response
from router.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from router.server import Router

log = logging.getLogger("router.ops")

ROUTER_KEY: web.AppKey[Router] = web.AppKey("router", object)  # type: ignore[arg-type]


# -- logging ------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    _SKIP = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in self._SKIP and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    """Structured logs on stderr. Prompt text is never logged unless --log-prompts is set."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("ts=%(created).3f level=%(levelname)s logger=%(name)s %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(str(level).upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


# -- auth ---------------------------------------------------------------------------------


def check_admin(request: web.Request, token: str | None) -> None:
    if not token:
        return
    got = request.headers.get("Authorization", "")
    scheme, _, value = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        value.strip().encode(), token.encode()
    ):
        raise RouterError(401, "this route needs Authorization: Bearer <admin token>")


# -- handlers -----------------------------------------------------------------------------


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    healthy = [st.describe()["instance"] for st in router.fleet.routable()]
    body = {
        "ready": bool(healthy),
        "healthy_instances": healthy,
        "instances": len(router.fleet.instances()),
    }
    return web.json_response(body, status=200 if healthy else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    data = router.metrics.render()
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})


async def handle_debug_route(request: web.Request) -> web.Response:
    from router.proxy import explain_route, read_json_body

    router = request.app[ROUTER_KEY]
    try:
        check_admin(request, router.config.admin_token)
        body = await read_json_body(request, router.config.max_body_bytes)
        kind = request.query.get("kind") or ("completions" if "messages" not in body else "chat")
        if kind not in ("chat", "completions"):
            raise RouterError(400, "kind must be chat or completions", "kind")
        out = await explain_route(router, body, kind)
    except RouterError as e:
        return error_response(e.status, e.message, e.param)
    return web.json_response(out)


async def handle_debug_index(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    try:
        check_admin(request, router.config.admin_token)
    except RouterError as e:
        return error_response(e.status, e.message, e.param)
    return web.json_response(router.index_summary())


async def handle_debug_fleet(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    try:
        check_admin(request, router.config.admin_token)
    except RouterError as e:
        return error_response(e.status, e.message, e.param)
    return web.json_response({"ts": time.time(), "instances": router.fleet_summary()})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_post("/debug/route", handle_debug_route)
    app.router.add_get("/debug/index", handle_debug_index)
    app.router.add_get("/debug/fleet", handle_debug_fleet)
