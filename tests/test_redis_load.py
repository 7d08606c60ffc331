"""Shared load on a real Redis: sums across replicas, and a dead replica's counts drain."""

from __future__ import annotations

import asyncio
import time

from redis_server import redis_server  # noqa: F401  (fixture)

from router.instance import InstanceKey
from router.redis_load import Load, SharedLoad
from router.redis_state import RedisState

E1, E2 = InstanceKey("http://e1:8000"), InstanceKey("http://e2:8000", 1)


async def eventually(fn, want, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        got = await fn()
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def test_two_replicas_sum_and_dead_one_drains(redis_server):  # noqa: F811
    s1, s2 = RedisState(redis_server.url), RedisState(redis_server.url)
    a = SharedLoad(s1, "ra", ttl_ms=500, heartbeat=0.1)
    b = SharedLoad(s2, "rb", ttl_ms=500, heartbeat=0.1)
    a.add(E1, 1, 300)
    a.add(E1, 1, 200)
    b.add(E1, 1, 50)
    b.add(E2, 2, 10)
    assert await a.flush() and await b.flush()
    want = {E1: Load(3, 550), E2: Load(2, 10)}
    assert await a.totals() == want
    assert await b.totals() == want
    a.sub(E1, 1, 300)  # completion
    await a.flush()
    assert (await b.totals())[E1] == Load(2, 250)
    # rb keeps heartbeating; ra crashes (no withdraw, no more flushes): its counts drain
    task = asyncio.create_task(b.run())
    got = await eventually(b.totals, {E1: Load(1, 50), E2: Load(2, 10)})
    assert got == {E1: Load(1, 50), E2: Load(2, 10)}
    assert not any(f.startswith(b"ra|") for f in await s2.client.hkeys(s2.prefix + "load"))
    b.stop()
    await task  # clean stop withdraws rb's fields at once
    assert await a.totals() == {}
    await s1.aclose()
    await s2.aclose()


async def test_run_loop_publishes_changes_quickly(redis_server):  # noqa: F811
    s1, s2 = RedisState(redis_server.url), RedisState(redis_server.url)
    a = SharedLoad(s1, "ra", heartbeat=5.0)
    reader = SharedLoad(s2, "rr")
    task = asyncio.create_task(a.run())
    a.add(E2, 1, 64)
    assert await eventually(reader.totals, {E2: Load(1, 64)}, 2.0) == {E2: Load(1, 64)}
    a.stop()
    await task
    await s1.aclose()
    await s2.aclose()
