"""The block pool's rules from the seeds: worked examples, eviction order, duplicates, reset."""

from __future__ import annotations

from engine_shim.kv_cache_manager import KVCacheManager
from engine_shim.request import Request
from engine_shim.scheduler import Scheduler, SchedulerConfig
from events.model import AllBlocksCleared, BlockRemoved, BlockStored


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def admit(mgr: KVCacheManager, req: Request) -> int:
    """Admit and compute a whole prompt at once (as one scheduler step would)."""
    blocks, hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    req.num_computed_tokens = req.num_tokens
    return hit


def run_to_end(sched: Scheduler, outputs: dict[str, list[int]]) -> None:
    """Drive the scheduler; each request samples its scripted tokens in order."""
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sampled = {}
        for req, n in so.scheduled:
            if req.num_computed_tokens + n == req.num_tokens:
                sampled[req.request_id] = outputs[req.request_id][req.num_output_tokens]
        sched.update_from_output(so, sampled)


def test_two_chat_turns_hit_112_tokens():
    """Seed: a 75-token turn answered with 45 tokens, then a 150-token turn sharing 118."""
    mgr = KVCacheManager(64, 16)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=2048))
    prompt_a = toks(1000, 75)
    answer_a = toks(5000, 45)
    sched.add_request(Request("A", prompt_a, max_tokens=45))
    run_to_end(sched, {"A": answer_a})
    prompt_b = (prompt_a + answer_a)[:118] + toks(9000, 32)
    b = Request("B", prompt_b, max_tokens=1)
    sched.add_request(b)
    run_to_end(sched, {"B": [7]})
    assert b.num_cached_tokens == 112
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 225, 112)


def test_fully_cached_64_token_prompt_hits_48():
    mgr = KVCacheManager(16, 16)
    a = Request("a", toks(1, 64))
    admit(mgr, a)
    mgr.free(a)
    b = Request("b", toks(1, 64))
    assert admit(mgr, b) == 48
    # The last block is recomputed into a new block; the old copy stays cached (duplicate).
    assert mgr.get_block_ids("b")[:3] == [1, 2, 3]
    assert mgr.get_block_ids("b")[3] != 4
    last = mgr.scheme.block_hashes(toks(1, 64))[3]
    assert mgr.block_pool.cached_event_hashes().count(last) == 2


def test_80_token_prompt_sharing_30_tokens_hits_16():
    mgr = KVCacheManager(32, 16)
    admit(mgr, Request("old", toks(1, 80)))
    new = Request("new", toks(1, 30) + toks(500, 50))
    assert admit(mgr, new) == 16
    assert len(mgr.get_block_ids("new")) == 5


def test_free_order_tail_first_and_lru():
    """Freed chains go to the back tail-first; unhashed blocks to the front; eviction truncates
    a cached prefix from its tail, so the remaining prefix still hits."""
    mgr = KVCacheManager(9, 16)  # 8 usable blocks
    a = Request("a", toks(1, 72))  # 4 full blocks + 1 partial
    admit(mgr, a)
    ids = mgr.get_block_ids("a")
    assert ids == [1, 2, 3, 4, 5]
    mgr.take_events()
    mgr.free(a)
    q = mgr.block_pool.free_block_queue.block_ids()
    assert q == [5, 6, 7, 8, 4, 3, 2, 1]  # partial block 5 first, then the chain tail-first
    b = Request("b", toks(900, 80))  # needs 5 blocks: 5, 6, 7, 8, then evicts block 4
    admit(mgr, b)
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1
    assert removed[0].block_hashes == [mgr.scheme.block_hashes(toks(1, 72))[3]]
    # a's prefix lost only its last block: 3 blocks (48 tokens) still hit.
    mgr.free(b)
    assert admit(mgr, Request("a2", toks(1, 72))) == 48


def test_touch_before_pop_protects_own_hits():
    """A request whose hit blocks sit at the front of the free queue must not evict them."""
    mgr = KVCacheManager(5, 16)  # 4 usable blocks
    a = Request("a", toks(1, 48))
    admit(mgr, a)
    mgr.free(a)  # hashed blocks go to the back, tail first: [4, 3, 2, 1]
    x = Request("x", toks(700, 16))
    admit(mgr, x)  # takes block 4 and caches it
    mgr.free(x)
    assert mgr.block_pool.free_block_queue.block_ids() == [3, 2, 1, 4]
    mgr.take_events()
    b = Request("b", toks(1, 48) + toks(200, 10))
    assert admit(mgr, b) == 48
    assert mgr.get_block_ids("b") == [1, 2, 3, 4]
    removed = [e.block_hashes for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [mgr.scheme.block_hashes(toks(700, 16))]


def test_admission_counts_free_hit_blocks():
    mgr = KVCacheManager(5, 16)  # 4 usable
    a = Request("a", toks(1, 48))
    admit(mgr, a)
    mgr.free(a)
    hold = Request("hold", toks(700, 16))
    admit(mgr, hold)  # pops block 4 (unhashed) -> 3 free, all a's hit blocks
    b = Request("b", toks(1, 48) + toks(200, 20))  # 3 hits (free) + 2 new = 5 > 3
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 48
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is None
    assert mgr.get_block_ids("b") == []


def test_duplicates_are_kept_and_removed_one_by_one():
    mgr = KVCacheManager(16, 16)
    a, b = Request("a", toks(1, 20)), Request("b", toks(1, 20))
    admit(mgr, a)
    assert admit(mgr, b) == 16  # a running request's full block is shared, not duplicated
    assert mgr.get_block_ids("b")[0] == mgr.get_block_ids("a")[0]
    # Now two requests compute the same content concurrently: both blocks are cached.
    c, d = Request("c", toks(300, 17)), Request("d", toks(300, 17))
    blocks_c, _ = mgr.get_computed_blocks(c)
    blocks_d, _ = mgr.get_computed_blocks(d)
    assert mgr.allocate_slots(c, 17, 0, blocks_c) is not None
    assert mgr.allocate_slots(d, 17, 0, blocks_d) is not None
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    h = mgr.scheme.block_hashes(toks(300, 17))[0]
    assert [e.block_hashes for e in stored[-2:]] == [[h], [h]]
    assert mgr.block_pool.cached_event_hashes().count(h) == 2


def test_reset_refused_under_load_then_clears_idle():
    mgr = KVCacheManager(8, 16)
    a = Request("a", toks(1, 40))
    admit(mgr, a)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is False
    assert mgr.take_events() == []
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.block_pool.cached_event_hashes() == []
    assert admit(mgr, Request("a2", toks(1, 40))) == 0


def test_report_mode_full_reannounces_hits():
    mgr = KVCacheManager(16, 16)
    admit(mgr, Request("a", toks(1, 40)))
    mgr.take_events()
    b = Request("b", toks(1, 40), kv_cache_report_mode="full")
    assert admit(mgr, b) == 32
    (ev,) = mgr.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is None
    assert ev.block_hashes == mgr.scheme.block_hashes(toks(1, 40))
    assert ev.token_ids == toks(1, 32)
    c = Request("c", toks(1, 40))  # incremental: nothing to say
    assert admit(mgr, c) == 32
    assert mgr.take_events() == []


def test_salt_and_lora_in_events_and_hashes():
    mgr = KVCacheManager(16, 16)
    a = Request("a", toks(1, 32), cache_salt="s1")
    admit(mgr, a)
    (ev,) = mgr.take_events()
    assert ev.extra_keys == [["s1"], None]
    assert ev.block_hashes == mgr.scheme.block_hashes(toks(1, 32), cache_salt="s1")
    assert admit(mgr, Request("b", toks(1, 40))) == 0  # the salt changes block 0 onwards
    lo = Request("l", toks(1, 32), lora_name="ad", lora_path="/p", lora_int_id=3)
    admit(mgr, lo)
    ev = [e for e in mgr.take_events() if isinstance(e, BlockStored)][-1]
    assert (ev.lora_id, ev.lora_name, ev.extra_keys) == (3, "ad", [["ad"], ["ad"]])


def test_prompt_logprobs_skips_lookup_and_stats():
    mgr = KVCacheManager(16, 16)
    admit(mgr, Request("a", toks(1, 40)))
    b = Request("b", toks(1, 40), skip_reading_prefix_cache=True)
    assert mgr.get_computed_blocks(b) == ([], 0)
    mgr.record_prefix_cache_stats(b, 0)
    assert mgr.make_prefix_cache_stats().queries == 0


def test_generated_tokens_fill_and_hash_blocks():
    mgr = KVCacheManager(16, 16)
    r = Request("r", toks(1, 10))
    admit(mgr, r)
    assert mgr.take_events() == []
    for t in range(6):
        r.append_output_token_ids(100 + t)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    (ev,) = mgr.take_events()
    assert ev.token_ids == toks(1, 10) + toks(100, 6)
    assert len(r.block_hashes) == 1
