"""The router's security surface: admin routes, limits, tenant isolation, logs, headers.

A router sits in front of every engine; nobody may use it to read other tenants' prefixes,
reach internal routes without the admin token, exhaust it with huge requests, learn prompts
from its logs, or smuggle hop-by-hop and internal headers through it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import openai
import pytest
from aiohttp import web
from conftest import free_port
from fault_tools import router_on
from router_harness import MODEL, chat_body, long_text, new_slot, running_fleet, wait_for
from truth import assert_truth

from router.instance import EngineSpec

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-admin-token"
SECRET = "ZEBRA-PROMPT-MARKER-4711"


class EchoEngine:
    """An engine stand-in that records exactly what the router forwarded to it."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], bytes]] = []
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.url = ""

    async def start(self) -> EchoEngine:
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append(({k.lower(): v for k, v in request.headers.items()}, raw))
        body = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
        return web.json_response(
            body,
            headers={
                "Proxy-Authenticate": "Basic",
                "Trailer": "X-Checksum",
                "X-Engine-Hop": "private",
                "Connection": "X-Engine-Hop",
                "X-Engine-Ok": "yes",
            },
        )

    async def stop(self) -> None:
        await self.runner.cleanup()


async def raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 exchange written by hand (no client library to tidy the headers)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(head + body)
        await w.drain()
        async with asyncio.timeout(10):
            data = await r.read()
    finally:
        w.close()
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


# -- admin routes --------------------------------------------------------------------------


async def test_admin_routes_need_the_token_compared_in_constant_time(tokenizer, monkeypatch):
    import router.ops as ops

    calls = []
    real = ops.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(ops.hmac, "compare_digest", spy)
    async with running_fleet(tokenizer, [new_slot()], admin_token=TOKEN) as fleet:
        await fleet.joined()
        body = chat_body("s", "u")
        bad = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": f"Bearer {TOKEN[:-1]}"},
            {"Authorization": TOKEN},
        ]
        async with aiohttp.ClientSession() as s:
            for method, path in (
                ("POST", "/debug/route"),
                ("GET", "/debug/index"),
                ("GET", "/debug/fleet"),
            ):
                for h in bad:
                    async with s.request(method, fleet.base_url + path, json=body, headers=h) as r:
                        assert r.status == 401, (path, h)
                        err = (await r.json())["error"]
                        assert err["code"] == 401 and fleet.slots[0].url not in json.dumps(err)
                ok = {"Authorization": f"Bearer {TOKEN}"}
                async with s.request(method, fleet.base_url + path, json=body, headers=ok) as r:
                    assert r.status == 200, path
            # Client routes never need it.
            async with s.post(fleet.base_url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
        assert calls and all(b == TOKEN.encode() for _, b in calls)


# -- limits ------------------------------------------------------------------------------


async def test_body_and_header_limits(tokenizer):
    from engine_shim.testing import running_shim

    async with running_shim(tokenizer, max_request_body_bytes=4096) as shim:
        shim_port = int(shim.url.rsplit(":", 1)[1])
        specs = [EngineSpec(shim.url, events="none", replay="none")]
        async with router_on(tokenizer, specs, max_body_bytes=4096) as h:
            big = json.dumps(chat_body("x" * 8000, "u")).encode()
            for port in (h.port, shim_port):
                # Declared size over the limit.
                head = (
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(big)
                )
                status, data = await raw_http(port, head, big)
                assert status == 413, data
                assert json.loads(data)["error"]["code"] == 413
                # Undeclared (chunked) size over the limit.
                chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big)
                head = (
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                status, data = await raw_http(port, head, chunked)
                assert status == 413, data
                # One oversized header, and very many headers.
                for extra in (
                    b"X-Big: " + b"a" * 20000 + b"\r\n",
                    b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 100) for i in range(400)),
                ):
                    head = (
                        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                        + extra
                        + b"\r\n"
                    )
                    status, _ = await raw_http(port, head)
                    assert status in (400, 431), status


# -- tenants -------------------------------------------------------------------------------


async def test_cache_salt_isolation_and_debug_route_reveals_nothing(tokenizer):
    async with running_fleet(tokenizer, [new_slot() for _ in range(2)], admin_token=TOKEN) as fleet:
        await fleet.joined()
        system = long_text(700, 300)
        async with aiohttp.ClientSession() as s:
            url = fleet.base_url
            async with s.post(
                url + "/v1/chat/completions", json=chat_body(system, "a", cache_salt="tenant-a")
            ) as r:
                assert r.status == 200
                home = r.headers["x-routed-to"]
            i = [sl.url for sl in fleet.slots].index(home)
            await assert_truth(fleet.router, home)
            assert fleet.router_blocks(i)
            auth = {"Authorization": f"Bearer {TOKEN}"}

            async def explain(salt, headers):
                body = chat_body(system, "b")
                if salt is not None:
                    body["cache_salt"] = salt
                async with s.post(url + "/debug/route", json=body, headers=headers) as r:
                    return r.status, await r.json()

            # Another tenant (or none) matches nothing of tenant a's prefix, on any instance.
            for salt in ("tenant-b", None, "tenant-a "):
                status, out = await explain(salt, auth)
                assert status == 200
                assert out["predicted_hit_tokens"] == 0
                assert all(x["matched_blocks"] == 0 for x in out["instances"])
            status, out = await explain("tenant-a", auth)
            assert out["predicted_hit_tokens"] > 200
            # Without the token: nothing at all, not even which instances exist.
            status, out = await explain("tenant-a", {})
            assert status == 401 and set(out) == {"error"}
            assert home not in json.dumps(out) and "matched" not in json.dumps(out)
            # The real request of another tenant gets no hit from the engine either.
            async with s.post(
                url + "/v1/chat/completions", json=chat_body(system, "b", cache_salt="tenant-b")
            ) as r:
                got = await r.json()
                assert int(r.headers["x-prefix-hit-tokens"]) == 0
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_salt_by_api_key_isolates_unless_a_salt_is_shared(tokenizer):
    async with running_fleet(tokenizer, [new_slot()], salt_by_api_key=True) as fleet:
        await fleet.joined()

        def client(key):
            return openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key=key, max_retries=0)

        async def ask(key, system, **extra):
            raw = await client(key).chat.completions.with_raw_response.create(
                model=MODEL,
                messages=chat_body(system, "q")["messages"],
                max_tokens=2,
                extra_body=extra or None,
            )
            c = raw.parse()
            return int(raw.headers["x-prefix-hit-tokens"]), c.usage.prompt_tokens_details

        private = long_text(710, 300)
        await ask("key-a", private)
        await assert_truth(fleet.router, fleet.slots[0].url)
        for key in ("key-b", "key-c"):
            pred, det = await ask(key, long_text(710, 300))
            assert pred == 0 and (det.cached_tokens or 0) == 0
            await assert_truth(fleet.router, fleet.slots[0].url)
        pred, det = await ask("key-a", private)
        assert pred > 200 and det.cached_tokens == pred
        # Sharing is opt-in: two tenants that send the same explicit salt share blocks.
        shared = long_text(711, 300)
        await ask("key-a", shared, cache_salt="team-x")
        await assert_truth(fleet.router, fleet.slots[0].url)
        pred, det = await ask("key-b", shared, cache_salt="team-x")
        assert pred > 200 and det.cached_tokens == pred


async def test_api_key_never_reaches_the_engine_body(tokenizer):
    echo = await EchoEngine().start()
    try:
        specs = [EngineSpec(echo.url, events="none", replay="none")]
        async with router_on(tokenizer, specs, salt_by_api_key=True) as h:
            c = openai.AsyncOpenAI(
                base_url=h.base_url + "/v1", api_key="sk-tenant-9", max_retries=0
            )
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
            headers, raw = echo.seen[-1]
            body = json.loads(raw)
            assert body["cache_salt"] and "sk-tenant-9" not in raw.decode()
            # The engine may check the key itself (vLLM --api-key): the header goes through.
            assert headers["authorization"] == "Bearer sk-tenant-9"
    finally:
        await echo.stop()


# -- logs ------------------------------------------------------------------------------------


async def test_no_prompt_text_in_logs_at_default_level(tokenizer, caplog):
    caplog.set_level(logging.INFO)  # the router's default --log-level
    slot = new_slot()
    async with running_fleet(tokenizer, [slot], max_body_bytes=1 << 16, retries=1) as fleet:
        await fleet.joined()
        async with aiohttp.ClientSession() as s:
            url = fleet.base_url + "/v1/chat/completions"
            bodies = [
                chat_body(f"{SECRET} system", f"{SECRET} user"),
                chat_body(f"{SECRET} system", "u", stream=True),
                chat_body(f"{SECRET} s", "u", max_tokens=10**7),  # refused by the engine
                {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "stream": 3},
                {"model": MODEL, "messages": SECRET},
                {"model": MODEL, "messages": [{"role": "user", "content": SECRET}],
                 "cache_salt": 7},
                chat_body(SECRET * 5000, "too big"),
            ]  # fmt: skip
            for b in bodies:
                async with s.post(url, json=b) as r:
                    await r.read()
                    assert r.status < 500
            async with s.post(url, data=SECRET.encode() + b"{") as r:
                assert r.status == 400
            await slot.stop()  # an engine failure on the request path is logged too
            async with s.post(url, json=bodies[0]) as r:
                await r.read()
            await wait_for(lambda: not fleet.router.fleet.instances()[0].healthy, 5, "down")
    text = "\n".join(
        r.getMessage() + (str(r.exc_info) if r.exc_info else "") for r in caplog.records
    )
    assert caplog.records and SECRET not in text


# -- headers ------------------------------------------------------------------------------


async def test_hop_by_hop_and_internal_headers_are_not_forwarded(tokenizer):
    echo = await EchoEngine().start()
    try:
        specs = [EngineSpec(echo.url, events="none", replay="none")]
        async with router_on(tokenizer, specs) as h:
            body = json.dumps(chat_body("s", "u")).encode()
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\n"
                b"Host: router.example\r\n"
                b"Content-Type: application/json\r\n"
                b"Content-Length: %d\r\n"
                b"Connection: close, X-Client-Hop\r\n"
                b"X-Client-Hop: private\r\n"
                b"Keep-Alive: timeout=5\r\n"
                b"TE: trailers\r\n"
                b"Trailer: X-Checksum\r\n"
                b"Proxy-Authorization: Basic c2VjcmV0\r\n"
                b"Proxy-Connection: keep-alive\r\n"
                b"X-data-parallel-rank: 3\r\n"
                b"Accept-Encoding: gzip\r\n"
                b"X-End-To-End: kept\r\n"
                b"\r\n"
            ) % len(body)
            r, w = await asyncio.open_connection("127.0.0.1", h.port)
            w.write(head + body)
            await w.drain()
            async with asyncio.timeout(10):
                resp = await r.read()
            w.close()
            got, _ = echo.seen[-1]
            for name in (
                "x-client-hop",
                "keep-alive",
                "te",
                "trailer",
                "proxy-authorization",
                "proxy-connection",
                "x-data-parallel-rank",
                "accept-encoding",
            ):
                assert name not in got or (name, got[name]) == ("accept-encoding", "identity"), (
                    name,
                    got,
                )
            assert got["x-end-to-end"] == "kept"
            assert got["host"] == echo.url.removeprefix("http://")
            assert "x-request-id" in got
            head_out = resp.partition(b"\r\n\r\n")[0].decode().lower()
            assert head_out.startswith("http/1.1 200")
            assert "x-engine-ok: yes" in head_out
            for name in ("proxy-authenticate", "trailer", "x-engine-hop"):
                assert f"\r\n{name}:" not in head_out, (name, head_out)
    finally:
        await echo.stop()
