"""RedisIndex against a real redis-server: the MemoryIndex contract, plus what only a shared
index has (one round trip per match, atomic apply + seq, lease fence, pending, refill)."""

from __future__ import annotations

import random

import pytest
from redis_server import redis_server  # noqa: F401  (fixture)

from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index import Match, MemoryIndex
from router.instance import InstanceKey
from router.redis_index import RedisIndex
from router.redis_state import RedisState

A, B, C = (
    InstanceKey("http://a:8000"),
    InstanceKey("http://b:8000"),
    InstanceKey("http://c:8000", 1),
)


@pytest.fixture
def rindex(redis_server):  # noqa: F811
    idx = RedisIndex(RedisState(redis_server.url + "?ns=m1"))
    yield idx
    idx.state.sync.close()


@pytest.fixture(params=["memory", "redis"])
def index(request, redis_server):  # noqa: F811
    if request.param == "memory":
        yield MemoryIndex()
    else:
        idx = RedisIndex(RedisState(redis_server.url))
        yield idx
        idx.state.sync.close()


def stored(hashes, parent=None, medium=None, **kw) -> BlockStored:
    return BlockStored(list(hashes), parent, [], 16, medium=medium, **kw)


# ---------------------------------------------------------------- the shared contract


def test_runs_stop_at_first_gap(index):
    index.store(A, [1, 2, 3, 4])
    index.store(B, [1, 2])
    index.store(B, [4])  # not a run: block 2 (hash 3) missing
    assert index.match([1, 2, 3, 4, 5]) == {A: Match(4), B: Match(2)}
    assert index.match([9, 1, 2]) == {}
    assert index.match([]) == {}
    assert index.match([1, 2, 3, 4, 5], among=[B]) == {B: Match(2)}


def test_refcount_duplicates(index):
    index.store(A, [1, 2])
    index.store(A, [1, 2])
    index.remove(A, [2])
    assert index.match([1, 2]) == {A: Match(2)}
    assert index.instance_hashes(A) == {1: 2, 2: 1}
    index.remove(A, [2, 77])  # unknown hash ignored
    assert index.match([1, 2]) == {A: Match(1)}


def test_drop_instance(index):
    index.store(A, [1, 2, 3])
    index.store(A, [3], "CPU")
    index.store(B, [1, 2])
    assert index.drop_instance(A) == 4
    assert index.match([1, 2, 3]) == {B: Match(2)}
    assert index.instance_hashes(A) == {}
    assert index.drop_instance(InstanceKey("http://never")) == 0


def test_tiers(index):
    index.store(A, [1, 2], "GPU")
    index.store(A, [3, 4], "CPU")
    index.store(B, [1, 2, 3], "CPU")
    got = index.match([1, 2, 3, 4, 5])
    assert got == {A: Match(2, {"CPU": 4}), B: Match(0, {"CPU": 3})}


def test_apply_batch(index):
    batch = KVEventBatch(
        ts=0.0,
        events=[
            stored([10, 11, 12]),
            stored([13], parent=12, group_idx=1),  # another KV group: not indexed
            BlockRemoved([12], medium="GPU"),
        ],
    )
    res = index.apply(A, batch)
    assert (res.stored, res.removed, res.ignored, res.cleared) == (3, 1, 1, False)
    assert index.match([10, 11, 12, 13]) == {A: Match(2)}
    res = index.apply(A, KVEventBatch(ts=1.0, events=[AllBlocksCleared(), stored([20])]))
    assert res.cleared
    assert index.match([10]) == {}
    assert index.match([20]) == {A: Match(1)}


def test_random_ops_agree_with_memory(redis_server):  # noqa: F811
    """Differential check: a few thousand random stores/removes/drops on both indexes, then
    every prefix of a set of chains must match identically."""
    rnd = random.Random(7)
    mem = MemoryIndex()
    red = RedisIndex(RedisState(redis_server.url))
    insts = [InstanceKey(f"http://e{i}:8000", i % 2) for i in range(6)]
    chains = [[rnd.getrandbits(64) for _ in range(40)] for _ in range(8)]
    for _ in range(400):
        inst = rnd.choice(insts)
        chain = rnd.choice(chains)
        a = rnd.randrange(0, 40)
        b = rnd.randrange(a, 41)
        medium = rnd.choice(["GPU", "GPU", "GPU", "CPU"])
        op = rnd.random()
        for idx in (mem, red):
            if op < 0.6:
                idx.store(inst, chain[a:b], medium)
            elif op < 0.97:
                idx.remove(inst, chain[a:b], medium)
            else:
                idx.drop_instance(inst)
    for chain in chains:
        for n in (1, 5, 17, 40):
            assert red.match(chain[:n]) == mem.match(chain[:n])
            assert red.match(chain[:n], among=insts[:3]) == mem.match(chain[:n], among=insts[:3])
    for inst in insts:
        for medium in ("GPU", "CPU"):
            assert red.instance_hashes(inst, medium) == mem.instance_hashes(inst, medium)
    assert red.stats()["entries"] == mem.stats()["entries"]


# ---------------------------------------------------------------- Redis only


def test_match_is_one_round_trip(rindex):
    rindex.store(A, list(range(1, 513)))
    rindex.store(B, list(range(1, 100)))
    rindex.match([1])  # first use loads the script (NOSCRIPT -> SCRIPT LOAD -> EVALSHA)
    mon = RedisState(rindex.state.config).sync
    before = mon.info("commandstats")
    got = rindex.match(list(range(1, 513)))
    after = mon.info("commandstats")
    assert got == {A: Match(512), B: Match(99)}
    calls = {
        k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"]
        for k in after
        if not k.startswith("cmdstat_info")
    }
    # the client sent exactly one command (EVALSHA); everything else ran inside the script
    sent = {k: v for k, v in calls.items() if k in ("cmdstat_evalsha", "cmdstat_eval") and v}
    assert sent == {"cmdstat_evalsha": 1}


def test_apply_seq_is_atomic_and_idempotent(rindex):
    batch = KVEventBatch(ts=0.0, events=[stored([1, 2, 3])])
    assert rindex.apply_seq(A, batch, seq=5).applied
    again = rindex.apply_seq(A, batch, seq=5)
    assert not again.applied and not again.fenced
    assert not rindex.apply_seq(A, batch, seq=4).applied
    assert rindex.instance_hashes(A) == {1: 1, 2: 1, 3: 1}  # applied once
    assert rindex.last_seq(A) == 5
    assert rindex.apply_seq(A, KVEventBatch(ts=0.0, events=[stored([4], 3)]), seq=6).applied
    assert rindex.match([1, 2, 3, 4]) == {A: Match(4)}
    # an engine restart (seq back to 0): drop_instance forgets blocks and seq
    rindex.drop_instance(A)
    assert rindex.last_seq(A) is None
    assert rindex.apply_seq(A, batch, seq=0).applied


def test_apply_is_fenced_by_the_lease(rindex):
    r = rindex.state.sync
    r.set(rindex.P + "lease:" + str(A), "replica-1", px=5000)
    batch = KVEventBatch(ts=0.0, events=[stored([1])])
    res = rindex.apply_seq(A, batch, seq=1, token="replica-2")
    assert res.fenced and not res.applied
    assert rindex.match([1]) == {}
    assert rindex.apply_seq(A, batch, seq=1, token="replica-1").applied


def test_pending_entries_expire(redis_server):  # noqa: F811
    idx = RedisIndex(RedisState(redis_server.url), pending=True)
    idx.store(A, [1])
    idx.add_pending(B, [1, 2, 3], ttl_ms=300)
    assert idx.match([1, 2, 3]) == {A: Match(1), B: Match(3)}
    r = idx.state.sync
    assert 0 < r.pttl(idx.P + "p:" + f"{2:016x}") <= 300
    import time

    deadline = time.monotonic() + 5
    while idx.match([1, 2, 3]) != {A: Match(1)}:
        assert time.monotonic() < deadline, "pending entries never expired"
        time.sleep(0.05)
    assert r.exists(idx.P + "p:" + f"{2:016x}") == 0


async def test_refill_from_mirror_and_pipelined_apply(rindex):
    mirror = MemoryIndex()
    mirror.store(A, [1, 2, 3])
    mirror.store(A, [1])
    mirror.store(A, [4], "CPU")
    rindex.store(A, [99])  # stale content that the refill must replace
    assert await rindex.arefill(A, mirror, seq=41) == 4
    assert rindex.instance_hashes(A) == {1: 2, 2: 1, 3: 1}
    assert rindex.instance_hashes(A, "CPU") == {4: 1}
    assert rindex.match([99]) == {}
    assert await rindex.alast_seq(A) == 41
    items = [(41, KVEventBatch(0.0, [stored([5])])), (42, KVEventBatch(0.0, [stored([6])]))]
    res = await rindex.aapply_many(A, items)
    assert [r.applied for r in res] == [False, True]
    assert await rindex.amatch([1, 2, 3, 6]) == {A: Match(4)}  # 6 went in, 5 did not
    assert await rindex.amatch([5]) == {}
    assert rindex.instance_hashes(A).get(6) == 1
    await rindex.state.aclose()


def test_namespaces_are_separate_and_share_a_slot(redis_server):  # noqa: F811
    one = RedisIndex(RedisState(redis_server.url + "?ns=llama"))
    two = RedisIndex(RedisState(redis_server.url + "?ns=qwen"))
    one.store(A, [1])
    assert two.match([1]) == {}
    keys = [k.decode() for k in one.state.sync.keys("*")]
    assert keys and all(k.startswith("pr:{llama}:") for k in keys)
    with pytest.raises(ValueError):
        RedisState("http://localhost:6379")
