"""Replay a trace recorded from vLLM 0.33's own KVCacheManager against the shim's, step for step.

Every step must give the same hit sizes, block ids, free-queue order, free-block count and
KV events (compared as decoded events and as encoded bytes).
"""

from __future__ import annotations

import pytest
from conftest import load_vector

from engine_shim.kv_cache_manager import KVCacheManager
from engine_shim.request import Request
from events.codec import batch_to_dict, encode_batch
from events.model import KVEventBatch

TRACE = load_vector("blockpool_trace_sha256_cbor.json")


def _make_request(rid: str, spec: dict) -> Request:
    lora = spec.get("lora") or {}
    return Request(
        rid,
        spec["prompt_token_ids"],
        cache_salt=spec.get("cache_salt"),
        lora_name=lora.get("lora_name"),
        lora_path=lora.get("lora_path"),
        lora_int_id=lora.get("lora_int_id"),
        kv_cache_report_mode=spec.get("kv_cache_report_mode", "incremental"),
    )


def _apply(mgr: KVCacheManager, reqs: dict[str, Request], op: dict, where: str) -> None:
    kind = op["op"]
    if kind == "admit":
        rid = op["rid"]
        req = reqs.get(rid) or reqs.setdefault(rid, _make_request(rid, TRACE["requests"][rid]))
        blocks, hit = mgr.get_computed_blocks(req)
        assert hit == op["cache_hit_tokens"], where
        new = mgr.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        if op.get("result") == "NO_SPACE":
            assert new is None, where
            return
        assert new is not None, where
        assert req.num_tokens == op["num_tokens"], where
        req.num_computed_tokens = req.num_tokens
        assert mgr.get_block_ids(rid) == op["block_ids"], where
    elif kind == "decode":
        req = reqs[op["rid"]]
        req.append_output_token_ids(op["tokens"])
        assert mgr.allocate_slots(req, len(op["tokens"])) is not None, where
        req.num_computed_tokens = req.num_tokens
        assert req.num_tokens == op["num_tokens"], where
        assert mgr.get_block_ids(req.request_id) == op["block_ids"], where
    elif kind in ("finish", "preempt"):
        req = reqs[op["rid"]]
        assert mgr.get_block_ids(req.request_id) == op["freed_block_ids_in_alloc_order"], where
        mgr.free(req)
        if kind == "preempt":
            req.num_computed_tokens = 0
            req.num_preemptions += 1
    elif kind == "reset_prefix_cache":
        assert mgr.reset_prefix_cache() is op["ok"], where
    else:
        raise AssertionError(f"{where}: unknown op {kind}")


def test_trace_header_matches_this_replay():
    assert TRACE["algo"] == "sha256_cbor" and TRACE["PYTHONHASHSEED"] is None
    mgr = KVCacheManager(TRACE["num_gpu_blocks"], TRACE["block_size"])
    assert mgr.scheme.none_hash.hex() == TRACE["none_hash_hex"]
    assert mgr.block_pool.null_block.block_id == TRACE["null_block_id"]


def test_replay_every_step():
    mgr = KVCacheManager(
        TRACE["num_gpu_blocks"],
        TRACE["block_size"],
        hash_algo=TRACE["algo"],
        hash_seed=TRACE["PYTHONHASHSEED"],
        enable_caching=TRACE["enable_caching"],
    )
    reqs: dict[str, Request] = {}
    for step in TRACE["steps"]:
        where = f"step {step['step']} ({step['label']})"
        for op in step["ops"]:
            _apply(mgr, reqs, op, where)
        assert mgr.get_num_free_blocks() == step["num_free_blocks"], where
        assert mgr.block_pool.free_block_queue.block_ids() == step["free_queue_block_ids"], where
        events = mgr.take_events()
        expected = step["kv_event_batch"]
        if not step["events"]:
            assert events == [], where
            assert not expected, where
            continue
        batch = KVEventBatch(ts=expected["batch"][0], events=events, data_parallel_rank=0)
        got = batch_to_dict(batch)["events"]
        want = [
            {**{k: None for k in e_got}, **e_want}
            for e_got, e_want in zip(got, step["events"], strict=True)
        ]
        assert got == want, where
        assert encode_batch(batch).hex() == expected["payload_hex"], where
    for rid, spec in TRACE["requests"].items():
        if rid in reqs:
            assert [h.hex() for h in reqs[rid].block_hashes] == spec["block_hashes_hex"], rid


@pytest.mark.parametrize("rid", sorted(TRACE["requests"]))
def test_request_hashes_match_vllm(rid):
    spec = TRACE["requests"][rid]
    mgr = KVCacheManager(TRACE["num_gpu_blocks"], TRACE["block_size"])
    req = _make_request(rid, spec)
    mgr.get_computed_blocks(req)  # attaches the manager's hasher
    req.append_output_token_ids(spec["output_token_ids"])
    assert [h.hex() for h in req.block_hashes] == spec["block_hashes_hex"]
