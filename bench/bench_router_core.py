"""Router core benchmarks: index memory, match time, decision time, chat tokenization.

Run: ``.venv/bin/python -m bench.bench_router_core`` (``--quick`` for a smoke run).
Each figure is printed next to its target and, where it makes sense, next to a floor
measured in the same run (bare dict probes, bare sha256 calls, whole-conversation encode).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import time
import tracemalloc
from collections.abc import Callable

from events.hashing import HashScheme, _cbor_head, _cbor_tokens
from router.index import MemoryIndex
from router.instance import InstanceKey
from router.pending import PendingEntries
from router.policy import Candidate, Policy


def timeit(fn: Callable[[], object], repeat: int, inner: int = 1) -> float:
    """Best (minimum) seconds per call over ``repeat`` samples of ``inner`` calls.

    The minimum, not the median: on a shared machine the median measures the neighbours.
    """
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t) / inner)
    return min(samples)


def bench_memory(entries: int, share: int) -> float:
    """Bytes per (instance, block) with ``entries`` entries, each hash held by ``share``
    instances of 16 (1: all distinct; 4: a prefix shared by four engines)."""
    insts = [InstanceKey(f"http://10.0.0.{i}:8000") for i in range(16)]
    rng = random.Random(1)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = MemoryIndex()
    n_hashes = entries // share
    chunk = 4096
    for start in range(0, n_hashes, chunk):
        hs = [rng.getrandbits(64) for _ in range(min(chunk, n_hashes - start))]
        for k in range(share):
            idx.store(insts[(start // chunk * share + k) % 16], hs)
        del hs
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert idx.stats()["entries"] == n_hashes * share
    return used / (n_hashes * share)


def bench_match(repeat: int) -> dict[str, float]:
    rng = random.Random(2)
    insts = [InstanceKey(f"http://10.0.1.{i}:8000") for i in range(64)]
    prompt = [rng.getrandbits(64) for _ in range(512)]
    out = {}
    full = MemoryIndex()
    for i in insts:
        full.store(i, prompt)
        full.store(i, [rng.getrandbits(64) for _ in range(2000)])  # unrelated blocks too
    assert all(m.blocks == 512 for m in full.match(prompt).values())
    out["all 64 hold all 512"] = timeit(lambda: full.match(prompt), repeat, 20)
    stag = MemoryIndex()
    for j, i in enumerate(insts):
        stag.store(i, prompt[: 8 * (j + 1)])  # runs of 8, 16, ... 512: a change every 8
    out["64 runs ending every 8 blocks"] = timeit(lambda: stag.match(prompt), repeat, 20)
    miss = [rng.getrandbits(64) for _ in range(512)]
    out["miss at block 0"] = timeit(lambda: full.match(miss), repeat, 200)
    d = {h: 1 for h in prompt}
    get = d.get
    out["floor: 512 bare dict.get"] = timeit(lambda: [get(h) for h in prompt], repeat, 20)
    return out


def bench_decision(tokens: int, repeat: int) -> dict[str, float]:
    """hash + match (index and pending) + choose over 16 instances for one prompt."""
    rng = random.Random(3)
    scheme = HashScheme()
    prompt = [rng.randrange(50000) for _ in range(tokens)]
    hashes = scheme.block_hashes(prompt)
    insts = [InstanceKey(f"http://10.0.2.{i}:8000") for i in range(16)]
    idx = MemoryIndex()
    pending = PendingEntries(2.0)
    for j, i in enumerate(insts):
        idx.store(i, hashes[: len(hashes) * j // 16])
        idx.store(i, [rng.getrandbits(64) for _ in range(5000)])
    pending.add(insts[3], hashes, now=0.0)
    policy = Policy(seed=1)

    def match_and_choose():
        m = idx.match(hashes)
        p = pending.match(hashes, now=1.0)
        cands = [
            Candidate(
                i,
                m[i].blocks if i in m else 0,
                p.get(i, 0),
                m[i].best_tier_blocks if i in m else 0,
                in_flight=k % 3,
                queued_tokens=100 * (k % 5),
            )
            for k, i in enumerate(insts)
        ]
        return policy.choose(tokens, 16, cands)

    out = {}
    out["hash"] = timeit(lambda: scheme.block_hashes(prompt), repeat, 5)
    out["match + pending + choose"] = timeit(match_and_choose, repeat, 5)
    out["total"] = out["hash"] + out["match + pending + choose"]
    # Floor: the sha256 calls alone over pre-encoded block inputs (no Python around them).
    nh = scheme.none_hash
    bodies = [_cbor_tokens(prompt[i * 16 : (i + 1) * 16]) + b"\xf6" for i in range(len(hashes))]
    head = b"\x83" + _cbor_head(2, 32)

    def floor():
        d = nh
        for b in bodies:
            d = hashlib.sha256(head + d + b).digest()

    out["floor: bare sha256 chain"] = timeit(floor, repeat, 5)
    return out


def bench_tokenize(repeat: int) -> dict[str, float]:
    from events.tokenizer import encode_chat, load_tokenizer
    from router.prompt import PromptTokenizer

    tok = load_tokenizer()
    rng = random.Random(4)
    words = [
        "the",
        "a",
        "prefix",
        "cache",
        "engine",
        "router",
        "block",
        "token",
        "hash",
        "chat",
        "turn",
        "model",
        "fleet",
    ]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    msgs = [{"role": "system", "content": text(300)}]
    for _ in range(19):
        msgs += [{"role": "user", "content": text(60)}, {"role": "assistant", "content": text(120)}]
    msgs.append({"role": "user", "content": text(60)})
    pt = PromptTokenizer(tok)
    pt.chat_tokens({"messages": msgs[:-1]})  # the previous turns were seen before
    assert pt.chat_tokens({"messages": msgs}) == encode_chat(tok, msgs)
    n_tokens = len(encode_chat(tok, msgs))

    def last_turn_cached():
        # A fresh last message each time, as in a live chat; earlier segments stay cached.
        m = [*msgs[:-1], {"role": "user", "content": text(60)}]
        pt.chat_tokens({"messages": m})

    def whole():
        m = [*msgs[:-1], {"role": "user", "content": text(60)}]
        encode_chat(tok, m)

    return {
        "tokens in conversation": n_tokens,
        "segment cache (router)": timeit(last_turn_cached, repeat, 5),
        "whole conversation encode": timeit(whole, repeat, 5),
        "render template only": timeit(lambda: pt.render_chat({"messages": msgs}), repeat, 5),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer entries and repeats")
    args = ap.parse_args(argv)
    repeat = 5 if args.quick else 15
    entries = 200_000 if args.quick else 1_000_000

    print(f"== index memory, {entries:,} (instance, block) entries, 16 instances (target <= 150 B)")
    for share in (1, 4):
        b = bench_memory(entries, share)
        print(f"  each hash on {share} instance(s): {b:6.1f} B per entry")

    print("== match of 512 hashes over 64 instances (target <= 100 us)")
    for k, v in bench_match(repeat).items():
        print(f"  {k:32s} {v * 1e6:8.1f} us")

    for tokens in (2048, 8192):
        print(f"== decision for a {tokens}-token prompt over 16 instances (target <= 1 ms at 8k)")
        r = bench_decision(tokens, repeat)
        for k, v in r.items():
            print(f"  {k:32s} {v * 1e3:8.3f} ms")
        print(f"  hash / floor ratio: {r['hash'] / r['floor: bare sha256 chain']:.2f}x")

    print("== tokenization of a 20-turn chat's last turn")
    r = bench_tokenize(repeat)
    print(f"  {'tokens in conversation':32s} {r.pop('tokens in conversation'):8d}")
    for k, v in r.items():
        print(f"  {k:32s} {v * 1e3:8.3f} ms")
    print(
        f"  speed-up of the segment cache: "
        f"{r['whole conversation encode'] / r['segment cache (router)']:.1f}x"
    )


if __name__ == "__main__":
    main()
