"""Redis dies and comes back empty mid-run: requests keep an answer (local view), the degraded
flag goes up, and on recovery the index and load are rebuilt and the flag clears."""

from __future__ import annotations

import asyncio
import time

from redis_server import redis_server  # noqa: F401  (fixture)

from events.model import BlockStored, KVEventBatch
from router.index import Match, MemoryIndex
from router.instance import InstanceKey
from router.redis_index import RedisIndex, SharedIndex
from router.redis_load import Load, SharedLoad
from router.redis_state import RedisState

E = InstanceKey("http://e1:8000")


def batch(*hashes: int) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(list(hashes), None, [], 16)])


async def until(cond, timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_redis_restart_degrades_then_recovers(redis_server):  # noqa: F811
    state = RedisState(redis_server.url, probe_interval=0.05)
    assert await state.connect()
    shared = SharedIndex(RedisIndex(state), mirror=MemoryIndex())
    load = SharedLoad(state, "r1")
    other = RedisIndex(RedisState(redis_server.url))  # another replica's view

    assert (await shared.apply(E, batch(1, 2), seq=0)).applied
    load.add(E, 1, 32)
    assert await load.flush()
    assert await shared.match([1, 2, 3]) == {E: Match(2)}

    redis_server.stop()
    t0 = time.monotonic()
    # no exception reaches the caller; answers come from the local view, fast
    assert await shared.match([1, 2, 3]) == {E: Match(2)}
    assert state.degraded and state.metrics()["redis_degraded"] == 1.0
    assert await shared.apply(E, batch(3), seq=1) is None  # mirror only, for now
    assert await shared.match([1, 2, 3]) == {E: Match(3)}
    load.add(E, 1, 16)
    assert await load.totals() == {E: Load(2, 48)}
    assert time.monotonic() - t0 < 2.0

    redis_server.start()  # empty: no persistence
    await until(lambda: not state.degraded)
    assert state.recoveries == 1
    # rebuilt from the mirror with its seq; load rewritten in full
    assert other.match([1, 2, 3]) == {E: Match(3)}
    assert other.last_seq(E) == 1
    assert await load.totals() == {E: Load(2, 48)}
    assert (await shared.apply(E, batch(4), seq=2)).applied
    assert other.match([1, 2, 3, 4]) == {E: Match(4)}
    await state.aclose()
    other.state.sync.close()


async def test_down_at_start_fails_fast(redis_server):  # noqa: F811
    url = redis_server.url
    redis_server.stop()
    state = RedisState(url, probe_interval=0.05)
    t0 = time.monotonic()
    assert not await state.connect()
    shared = SharedIndex(RedisIndex(state))
    assert await shared.match([1, 2]) == {}
    assert time.monotonic() - t0 < 1.0
    redis_server.start()
    await until(lambda: not state.degraded)
    await state.aclose()
