"""Ingest leases on a real Redis: one holder, renewal, expiry, takeover with seq resume."""

from __future__ import annotations

import asyncio
import time

from redis_server import redis_server  # noqa: F401  (fixture)

from events.model import BlockStored, KVEventBatch
from router.instance import InstanceKey
from router.redis_index import RedisIndex
from router.redis_lease import LeaseManager
from router.redis_state import RedisState

E = InstanceKey("http://e1:8000")


async def wait_for(cond, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_acquire_renew_release(redis_server):  # noqa: F811
    s1, s2 = RedisState(redis_server.url), RedisState(redis_server.url)
    a = LeaseManager(s1, "r1", ttl_ms=400)
    b = LeaseManager(s2, "r2", ttl_ms=400)
    assert await a.try_acquire(E)
    assert not await b.try_acquire(E)
    assert await a.holder(E) == "r1"
    assert not await b.renew(E)  # cannot extend someone else's lease
    assert not await b.release(E)  # nor delete it
    assert await a.renew(E)
    assert await a.release(E)
    assert await b.try_acquire(E)
    await s1.aclose()
    await s2.aclose()


async def test_takeover_after_holder_dies_resumes_from_seq(redis_server):  # noqa: F811
    s1, s2 = RedisState(redis_server.url), RedisState(redis_server.url)
    idx1, idx2 = RedisIndex(s1), RedisIndex(s2)
    acquired: list[tuple[str, int | None]] = []

    async def on_b(inst):
        acquired.append(("r2", await idx2.alast_seq(inst)))

    a = LeaseManager(s1, "r1", ttl_ms=600, interval=0.1)
    b = LeaseManager(s2, "r2", ttl_ms=600, interval=0.1, on_acquired=on_b)
    await a.round([E])
    await b.round([E])
    assert a.held == {E} and b.held == set()
    # r1 ingests seq 0..3 under its lease, then "dies": it stops renewing, releases nothing
    for seq in range(4):
        batch = KVEventBatch(0.0, [BlockStored([100 + seq], None, [], 16)])
        assert (await idx1.aapply_seq(E, batch, seq=seq, token="r1")).applied
    task = asyncio.create_task(b.run(lambda: [E]))
    took = await wait_for(lambda: bool(acquired))
    assert took < 0.6 + 0.1 + 0.5  # ttl + one interval (+ slack for a busy CI box)
    assert acquired == [("r2", 3)]  # resumes after the last applied batch
    # the dead holder, were it to wake up, is fenced off
    late = KVEventBatch(0.0, [BlockStored([999], None, [], 16)])
    assert (await idx1.aapply_seq(E, late, seq=4, token="r1")).fenced
    assert (await idx2.aapply_seq(E, late, seq=4, token="r2")).applied
    b.stop()
    await task
    assert await a.holder(E) is None  # released on shutdown: the next one takes it at once
    await s1.aclose()
    await s2.aclose()


async def test_lost_lease_is_reported(redis_server):  # noqa: F811
    s1 = RedisState(redis_server.url)
    lost = []
    a = LeaseManager(s1, "r1", ttl_ms=5000, on_lost=lost.append)
    await a.round([E])
    await s1.client.set(s1.prefix + "lease:" + str(E), "thief")
    await a.round([E])
    assert lost == [E] and a.held == set()
    await s1.aclose()
