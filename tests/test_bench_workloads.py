"""Workload generators: seeded determinism, JSONL round trip, Mooncake hash_ids -> chunks."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ is not an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools
import json

import pytest

from bench import workloads as wl
from events.hashing import HashScheme
from events.tokenizer import encode_chat

GENERATORS = {
    "chat": lambda seed: wl.chat_workload(sessions=5, turns=3, seed=seed),
    "shared": lambda seed: wl.shared_prompt_workload(requests=20, seed=seed),
    "agent": lambda seed: wl.agent_workload(loops=4, steps=3, seed=seed),
    "unique": lambda seed: wl.unique_workload(requests=10, seed=seed),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_same_seed_same_workload_other_seed_differs(name):
    a = [r.to_json() for r in GENERATORS[name](1)]
    b = [r.to_json() for r in GENERATORS[name](1)]
    c = [r.to_json() for r in GENERATORS[name](2)]
    assert a == b
    assert a != c
    assert [r["t"] for r in a] == sorted(r["t"] for r in a)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_jsonl_round_trip(tmp_path, name):
    reqs = GENERATORS[name](3)
    path = tmp_path / f"{name}.jsonl"
    wl.write_jsonl(path, reqs, {"name": name, "seed": 3})
    back, meta = wl.read_jsonl(path)
    assert meta == {"name": name, "seed": 3}
    assert [r.to_json() for r in back] == [r.to_json() for r in reqs]


def test_mooncake_round_trip_keeps_token_prompts(tmp_path):
    reqs = wl.mooncake_workload(limit=5)
    wl.write_jsonl(tmp_path / "m.jsonl", reqs)
    back, _ = wl.read_jsonl(tmp_path / "m.jsonl")
    assert [r.prompt for r in back] == [r.prompt for r in reqs]
    assert all(r.kind == "completions" for r in back)


def test_read_jsonl_names_the_bad_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    good = wl.unique_workload(requests=1)[0].to_json()
    p.write_text(json.dumps(good) + "\n" + '{"id": "x", "t": 0, "kind": "chat", "messages": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'max_tokens'"):
        wl.read_jsonl(p)
    p.write_text(json.dumps({**good, "kind": "embeddings"}) + "\n")
    with pytest.raises(ValueError, match=r":1: kind must be chat or completions"):
        wl.read_jsonl(p)


def test_chat_turn_prompt_is_a_prefix_of_the_next_turn(tokenizer):
    reqs = [r for r in wl.chat_workload(sessions=2, turns=3, seed=0) if r.session == "chat-0"]
    reqs.sort(key=lambda r: r.turn)
    toks = [encode_chat(tokenizer, r.messages) for r in reqs]
    for a, b in itertools.pairwise(toks):
        assert b[: len(a)] == a and len(b) > len(a)


def test_shared_prompts_share_the_system_prompt():
    reqs = wl.shared_prompt_workload(requests=40, system_prompts=3, seed=0)
    by_group: dict[str, set[str]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.messages[0]["content"])
    assert all(len(v) == 1 for v in by_group.values())
    assert len(by_group) <= 3
    assert len({r.messages[1]["content"] for r in reqs}) == len(reqs)


def test_scale_to_rate():
    reqs = wl.unique_workload(requests=50, rate=5.0, seed=0)
    fast = wl.scale_to_rate(reqs, 20.0)
    assert wl.request_rate(fast) == pytest.approx(20.0)
    assert [r.id for r in fast] == [r.id for r in reqs]
    assert reqs[1].t != fast[1].t  # the input is not changed in place
    with pytest.raises(ValueError):
        wl.scale_to_rate(reqs, 0)


def test_mooncake_equal_hash_ids_give_equal_chunks():
    a = wl.mooncake_prompt([7, 8, 9], 3 * 512)
    b = wl.mooncake_prompt([7, 8, 10], 2 * 512 + 100)
    assert a[:1024] == b[:1024]
    assert a[1024:1124] != b[1024:]
    assert len(b) == 1124
    assert wl.mooncake_chunk(7) == a[:512] and wl.mooncake_chunk(8) == a[512:1024]
    assert wl.mooncake_chunk(7) != wl.mooncake_chunk(8)
    # so the engine's 16-token blocks of the shared 512-token chunks hash the same
    scheme = HashScheme(block_size=16)
    ha, hb = scheme.block_hashes(a), scheme.block_hashes(b)
    assert ha[:64] == hb[:64] and ha[64] != hb[64]
    with pytest.raises(ValueError, match="needs 3 hash_ids"):
        wl.mooncake_prompt([1, 2], 1025)


def test_synthetic_trace_has_the_mooncake_shape_and_shares_prefixes():
    lines = wl.read_mooncake_trace(wl.SYNTHETIC_TRACE)
    assert len(lines) >= 100
    ts = [d["timestamp"] for d in lines]
    assert ts == sorted(ts)
    for d in lines:
        n = len(d["hash_ids"])
        assert 512 * (n - 1) < d["input_length"] <= 512 * n
        assert d["output_length"] > 0
    firsts = [d["hash_ids"][0] for d in lines]
    assert len(set(firsts)) < len(firsts) / 4  # popular documents are reused
    assert lines == wl.make_mooncake_trace()  # the shipped file is the seeded generator's output


def test_bad_mooncake_line_is_an_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 5, "output_length": 1}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1: not a Mooncake trace line"):
        wl.read_mooncake_trace(p)


def test_request_bodies_stream_with_usage():
    chat = wl.chat_workload(sessions=1, turns=1)[0].body("m")
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"] and "prompt" not in chat
    comp = wl.mooncake_workload(limit=1)[0].body("m")
    assert isinstance(comp["prompt"], list) and "messages" not in comp
