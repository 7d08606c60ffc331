"""The request path: parse, decide, forward, stream back, check the prediction.

Forwarding rules (issue 4 §7):

* The client sees nothing until the chosen engine sends its first body byte. Until then a
  connect error, a dropped connection or a 5xx is retried on the next-best instance (at most
  ``retries`` times); after it, a failure ends an SSE stream with an error event.
* Streams are passed on chunk by chunk. When the client did not ask for usage, the router asks
  the engine for it (``stream_options.include_usage``) to read ``cached_tokens``, then drops
  that one usage-only chunk so that the client sees what it asked for.
* Hop-by-hop headers are dropped both ways; the body goes through as the client sent it unless
  the router had to add ``stream_options``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from router.errors import RouterError, error_response, sse_error_event
from router.instance import InstanceKey

if TYPE_CHECKING:
    from router.fleet import InstanceState
    from router.server import Router

log = logging.getLogger("router.proxy")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Never forwarded upstream: recomputed by aiohttp, or would make the engine compress bytes
# the router needs to read.
_DROP_UP = HOP_BY_HOP | {"host", "content-length", "accept-encoding", "x-data-parallel-rank"}
_DROP_DOWN = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date"}

# Paths passed to any healthy engine as they are (vLLM's serve routers).
PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/version",
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenizer_info",
)


RAW_BODY: web.RequestKey[bytes] = web.RequestKey("raw_body", bytes)

# -- body -----------------------------------------------------------------------------------


async def read_json_body(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object, or a 4xx: too large (413), not JSON or not an object (400)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise RouterError(
            413, f"request body is {request.content_length} bytes; the limit is {max_bytes}"
        )
    raw = await read_limited(request, max_bytes)
    request[RAW_BODY] = raw
    return parse_json_object(raw)


async def read_limited(request: web.Request, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > max_bytes:
            raise RouterError(413, f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# msgspec parses a request body about five times faster than ``json.loads``. Where the two
# disagree msgspec refuses (NaN/Infinity literals, numbers out of float range, lone
# surrogates, a UTF-8 BOM or UTF-16/32 text): those bodies go to ``json.loads``, so what is
# accepted, what it decodes to and the error message are exactly the standard library's.
_decode_json = msgspec.json.Decoder().decode


def _loads(raw: bytes) -> Any:
    try:
        return _decode_json(raw)
    except msgspec.DecodeError:
        return json.loads(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise RouterError(400, "request body is empty; expected a JSON object")
    try:
        body = _loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RouterError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RouterError(400, "request body must be a JSON object")
    return body


def validate_request(body: dict[str, Any], kind: str) -> None:
    """The checks the router must make before routing (the engine makes the rest)."""
    if kind == "chat":
        msgs = body.get("messages")
        if msgs is None:
            raise RouterError(400, "'messages' is a required property", "messages")
        if not isinstance(msgs, list) or not msgs:
            raise RouterError(400, "'messages' must be a non-empty list", "messages")
        if not all(isinstance(m, dict) for m in msgs):
            raise RouterError(400, "each message must be an object", "messages")
    else:
        if body.get("prompt") is None and body.get("prompt_embeds") is None:
            raise RouterError(400, "either 'prompt' or 'prompt_embeds' must be provided", "prompt")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RouterError(400, "'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise RouterError(400, "'stream_options' must be an object", "stream_options")


def apply_api_key_salt(request: web.Request, body: dict[str, Any]) -> bool:
    """--salt-by-api-key: tenants that share engines never share cached blocks.

    A request without its own ``cache_salt`` gets one derived from its API key (a digest, so
    the key itself never reaches the engine's cache keys or events). Returns True when the
    body was changed.
    """
    if body.get("cache_salt") is not None:
        return False
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return False
    body["cache_salt"] = "k" + hashlib.sha256(key.strip().encode()).hexdigest()[:32]
    return True


def client_wants_usage(body: dict[str, Any]) -> bool:
    so = body.get("stream_options")
    return bool(isinstance(so, dict) and so.get("include_usage"))


def end_to_end(headers: Any, drop: frozenset[str]) -> dict[str, str]:
    """Headers minus ``drop`` and minus those the sender named hop-by-hop in ``Connection``."""
    conn = headers.getall("Connection", ())
    if conn:
        drop = drop | {t.strip().lower() for v in conn for t in v.split(",")}
    return {k: v for k, v in headers.items() if k.lower() not in drop}


def upstream_headers(request: web.Request, request_id: str, rank: int, dp: int) -> dict[str, str]:
    out = end_to_end(request.headers, _DROP_UP)
    out["X-Request-Id"] = request_id
    # aiohttp would offer gzip: the router reads usage from the body and passes it on as is.
    out["Accept-Encoding"] = "identity"
    if dp > 1:
        out["X-data-parallel-rank"] = str(rank)
    return out


def downstream_headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return end_to_end(resp.headers, _DROP_DOWN)


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id if usable, else 32 random hex digits (as ``uuid4().hex``
    looks, without building a UUID object on every request)."""
    rid = request.headers.get("X-Request-Id", "")
    return rid if 0 < len(rid) <= 128 and rid.isprintable() else os.urandom(16).hex()


@functools.lru_cache(maxsize=1024)
def upstream_url(base: str, path: str) -> URL:
    """The engine URL for a path, parsed once: aiohttp would parse the string per request."""
    return URL(base + path)


# -- SSE ------------------------------------------------------------------------------------


class SseUsageReader:
    """Splits an SSE byte stream into events and finds the usage in it.

    ``feed`` returns the bytes to pass on. With ``strip`` it holds back a partial event until
    it is complete (never across complete events) and drops the usage-only chunk; without, it
    returns its input unchanged and only watches.
    """

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: dict[str, Any] | None = None
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b"" if self.strip else data
        complete, self._buf = buf[: end + 2], buf[end + 2 :]
        if b'"usage"' not in complete:
            return complete if self.strip else data
        out: list[bytes] = []
        for ev in complete.split(b"\n\n"):
            if not ev:
                continue
            if b'"usage"' in ev and self._take_usage(ev) and self.strip:
                continue
            out.append(ev + b"\n\n")
        return b"".join(out) if self.strip else data

    def flush(self) -> bytes:
        rest, self._buf = self._buf, b""
        return rest if self.strip else b""

    def _take_usage(self, ev: bytes) -> bool:
        """Record the usage of one event; True when the event is the usage-only chunk."""
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return False
            try:
                obj = json.loads(payload)
            except ValueError:
                return False
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                return obj.get("choices") == []
        return False


def cached_tokens_of(usage: dict[str, Any] | None) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    v = details.get("cached_tokens")
    return v if isinstance(v, int) else None


# -- the decision ---------------------------------------------------------------------------


@dataclass
class RouteDecision:
    """What the router decided for one request, and the inputs that explain it."""

    chosen: InstanceKey
    predicted_hit_tokens: int
    prompt_tokens: int
    block_size: int
    prefix_credit: bool
    candidates: list[Any]
    decision: Any  # router.policy.Decision; its per-instance scores are built on demand
    hashes: dict[InstanceKey, list[int]]
    timings: dict[str, float] = field(default_factory=dict)
    # The hash scheme used per instance (HashScheme; described only by /debug/route).
    scheme: dict[InstanceKey, Any] = field(default_factory=dict)


async def decide(
    router: Router, body: dict[str, Any], kind: str, exclude: Iterable[InstanceKey] = ()
) -> RouteDecision:
    """Tokenize, hash per scheme, match, choose. Raises RouterError(400/503)."""
    return await router.decide(body, kind, exclude=set(exclude))


async def explain_route(router: Router, body: dict[str, Any], kind: str) -> dict[str, Any]:
    validate_request(body, kind)
    d = await decide(router, body, kind)
    return router.explain(d)


# -- forwarding -----------------------------------------------------------------------------


class _Retry(Exception):
    """The attempt failed before the first byte: try the next instance."""

    def __init__(
        self, outcome: str, detail: str, response: tuple[int, bytes, dict] | None = None
    ) -> None:
        super().__init__(detail)
        self.outcome = outcome
        self.detail = detail
        self.response = response


async def handle_completions(request: web.Request, kind: str) -> web.StreamResponse:
    from router.ops import ROUTER_KEY

    router = request.app[ROUTER_KEY]
    t0 = time.perf_counter()
    rid = request_id_of(request)
    try:
        body = await read_json_body(request, router.config.max_body_bytes)
        validate_request(body, kind)
        salted = router.config.salt_by_api_key and apply_api_key_salt(request, body)
        decision = await decide(router, body, kind)
    except RouterError as e:
        router.metrics.rejected.labels(str(e.status)).inc()
        log.info("request refused request_id=%s status=%d reason=%s", rid, e.status, e.message)
        return error_response(e.status, e.message, e.param, headers={"x-request-id": rid})

    stream = bool(body.get("stream"))
    raw: bytes = request[RAW_BODY]
    strip_usage = False
    if stream and not client_wants_usage(body):
        so = dict(body.get("stream_options") or {})
        so["include_usage"] = True
        body = dict(body)
        body["stream_options"] = so
        strip_usage = True
    if strip_usage or salted:
        raw = json.dumps(body).encode()

    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    tried: list[InstanceKey] = []
    last: _Retry | None = None
    attempts = 1 + max(0, router.config.retries)
    for attempt in range(attempts):
        if attempt:
            try:
                decision = await decide(router, body, kind, exclude=tried)
            except RouterError:
                break
            router.metrics.retries.labels(str(tried[-1])).inc()
        key = decision.chosen
        st = router.fleet.get(key)
        if st is None:
            tried.append(key)
            continue
        tried.append(key)
        router.record_pending(decision)
        try:
            return await _forward(
                router, request, st, decision, path, raw, rid, stream, strip_usage, t0
            )
        except _Retry as r:
            last = r
            log.warning(
                "attempt failed request_id=%s instance=%s outcome=%s detail=%s",
                rid,
                key,
                r.outcome,
                r.detail,
            )
    if last is not None and last.response is not None:
        status, data, headers = last.response
        return web.Response(status=status, body=data, headers=headers)
    code = 503 if last is None else 504 if last.outcome == "timeout" else 502
    msg = "no engine could take the request" + (f": {last.detail}" if last else "")
    router.metrics.rejected.labels(str(code)).inc()
    return error_response(code, msg, headers={"x-request-id": rid})


async def _forward(
    router: Router,
    request: web.Request,
    st: InstanceState,
    d: RouteDecision,
    path: str,
    raw: bytes,
    rid: str,
    stream: bool,
    strip_usage: bool,
    t0: float,
) -> web.StreamResponse:
    key = st.key
    series = router.metrics.instance(str(key))
    queued = max(0, d.prompt_tokens - d.predicted_hit_tokens)
    ticket = router.fleet.begin(key, queued)
    headers = upstream_headers(request, rid, st.rank, st.spec.dp)
    extra = {
        "x-routed-to": st.url,
        "x-prefix-hit-tokens": str(d.predicted_hit_tokens),
        "x-request-id": rid,
    }
    if st.spec.dp > 1:
        extra["x-routed-rank"] = str(st.rank)
    try:
        try:
            upstream = await router.session.post(
                upstream_url(st.url, path), data=raw, headers=headers
            )
        except (aiohttp.ClientConnectionError, OSError) as e:
            if _is_read_timeout(e):
                # Slow, not gone: retried elsewhere, but the engine stays in the fleet.
                series.outcome("timeout").inc()
                raise _Retry("timeout", f"engine {st.url} did not answer in time") from None
            series.outcome("connect_error").inc()
            router.fleet.mark_failed(key, f"{type(e).__name__}: {e}")
            router.poke_health()
            raise _Retry("connect_error", f"{type(e).__name__}: {e}") from None
        except asyncio.TimeoutError:
            series.outcome("timeout").inc()
            raise _Retry("timeout", "connect timeout") from None
        async with upstream:
            if upstream.status >= 500:
                data = await _read_quietly(upstream)
                series.outcome("engine_error").inc()
                hdrs = downstream_headers(upstream) | extra
                raise _Retry(
                    "engine_error", f"status {upstream.status}", (upstream.status, data, hdrs)
                )
            is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            if stream and is_sse and upstream.status == 200:
                return await _relay_stream(
                    router, request, upstream, d, st, extra, strip_usage, ticket
                )
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                if _is_read_timeout(e):
                    series.outcome("timeout").inc()
                    return error_response(
                        504, f"engine {st.url} did not answer in time", headers=extra
                    )
                series.outcome("connect_error").inc()
                raise _Retry("disconnected", f"{type(e).__name__}: {e}") from None
            router.fleet.first_byte(ticket)
            outcome = "ok" if upstream.status < 400 else "client_error"
            series.outcome(outcome).inc()
            if upstream.status == 200:
                usage = _json_usage(data)
                router.check_prediction(key, d, usage)
            log.info(
                "routed request_id=%s instance=%s status=%d predicted_hit=%d prompt_tokens=%d ms=%.2f",
                rid,
                key,
                upstream.status,
                d.predicted_hit_tokens,
                d.prompt_tokens,
                (time.perf_counter() - t0) * 1000,
            )
            return web.Response(
                status=upstream.status, body=data, headers=downstream_headers(upstream) | extra
            )
    finally:
        router.fleet.end(ticket)


def _is_read_timeout(e: BaseException) -> bool:
    """The engine accepted the connection but sent nothing for ``request_timeout_s``."""
    return isinstance(e, asyncio.TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError)


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return b""


class _UsageOnly(msgspec.Struct):
    """A completion response as far as the router reads it: msgspec skips everything else."""

    usage: Any = None


_decode_usage = msgspec.json.Decoder(_UsageOnly).decode


def _json_usage(data: bytes) -> dict[str, Any] | None:
    if b'"usage"' not in data:
        return None
    try:
        return _decode_usage(data).usage
    except msgspec.DecodeError:  # not an object, or JSON msgspec refuses: the slow path
        pass
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj.get("usage") if isinstance(obj, dict) else None


async def _relay_stream(
    router: Router,
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    d: RouteDecision,
    st: InstanceState,
    extra: dict[str, str],
    strip_usage: bool,
    ticket: Any,
) -> web.StreamResponse:
    series = router.metrics.instance(str(st.key))
    reader = SseUsageReader(strip=strip_usage)
    chunks = upstream.content.iter_any()
    # Wait for the first byte before answering: until then the request can still be retried.
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except (aiohttp.ClientError, OSError) as e:
        if _is_read_timeout(e):
            series.outcome("timeout").inc()
            return error_response(504, f"engine {st.url} did not answer in time", headers=extra)
        series.outcome("connect_error").inc()
        router.fleet.mark_failed(st.key, f"{type(e).__name__}: {e}")
        router.poke_health()
        raise _Retry("disconnected", f"{type(e).__name__}: {e}") from None
    except asyncio.TimeoutError:
        series.outcome("timeout").inc()
        return error_response(504, f"engine {st.url} did not answer in time", headers=extra)
    router.fleet.first_byte(ticket)
    resp = web.StreamResponse(status=upstream.status, headers=downstream_headers(upstream) | extra)
    await resp.prepare(request)
    outcome = "ok"
    data = first
    try:
        while True:
            out = reader.feed(data) if data else b""
            if out:
                try:
                    await resp.write(out)
                except (ConnectionError, OSError):
                    outcome = "client_gone"  # the client left: stop reading the engine
                    break
            try:
                data = await chunks.__anext__()
            except StopAsyncIteration:
                rest = reader.flush()
                if rest:
                    await resp.write(rest)
                break
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                outcome = "stream_error"
                log.warning("stream broke after first byte instance=%s error=%r", st.key, e)
                try:
                    await resp.write(
                        sse_error_event(502, f"engine stream ended early: {type(e).__name__}")
                    )
                except (ConnectionError, OSError):
                    pass
                break
    finally:
        series.outcome(outcome).inc()
    if outcome == "ok":
        router.check_prediction(st.key, d, reader.usage)
    try:
        await resp.write_eof()
    except (ConnectionError, OSError):
        pass
    return resp


# -- other routes ---------------------------------------------------------------------------


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await handle_completions(request, "chat")


async def handle_completion(request: web.Request) -> web.StreamResponse:
    return await handle_completions(request, "completions")


async def handle_models(request: web.Request) -> web.Response:
    from router.ops import ROUTER_KEY

    router = request.app[ROUTER_KEY]
    urls = router.fleet.healthy_engine_urls()
    if not urls:
        return error_response(503, "no healthy engine")

    async def one(url: str) -> list[dict]:
        try:
            async with router.session.get(url + "/v1/models") as r:
                if r.status != 200:
                    return []
                obj = await r.json(content_type=None)
                return list(obj.get("data") or [])
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return []

    seen: dict[str, dict] = {}
    for models in await asyncio.gather(*(one(u) for u in urls)):
        for m in models:
            if isinstance(m, dict) and "id" in m:
                seen.setdefault(m["id"], m)
    return web.json_response({"object": "list", "data": list(seen.values())})


async def handle_passthrough(request: web.Request) -> web.StreamResponse:
    """Any engine will do for these (tokenize, version, ...): a random healthy one."""
    from router.ops import ROUTER_KEY

    router = request.app[ROUTER_KEY]
    urls = router.fleet.healthy_engine_urls()
    if not urls:
        return error_response(503, "no healthy engine")
    try:
        raw = await read_limited(request, router.config.max_body_bytes)
    except RouterError as e:
        return error_response(e.status, e.message, e.param)
    rid = request_id_of(request)
    headers = end_to_end(request.headers, _DROP_UP)
    headers["X-Request-Id"] = rid
    headers["Accept-Encoding"] = "identity"
    random.shuffle(urls)
    last = ""
    for url in urls[: 1 + max(0, router.config.retries)]:
        try:
            async with router.session.request(
                request.method, url + request.path_qs, data=raw or None, headers=headers
            ) as r:
                data = await r.read()
                hdrs = downstream_headers(r) | {"x-routed-to": url, "x-request-id": rid}
                return web.Response(status=r.status, body=data, headers=hdrs)
        except (aiohttp.ClientConnectionError, OSError) as e:
            last = f"{type(e).__name__}: {e}"
            router.poke_health()
    return error_response(502, f"no engine could take the request: {last}")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_post("/v1/completions", handle_completion)
    app.router.add_get("/v1/models", handle_models)
    for p in PASSTHROUGH_PATHS:
        app.router.add_route("*", p, handle_passthrough)
