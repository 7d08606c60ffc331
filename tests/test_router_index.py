"""The block index and pending entries: every rule of design §3.1-§3.7, plus a model check."""

from __future__ import annotations

import random

from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index import Match, MemoryIndex
from router.instance import InstanceKey
from router.pending import PendingEntries

A = InstanceKey("http://a:8000")
B = InstanceKey("http://b:8000")
C = InstanceKey("http://b:8000", 1)


def stored(hashes, parent=None, medium="GPU", kind="full_attention", group=0):
    return BlockStored(
        list(hashes), parent, [0] * 16 * len(hashes), 16, None, medium, None, None, group, kind
    )


def batch(*events):
    return KVEventBatch(1.0, list(events), 0)


def test_instance_key_str_roundtrip():
    assert str(A) == "http://a:8000"
    assert str(C) == "http://b:8000#dp1"
    assert InstanceKey.parse(str(C)) == C
    assert InstanceKey.parse(str(A)) == A


def test_match_runs_from_block_zero_and_stops_at_first_gap():
    idx = MemoryIndex()
    idx.store(A, [1, 2, 3, 4])
    idx.store(B, [1, 2, 9, 4])  # holds block 3 but not block 2: its run ends at 2
    idx.store(C, [2, 3, 4])  # no block 0: no run at all
    m = idx.match([1, 2, 3, 4, 5])
    assert m == {A: Match(4), B: Match(2)}
    assert idx.match([7, 1, 2]) == {}
    assert idx.match([]) == {}
    assert idx.match([1, 2, 3, 4, 5], among=[B, C]) == {B: Match(2)}


def test_long_prompt_match_with_chunks():
    idx = MemoryIndex()
    hs = list(range(1000, 1600))
    idx.store(A, hs)
    idx.store(B, hs[:77])
    idx.store(C, hs[:64] + hs[65:])
    m = idx.match(hs)
    assert m == {A: Match(600), B: Match(77), C: Match(64)}


def test_refcount_duplicate_store_needs_two_removes():
    idx = MemoryIndex()
    idx.store(A, [1, 2])
    idx.store(A, [1])  # vLLM stored the same content twice
    assert idx.instance_hashes(A) == {1: 2, 2: 1}
    idx.remove(A, [1])
    assert idx.match([1, 2]) == {A: Match(2)}
    idx.remove(A, [1])
    assert idx.match([1, 2]) == {}
    assert idx.instance_hashes(A) == {2: 1}
    idx.remove(A, [1, 99])  # unknown removals are harmless
    assert idx.instance_hashes(A) == {2: 1}


def test_remove_of_one_instance_keeps_the_other():
    idx = MemoryIndex()
    idx.store(A, [1, 2])
    idx.store(B, [1, 2])
    idx.remove(A, [2])
    assert idx.match([1, 2]) == {A: Match(1), B: Match(2)}


def test_drop_instance_and_reuse():
    idx = MemoryIndex()
    idx.store(A, [1, 2, 3])
    idx.store(B, [1, 2])
    idx.store(A, [1])
    assert idx.drop_instance(A) == 3
    assert idx.match([1, 2, 3]) == {B: Match(2)}
    assert idx.instance_hashes(A) == {}
    idx.store(A, [1])
    assert idx.instance_hashes(A) == {1: 1}  # the duplicate count went with the drop
    assert idx.forget_instance(B) == 2
    assert B not in idx.instances()
    idx.store(InstanceKey("http://new:1"), [1])
    assert set(idx.match([1])) == {A, InstanceKey("http://new:1")}


def test_apply_batches_counts_and_filters_groups():
    idx = MemoryIndex()
    r = idx.apply(
        A,
        batch(
            stored([1, 2]),
            stored([3], parent=2),
            stored([50], kind="sliding_window", group=1),  # not a prefix group
            stored([60], kind=None, group=1),  # unknown kind, group 1: not indexed
            BlockRemoved([3], "GPU", 0),
            BlockRemoved([50], "GPU", 1),
        ),
    )
    assert (r.stored, r.removed, r.ignored, r.cleared) == (3, 1, 3, False)
    assert idx.instance_hashes(A) == {1: 1, 2: 1}
    assert idx.match([1, 2, 50]) == {A: Match(2)}


def test_bytes_and_signed_hashes_normalised():
    idx = MemoryIndex()
    big = (1 << 64) - 5
    idx.apply(A, batch(stored([b"\x00" * 24 + big.to_bytes(8, "big")])))
    idx.apply(B, batch(stored([big - (1 << 64)])))  # i64 view of the same bits
    assert idx.match([big]) == {A: Match(1), B: Match(1)}


def test_all_blocks_cleared_drops_only_that_instance():
    idx = MemoryIndex()
    idx.apply(A, batch(stored([1, 2])))
    idx.apply(B, batch(stored([1])))
    r = idx.apply(A, batch(AllBlocksCleared(), stored([7])))
    assert r.cleared
    assert idx.match([1, 2]) == {B: Match(1)}
    assert idx.match([7]) == {A: Match(1)}


def test_lower_tiers_extend_the_run():
    idx = MemoryIndex()
    idx.apply(A, batch(stored([1, 2])))
    idx.apply(A, batch(stored([3, 4], medium="CPU")))
    idx.apply(A, batch(stored([3], medium="cpu")))  # lowercase medium (Mooncake) is CPU too
    idx.apply(B, batch(stored([1, 2, 3], medium="STORAGE")))
    m = idx.match([1, 2, 3, 4, 5])
    assert m[A].blocks == 2 and dict(m[A].tier_blocks) == {"CPU": 4}
    assert m[A].best_tier_blocks == 4
    assert m[B].blocks == 0 and dict(m[B].tier_blocks) == {"STORAGE": 3}
    idx.apply(A, batch(BlockRemoved([3], "CPU")))
    assert dict(idx.match([1, 2, 3, 4])[A].tier_blocks) == {"CPU": 4}  # refcount 2 -> 1
    idx.apply(A, batch(BlockRemoved([3], "CPU")))
    assert dict(idx.match([1, 2, 3, 4])[A].tier_blocks) == {}
    assert idx.instance_hashes(A, "CPU") == {4: 1}
    st = idx.stats()
    assert st["instances"] == 2 and st["entries"] == 2 + 1 + 3 and st["approx_bytes"] > 0


def test_model_check_against_naive_refcounts():
    """Random stores/removes/drops: the index agrees with a plain Counter per instance."""
    rng = random.Random(7)
    insts = [InstanceKey(f"http://e{i}:1") for i in range(70)]  # > 64: big masks too
    idx = MemoryIndex()
    truth: dict[InstanceKey, dict[int, int]] = {i: {} for i in insts}
    universe = list(range(1, 400))
    for _ in range(4000):
        inst = rng.choice(insts)
        op = rng.random()
        hs = rng.sample(universe, rng.randint(1, 6))
        if op < 0.55:
            idx.store(inst, hs)
            for h in hs:
                truth[inst][h] = truth[inst].get(h, 0) + 1
        elif op < 0.98:
            idx.remove(inst, hs)
            for h in hs:
                if h in truth[inst]:
                    truth[inst][h] -= 1
                    if not truth[inst][h]:
                        del truth[inst][h]
        else:
            idx.drop_instance(inst)
            truth[inst] = {}
    for inst in insts:
        assert idx.instance_hashes(inst) == truth[inst]
    for _ in range(200):
        prompt = rng.sample(universe, 5)
        want = {}
        for inst in insts:
            run = 0
            while run < len(prompt) and prompt[run] in truth[inst]:
                run += 1
            if run:
                want[inst] = Match(run)
        assert idx.match(prompt) == want


def test_log_compaction_keeps_memory_bounded():
    idx = MemoryIndex()
    for r in range(30):
        hs = list(range(r * 1000, r * 1000 + 1000))
        idx.store(A, hs)
        idx.remove(A, hs)
    tier = idx._tiers["GPU"]
    assert len(tier.logs[idx._ids[A]]) <= 3000
    assert idx.stats()["entries"] == 0


# ------------------------------------------------------------------ pending entries


def test_pending_match_confirm_expire():
    p = PendingEntries(ttl_s=2.0)
    p.add(A, [1, 2, 3], now=10.0)
    p.add(B, [1, 2], now=10.5)
    assert p.count() == 5
    assert p.match([1, 2, 3, 4], now=11.0) == {A: 3, B: 2}
    assert p.match([9, 1], now=11.0) == {}
    assert p.confirm(A, [2]) == 1  # events arrived for block 2 only
    assert p.match([1, 2, 3], now=11.0) == {A: 1, B: 2}
    assert p.match([1, 2, 3], now=12.2) == {B: 2}  # A's entries expired, not yet swept
    assert p.expire(12.2) == 2
    assert p.count() == 2
    p.add(B, [1, 2], now=12.4)  # refreshed: the old heap item must not expire it
    assert p.expire(12.6) == 0
    assert p.match([1, 2], now=14.0) == {B: 2}
    assert p.expire(20.0) == 2 and p.count() == 0


def test_pending_drop_instance_and_zero_ttl():
    p = PendingEntries(ttl_s=5)
    p.add(A, [1, 2], 0.0)
    p.add(B, [1], 0.0)
    assert p.drop_instance(A) == 2
    assert p.match([1, 2], 1.0) == {B: 1}
    off = PendingEntries(ttl_s=0)
    off.add(A, [1], 0.0)
    assert off.count() == 0 and off.match([1], 0.0) == {}
