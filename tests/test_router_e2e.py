"""End to end: real engine shims, the real router, the official openai client.

Each test builds its own small fleet on free loopback ports (shims at time scale 0 unless a
test needs requests to take time) and tears it down; assertions compare the router's index
with the engines' own caches and read the engines' reported hits.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from conftest import free_port
from router_harness import (
    MODEL,
    ShimProcess,
    chat_body,
    long_text,
    new_slot,
    running_fleet,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)


def client_for(fleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="x", max_retries=0)


async def chat(client, body: dict):
    """(headers, completion) through the openai client."""
    extra = {
        k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens", "temperature")
    }
    raw = await client.chat.completions.with_raw_response.create(
        model=body["model"],
        messages=body["messages"],
        max_tokens=body.get("max_tokens", 4),
        temperature=body.get("temperature", 0),
        extra_body=extra or None,
    )
    return raw.headers, raw.parse()


def cached(completion) -> int:
    d = completion.usage.prompt_tokens_details
    return (d.cached_tokens or 0) if d else 0


async def settle_index(fleet, i: int) -> None:
    """Wait until the router's view of engine i equals the engine's own cache."""
    await wait_for(
        lambda: fleet.router_blocks(i) == set(fleet.engine_blocks(i)), 10, f"index of engine {i}"
    )


async def test_one_prefix_lands_on_one_instance(tokenizer):
    async with running_fleet(tokenizer, [new_slot() for _ in range(4)]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        system = long_text(1, 300)
        h0, _ = await chat(client, chat_body(system, "first question"))
        first = h0["x-routed-to"]
        i = [s.url for s in fleet.slots].index(first)
        await settle_index(fleet, i)
        for n in range(6):
            h, c = await chat(client, chat_body(system, f"question number {n}"))
            assert h["x-routed-to"] == first
            predicted = int(h["x-prefix-hit-tokens"])
            assert predicted > 200
            assert cached(c) == predicted  # the router's prediction is the engine's hit
        async with aiohttp.ClientSession() as s, s.get(fleet.base_url + "/metrics") as r:
            text = await r.text()
        assert "router_predicted_hit_tokens_total" in text
        assert "router_decision_seconds_bucket" in text


async def test_burst_with_one_prefix_lands_together(tokenizer):
    # Pending entries: a burst sent before any event arrives still lands on one instance.
    # (A low load weight: with 1.0 the first request's queued prefill outweighs the shared
    # prefix, and spreading the burst is the policy's right answer.)
    slots = [new_slot(time_scale=0.2) for _ in range(4)]
    async with running_fleet(tokenizer, slots) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        system = long_text(2, 400)
        results = await asyncio.gather(
            *(chat(client, chat_body(system, f"q{n}")) for n in range(6))
        )
        routed = [h["x-routed-to"] for h, _ in results]
        assert len(set(routed)) <= 2, routed  # max_share may spill to a second instance


async def test_different_prefixes_spread(tokenizer):
    async with running_fleet(tokenizer, [new_slot() for _ in range(4)]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        routed = set()
        for n in range(8):
            h, _ = await chat(client, chat_body(long_text(100 + n, 120), "hi"))
            routed.add(h["x-routed-to"])
        assert len(routed) >= 2


async def test_salted_requests_never_share(tokenizer):
    async with running_fleet(tokenizer, [new_slot() for _ in range(2)]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        system = long_text(3, 300)
        h1, _ = await chat(client, chat_body(system, "same", cache_salt="tenant-a"))
        i = [s.url for s in fleet.slots].index(h1["x-routed-to"])
        await settle_index(fleet, i)
        h2, c2 = await chat(client, chat_body(system, "same", cache_salt="tenant-b"))
        assert int(h2["x-prefix-hit-tokens"]) == 0
        assert cached(c2) == 0
        h3, c3 = await chat(client, chat_body(system, "same", cache_salt="tenant-a"))
        assert h3["x-routed-to"] == h1["x-routed-to"]
        assert cached(c3) > 0 and int(h3["x-prefix-hit-tokens"]) == cached(c3)


async def test_streaming_pass_through_and_usage(tokenizer):
    async with running_fleet(tokenizer, [new_slot()]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        body = chat_body(long_text(4, 100), "stream please", max_tokens=8)
        stream = await client.chat.completions.create(
            model=MODEL, messages=body["messages"], max_tokens=8, stream=True
        )
        chunks = [c async for c in stream]
        assert chunks and all(c.usage is None for c in chunks)  # usage stripped: not asked for
        text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
        assert text
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=body["messages"],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
        m = fleet.router.metrics
        label = fleet.slots[0].url
        assert m.actual_hit_tokens.labels(label)._value.get() > 0  # read from the stream


async def test_wrong_seed_detected_and_adopted(tokenizer):
    # The engine runs with PYTHONHASHSEED=7; the router assumes it unset.
    async with running_fleet(tokenizer, [new_slot(hash_seed="7")]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        system = long_text(5, 300)
        await chat(client, chat_body(system, "one"))
        key = fleet.key(0)
        await wait_for(lambda: fleet.router.parity.state(key) == "adopted", 15, "seed adopted")
        assert fleet.router.parity.scheme(key).seed == "7"
        await settle_index(fleet, 0)
        h, c = await chat(client, chat_body(system, "two"))
        assert cached(c) > 0 and int(h["x-prefix-hit-tokens"]) == cached(c)


async def test_replay_after_forced_gap(tokenizer):
    async with running_fleet(tokenizer, [new_slot()]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        await chat(client, chat_body(long_text(6, 100), "warm up"))
        await settle_index(fleet, 0)
        pub = fleet.slots[0].shim.server.publishers[0]
        left = [3]

        def skip(seq: int) -> bool:
            if left[0] > 0:
                left[0] -= 1
                return True
            return False

        pub.skip_send = skip  # the next three batches never reach the router live
        for n in range(4):
            await chat(client, chat_body(long_text(10 + n, 100), "gap"))
        await settle_index(fleet, 0)
        stats = fleet.router.applier.stats[fleet.key(0)]
        assert stats.replayed >= 3 and stats.gaps == 0 and stats.drops == 0


async def test_restarted_engine_blocks_are_dropped(tokenizer):
    slot = new_slot()
    async with running_fleet(tokenizer, [slot]) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        for n in range(6):
            await chat(client, chat_body(long_text(20 + n, 80), "before restart"))
        await settle_index(fleet, 0)
        old = fleet.router_blocks(0)
        assert old
        await slot.stop()
        st = fleet.router.fleet.get(fleet.key(0))
        await wait_for(lambda: not st.healthy, 10, "engine seen down")
        await slot.start(tokenizer)  # same ports, empty cache, seq from 0
        await wait_for(lambda: st.healthy, 10, "healthy again")
        await chat(client, chat_body(long_text(99, 80), "after restart"))
        stats = fleet.router.applier.stats[fleet.key(0)]
        await wait_for(lambda: stats.restarts + stats.drops >= 1, 10, "restart handled")
        await settle_index(fleet, 0)
        assert fleet.router_blocks(0) and not (old & fleet.router_blocks(0))


async def test_engine_killed_under_load_loses_no_unstarted_request(tokenizer):
    victim = ShimProcess(new_slot(time_scale=1.0))
    await victim.start()
    slots = [new_slot(time_scale=0.2) for _ in range(2)]
    try:
        async with running_fleet(tokenizer, slots, external=[victim.slot], retries=2) as fleet:
            await fleet.joined()
            vkey = fleet.key(2)
            url = fleet.base_url + "/v1/chat/completions"
            async with aiohttp.ClientSession() as s:

                async def one(n: int) -> tuple[int, bool]:
                    body = chat_body(
                        long_text(200 + n, 300), "load", max_tokens=32, stream=n % 2 == 0
                    )
                    async with s.post(url, json=body) as r:
                        data = await r.read()
                        return r.status, b'"error"' in data

                tasks = [asyncio.create_task(one(n)) for n in range(18)]
                # Kill the engine while it holds requests, some not yet streaming.
                await wait_for(
                    lambda: fleet.router.fleet.get(vkey).in_flight >= 3, 10, "victim loaded"
                )
                victim.kill()
                results = await asyncio.gather(*tasks)
            m = fleet.router.metrics
            started = m.requests.labels(str(vkey), "stream_error")._value.get()
            retried = m.retries.labels(str(vkey))._value.get()
            # Every request got an answer; only streams that had started end in an error event.
            assert all(status == 200 for status, _ in results), results
            assert sum(1 for _, b in results if b) == started
            assert retried >= 1
            await wait_for(lambda: not fleet.router.fleet.get(vkey).healthy, 5, "victim out")
    finally:
        await victim.wait()


async def test_debug_route_explains_without_forwarding(tokenizer):
    async with running_fleet(
        tokenizer, [new_slot() for _ in range(2)], admin_token="s3cret"
    ) as fleet:
        await fleet.joined()
        client = client_for(fleet)
        system = long_text(7, 300)
        h, _ = await chat(client, chat_body(system, "first"))
        i = [s.url for s in fleet.slots].index(h["x-routed-to"])
        await settle_index(fleet, i)
        before = fleet.router.metrics.requests.labels(h["x-routed-to"], "ok")._value.get()
        async with aiohttp.ClientSession() as s:
            body = chat_body(system, "second")
            async with s.post(fleet.base_url + "/debug/route", json=body) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == 401
            hdr = {"Authorization": "Bearer s3cret"}
            async with s.post(fleet.base_url + "/debug/route", json=body, headers=hdr) as r:
                assert r.status == 200
                out = await r.json()
            async with s.get(fleet.base_url + "/debug/index", headers=hdr) as r:
                assert r.status == 200
                idx = await r.json()
            async with s.get(fleet.base_url + "/debug/index") as r:
                assert r.status == 401
        assert out["chosen"] == h["x-routed-to"]
        assert out["predicted_hit_tokens"] > 200
        per = {x["instance"]: x for x in out["instances"]}
        assert per[h["x-routed-to"]]["matched_blocks"] > 10
        assert all("cost" in x and "in_flight" in x for x in out["instances"])
        assert idx["index"]["entries"] > 0
        after = fleet.router.metrics.requests.labels(h["x-routed-to"], "ok")._value.get()
        assert after == before  # nothing was forwarded
        json.dumps(out)


async def test_ready_is_503_without_healthy_engine():
    from router.config import RouterConfig
    from router.instance import EngineSpec
    from router.server import Router

    port = free_port()
    cfg = RouterConfig(
        engines=[EngineSpec(f"http://127.0.0.1:{port}", replay="none")],
        tokenizer="engine",
        health_interval_s=0.1,
        connect_timeout_s=0.5,
    )
    router = Router(cfg)
    from aiohttp.test_utils import TestClient, TestServer

    from router.server import build_app

    async with TestClient(TestServer(build_app(router))) as c:
        await wait_for(lambda: not router.fleet.any_healthy(), 5, "engine marked down")
        r = await c.get("/ready")
        assert r.status == 503
        r = await c.post("/v1/chat/completions", json=chat_body("s", "u"))
        assert r.status == 503
        assert (await r.json())["error"]["code"] == 503


async def test_salt_by_api_key_separates_tenants(tokenizer):
    async with running_fleet(tokenizer, [new_slot()], salt_by_api_key=True) as fleet:
        await fleet.joined()
        system = long_text(8, 300)
        a = openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="tenant-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="tenant-b", max_retries=0)
        await chat(a, chat_body(system, "same"))
        await settle_index(fleet, 0)
        _, cb = await chat(b, chat_body(system, "same"))
        assert cached(cb) == 0
        await settle_index(fleet, 0)
        ha, ca = await chat(a, chat_body(system, "same"))
        assert cached(ca) > 0 and int(ha["x-prefix-hit-tokens"]) == cached(ca)
