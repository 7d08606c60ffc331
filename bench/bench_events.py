"""Speed of the events/ library against floors measured in the same run.

* Hash chain of an 8,192-token prompt (512 blocks of 16) with sha256_cbor, against the floor:
  bare ``hashlib.sha256`` over the same 512 pre-built CBOR inputs (target: at most 2x), and
  next to the obvious implementation (one ``cbor2.dumps`` per block) and pickle ``sha256``.
* Decoding 128-block batches on one core (target: at least 1 M blocks/s), for the two
  shapes an engine sends: one BlockStored of 128 blocks, and 128 one-hash BlockRemoved
  events (vLLM evicts block by block); next to a bare ``msgpack.unpackb`` of the same bytes.
* Publisher -> subscriber over loopback TCP, in one process (batches/s, gap repair on).

    .venv/bin/python -m bench.bench_events [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import sys
import time
from collections.abc import Callable

import cbor2
import msgpack

from events.codec import decode_batch, encode_batch
from events.hashing import HashScheme
from events.model import BlockRemoved, BlockStored, KVEventBatch
from events.publisher import ZmqEventPublisher
from events.subscriber import EventSubscriber

BS = 16
PROMPT_TOKENS = 8192
VOCAB = 151_643  # Qwen-sized ids: most tokens take the 5-byte CBOR form, the costly case


def best_of(fn: Callable[[], object], repeats: int, number: int) -> float:
    """Seconds per call: the best of ``repeats`` runs of ``number`` calls (least noise)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


# --------------------------------------------------------------------------------------
# Hash chain


def bench_hash(repeats: int, number: int) -> dict:
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    scheme = HashScheme()
    digests = scheme.block_digests(tokens)
    assert len(digests) == PROMPT_TOKENS // BS

    # The floor's inputs: exactly the bytes the chain hashes (checked against cbor2).
    parents = [scheme.none_hash, *digests[:-1]]
    inputs = [
        cbor2.dumps((parents[i], tuple(tokens[i * BS : (i + 1) * BS]), None), canonical=True)
        for i in range(len(digests))
    ]
    assert [hashlib.sha256(x).digest() for x in inputs] == digests
    sha = hashlib.sha256

    def floor() -> None:
        for x in inputs:
            sha(x).digest()

    def ours() -> None:
        scheme.block_digests(tokens)

    def cbor2_per_block() -> None:
        parent = scheme.none_hash
        for i in range(len(digests)):
            obj = (parent, tuple(tokens[i * BS : (i + 1) * BS]), None)
            parent = sha(cbor2.dumps(obj, canonical=True)).digest()

    pickle_scheme = HashScheme(algo="sha256")

    def pickle_chain() -> None:
        pickle_scheme.block_digests(tokens)

    def pickle_generic() -> None:
        parent = pickle_scheme.none_hash
        for i in range(len(digests)):
            obj = (parent, tuple(tokens[i * BS : (i + 1) * BS]), None)
            parent = sha(pickle.dumps(obj, protocol=5)).digest()

    cands = [
        ("floor: hashlib.sha256 over 512 pre-built inputs", floor),
        ("ours: HashScheme(sha256_cbor).block_digests", ours),
        ("cbor2.dumps(canonical=True) per block", cbor2_per_block),
        ("ours: HashScheme(sha256).block_digests (pickle)", pickle_chain),
        ("pickle.dumps per block (vLLM's sha256)", pickle_generic),
    ]
    # Interleaved, best of many short runs: the floor and each candidate see the same load.
    res = {name: float("inf") for name, _ in cands}
    for _ in range(repeats * 10):
        for name, fn in cands:
            res[name] = min(res[name], best_of(fn, 1, max(1, number // 5)))
    return res


# --------------------------------------------------------------------------------------
# Decoding


def stored_batch(rng: random.Random, blocks: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=[rng.getrandbits(64) for _ in range(blocks)],
                parent_block_hash=rng.getrandbits(64),
                token_ids=[rng.randrange(VOCAB) for _ in range(blocks * BS)],
                block_size=BS,
                medium="GPU",
                extra_keys=[None] * blocks,
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        ],
        data_parallel_rank=0,
    )


def removed_batch(rng: random.Random, blocks: int) -> KVEventBatch:
    return KVEventBatch(
        ts=time.time(),
        events=[
            BlockRemoved(block_hashes=[rng.getrandbits(64)], medium="GPU", group_idx=0)
            for _ in range(blocks)
        ],
        data_parallel_rank=0,
    )


def bench_decode(repeats: int, number: int, blocks: int = 128) -> dict:
    rng = random.Random(2)
    res = {}
    for shape, make in (
        ("1 BlockStored x 128 blocks", stored_batch),
        ("128 BlockRemoved x 1 block", removed_batch),
    ):
        payload = encode_batch(make(rng, blocks))
        assert decode_batch(payload) is not None
        t_ours = best_of(lambda p=payload: decode_batch(p), repeats, number)
        t_raw = best_of(lambda p=payload: msgpack.unpackb(p), repeats, number)
        res[shape] = {
            "payload_bytes": len(payload),
            "decode_us": t_ours * 1e6,
            "blocks_per_s": blocks / t_ours,
            "msgpack_unpackb_us": t_raw * 1e6,
        }
    return res


# --------------------------------------------------------------------------------------
# Publisher -> subscriber


def bench_pubsub(n: int) -> dict:
    rng = random.Random(3)
    batches = [stored_batch(rng, 4) for _ in range(64)]
    pub = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=n + 1000)
    sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    try:
        # Slow joiner: publish probes until the SUB is connected.
        deadline = time.monotonic() + 10
        last = None
        while last is None and time.monotonic() < deadline:
            pub.publish(batches[0])
            item = sub.recv(0.05)
            last = item.seq if item else None
        assert last is not None, "subscriber never connected"
        pub.flush()
        while (item := sub.recv(0.2)) is not None:
            last = item.seq
        start_seq = last + 1
        t0 = time.perf_counter()
        for i in range(n):
            pub.publish(batches[i % len(batches)])
        got = 0
        while got < n:
            item = sub.recv(5.0)
            assert item is not None and item.kind == "batch", item
            got += 1
        dt = time.perf_counter() - t0
        assert item.seq == start_seq + n - 1
        return {
            "batches": n,
            "seconds": dt,
            "batches_per_s": n / dt,
            "gaps": sub.stats.gaps,
            "replayed": sub.stats.replayed,
        }
    finally:
        sub.close()
        pub.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    reps, num = (3, 5) if args.quick else (7, 20)

    print(f"python {sys.version.split()[0]}; best of {reps} runs of {num} calls\n")
    h = bench_hash(reps, num)
    floor = next(iter(h.values()))
    print(
        f"Hash chain, {PROMPT_TOKENS} tokens = {PROMPT_TOKENS // BS} blocks of {BS} (ids < {VOCAB}):"
    )
    for name, t in h.items():
        print(f"  {name:<52} {t * 1e3:8.3f} ms   {t / floor:5.2f}x floor")
    ratio = h["ours: HashScheme(sha256_cbor).block_digests"] / floor
    print(f"  -> sha256_cbor chain / floor = {ratio:.2f}x (target <= 2x)\n")

    d = bench_decode(reps, num * 10)
    print("Decoding 128-block batches (one core):")
    for shape, r in d.items():
        print(
            f"  {shape:<28} {r['payload_bytes']:6d} B  {r['decode_us']:7.1f} us/batch  "
            f"{r['blocks_per_s'] / 1e6:5.2f} M blocks/s  (msgpack.unpackb alone {r['msgpack_unpackb_us']:.1f} us)"
        )
    print()

    p = bench_pubsub(2_000 if args.quick else 20_000)
    print(
        f"Publisher -> subscriber, loopback TCP, one process: {p['batches']} batches of 4 blocks in "
        f"{p['seconds']:.2f} s = {p['batches_per_s']:,.0f} batches/s (gaps {p['gaps']})"
    )
    if args.json:
        print(json.dumps({"hash_s": h, "hash_ratio": ratio, "decode": d, "pubsub": p}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
