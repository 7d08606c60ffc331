"""The scheduler: token budget, chunked prefill, max_num_seqs, preemption, one batch per step."""

from __future__ import annotations

from engine_shim.kv_cache_manager import KVCacheManager
from engine_shim.request import Request, RequestStatus
from engine_shim.scheduler import Scheduler, SchedulerConfig
from events.model import BlockStored, KVEventBatch


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def make(blocks=64, budget=2048, seqs=128, max_len=512):
    batches: list[KVEventBatch] = []
    mgr = KVCacheManager(blocks, 16)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=max_len)
    return Scheduler(mgr, cfg, publish=batches.append), mgr, batches


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    sampled = {
        r.request_id: token for r, n in so.scheduled if r.num_computed_tokens + n == r.num_tokens
    }
    return so, sched.update_from_output(so, sampled)


def test_chunked_prefill_splits_a_long_prompt():
    sched, _, batches = make(budget=64)
    sched.add_request(Request("r", toks(1, 150), max_tokens=2))
    chunks = []
    while True:
        so, outs = step(sched)
        chunks.append(so.num_scheduled_tokens.get("r"))
        if outs:
            break
    assert chunks == [64, 64, 22]
    # Each chunk's full blocks were announced in their own step, chained by parent.
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [4, 4, 1]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]


def test_budget_is_shared_decodes_first():
    sched, _, _ = make(budget=40)
    sched.add_request(Request("a", toks(1, 30), max_tokens=5))
    step(sched)  # a's whole prompt
    sched.add_request(Request("b", toks(500, 100), max_tokens=5))
    so, _ = step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 39}


def test_max_num_seqs_limits_admission():
    sched, _, _ = make(seqs=2)
    for i in range(3):
        sched.add_request(Request(f"r{i}", toks(100 * i + 1, 10), max_tokens=3))
    so, _ = step(sched)
    assert set(so.num_scheduled_tokens) == {"r0", "r1"}
    assert sched.num_waiting == 1


def test_preemption_of_newest_by_recompute():
    # 6 usable blocks: two 48-token prompts take 3 each; the first decode needs a 4th block.
    sched, mgr, _ = make(blocks=7, max_len=96)
    a, b = Request("a", toks(1, 48), max_tokens=20), Request("b", toks(500, 48), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled: 3 blocks each, pool full
    assert mgr.get_num_free_blocks() == 0
    so, _ = step(sched)  # a needs block 4: b (newest) is preempted
    assert so.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b
    assert so.num_scheduled_tokens == {"a": 1}
    # a grows into b's freed blocks tail first (evicting b's blocks 2 and 1); once a is done,
    # b resumes: its block 0 still hits, the rest (with its first output token) is recomputed.
    while a.status == RequestStatus.RUNNING:
        step(sched)
    so, _ = step(sched)
    assert b.num_tokens == 50  # 48 prompt + 1 output before preemption + 1 after resuming
    assert so.num_scheduled_tokens == {"b": 49 - 16}
    assert b.num_preemptions == 1


def test_one_batch_per_step_only_with_events():
    sched, _, batches = make()
    sched.add_request(Request("r", toks(1, 20), max_tokens=3))
    step(sched)  # block 0 full: one batch
    assert len(batches) == 1 and batches[0].data_parallel_rank == 0
    step(sched)  # decode, no new full block: nothing published
    assert len(batches) == 1


def test_finish_on_length_and_eos_and_abort_frees():
    sched, mgr, _ = make()
    free0 = mgr.get_num_free_blocks()
    r = Request("r", toks(1, 20), max_tokens=3)
    sched.add_request(r)
    outs = []
    while sched.has_unfinished_requests():
        outs += step(sched)[1]
    assert [o.finished for o in outs] == [False, False, True]
    assert outs[-1].finish_reason == "length" and r.num_output_tokens == 3
    assert mgr.get_num_free_blocks() == free0
    e = Request("e", toks(1, 20), max_tokens=10, ignore_eos=False, eos_token_id=7)
    sched.add_request(e)
    _, outs = step(sched, token=7)
    assert outs[0].finished and outs[0].finish_reason == "stop"
    x = Request("x", toks(1, 20), max_tokens=10)
    sched.add_request(x)
    step(sched)
    assert mgr.get_num_free_blocks() < free0
    sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert mgr.get_num_free_blocks() == free0 and not sched.has_unfinished_requests()


def test_prefix_hit_reported_once_per_request():
    sched, _, _ = make()
    sched.add_request(Request("a", toks(1, 40), max_tokens=1))
    step(sched)
    b = Request("b", toks(1, 40), max_tokens=1)
    sched.add_request(b)
    _, outs = step(sched)
    assert outs[0].num_cached_tokens == 32 == b.num_cached_tokens
