"""Scale on paper: the router's index and policy driven directly, up to 1,000 engines.

    python -m bench.simulate [--engines 10,100,1000] [--blocks-per-engine 2048] [--quick]
                             [--report docs/benchmarks.md]

No HTTP, no sockets: each simulated engine is an LRU pool of a fixed number of 16-token
blocks; serving a request touches its cached prefix, stores its missing blocks and evicts the
least recently used ones, and those stores and removals go straight into a
``router.index.MemoryIndex`` (zero event lag). Each decision is the router's own code path
after hashing: ``MemoryIndex.match`` over the prompt's block hashes, one ``Candidate`` per
engine, ``Policy.choose``. Load comes from a simple queue model per engine (prefill at 60 us
per uncached token plus 6 ms a step, as the shim's cost model at time scale 1).

Before measuring, every pool is filled to capacity with filler blocks, so the index holds
engines x blocks-per-engine entries (2 M at 1,000 x 2,048) from the first decision on. The
workload is chat-like and grows with the fleet (sessions and shared system prompts
proportional to the engine count) so per-engine pressure stays the same; a round-robin fleet
with the same pools serves the same requests for comparison.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.index import MemoryIndex
from router.instance import InstanceKey
from router.policy import Candidate, Policy

BLOCK = 16
_MASK = (1 << 64) - 1


def chain(parent: int, content: int) -> int:
    """A stand-in for the engine's chained block hash (deterministic, 64-bit)."""
    return hash((parent, content)) & _MASK


class LruPool:
    """One engine's prefix cache: a fixed number of blocks, least recently used evicted."""

    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def run(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def serve(self, hashes: Sequence[int]) -> tuple[int, list[int], list[int]]:
        """(cached run, hashes stored, hashes evicted) for one prompt."""
        hit = self.run(hashes)
        blocks = self.blocks
        for h in hashes[:hit]:
            blocks.move_to_end(h)
        stored = []
        for h in hashes[hit:]:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(h)
        removed = []
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            removed.append(h)
        return hit, stored, removed


@dataclass
class SimRequest:
    t: float
    hashes: list[int]
    tokens: int


def make_requests(engines: int, n: int, seed: int) -> list[SimRequest]:
    """Chat-like traffic: shared system prompts, sessions whose history grows per turn."""
    rng = random.Random(seed)
    groups = max(4, engines // 4)
    sys_blocks = 24  # ~400-token system prompts
    sys_prefix = []
    for g in range(groups):
        h, hs = 0, []
        for b in range(sys_blocks):
            h = chain(h, (1 << 40) + g * 1000 + b)
            hs.append(h)
        sys_prefix.append(hs)
    active = 6 * engines
    sessions: list[list[int]] = []
    next_content = 1 << 50
    rate = 4.0 * engines  # requests/s: ~4 per engine per second
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        if len(sessions) < active or rng.random() < 0.15:
            hs = list(sys_prefix[rng.randrange(groups)])
            if len(sessions) >= active:
                sessions.pop(rng.randrange(len(sessions)))
            sessions.append(hs)
            i = len(sessions) - 1
        else:
            i = rng.randrange(len(sessions))
            hs = sessions[i]
        h = hs[-1]
        for _ in range(rng.randint(6, 14)):  # one turn: question + answer, ~100-220 tokens
            h = chain(h, next_content)
            next_content += 1
            hs.append(h)
        if len(hs) > 200:  # the chat ends (context limit); a new one takes its place later
            sessions.pop(i)
        out.append(SimRequest(t, list(hs), len(hs) * BLOCK - rng.randint(0, BLOCK - 1)))
    return out


@dataclass
class EngineLoad:
    busy_until: float = 0.0
    in_flight: int = 0
    queued: int = 0


class LoadModel:
    """A FIFO prefill queue per engine; in-flight = requests not yet finished decoding."""

    def __init__(self, engines: int, decode_s: float = 0.1) -> None:
        self.eng = [EngineLoad() for _ in range(engines)]
        self._events: list[tuple[float, int, int, int]] = []  # (time, engine, kind, tokens)
        self.decode_s = decode_s

    def advance(self, now: float) -> None:
        ev = self._events
        while ev and ev[0][0] <= now:
            _, e, kind, tok = heapq.heappop(ev)
            if kind == 0:
                self.eng[e].queued -= tok
            else:
                self.eng[e].in_flight -= 1

    def add(self, now: float, e: int, uncached: int) -> float:
        """Queue a request; returns its TTFT."""
        st = self.eng[e]
        start = max(now, st.busy_until)
        done = start + 0.006 + uncached * 60e-6
        st.busy_until = done
        st.in_flight += 1
        st.queued += uncached
        heapq.heappush(self._events, (done, e, 0, uncached))
        heapq.heappush(self._events, (done + self.decode_s, e, 1, 0))
        return done - now


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))] if s else float("nan")


def simulate(
    engines: int, blocks_per_engine: int, requests: int, seed: int = 0, per_engine: int = 12
) -> dict[str, Any]:
    """One fleet size: decision time, index size and hit rate (prefix vs round robin).

    At least ``per_engine`` requests per engine are sent (sessions grow with the fleet, so a
    fixed count would leave a large fleet's caches cold); hit rates and simulated TTFT are
    taken over the second half, decision times over all of them.
    """
    keys = [InstanceKey(f"http://sim-{i}:8000") for i in range(engines)]
    index = MemoryIndex()
    pools = [LruPool(blocks_per_engine) for _ in range(engines)]
    rr_pools = [LruPool(blocks_per_engine) for _ in range(engines)]
    t_fill = time.perf_counter()
    filler = 1 << 60
    for i, pool in enumerate(pools):
        hs = list(range(filler + i * blocks_per_engine, filler + (i + 1) * blocks_per_engine))
        pool.serve(hs)
        rr_pools[i].serve(hs)
        index.store(keys[i], hs)
    fill_s = time.perf_counter() - t_fill
    gc.collect()
    # The simulator's own millions of long-lived objects (LRU pools) would make every full GC
    # pass slow and land in the decision times; freeze them, as a long-running router could.
    gc.freeze()
    stats = index.stats()
    policy = Policy(seed=seed)
    load = LoadModel(engines)
    rr_load = LoadModel(engines)
    requests = max(requests, per_engine * engines)
    reqs = make_requests(engines, requests, seed)
    match_s: list[float] = []
    choose_s: list[float] = []
    hit = rr_hit = total = 0
    ttft: list[float] = []
    rr_ttft: list[float] = []
    pred_err = 0
    for k, r in enumerate(reqs):
        cap = (r.tokens - 1) // BLOCK
        load.advance(r.t)
        t0 = time.perf_counter()
        matches = index.match(r.hashes)
        cands = []
        for i, key in enumerate(keys):
            m = matches.get(key)
            st = load.eng[i]
            cands.append(
                Candidate(
                    key,
                    m.blocks if m else 0,
                    in_flight=st.in_flight,
                    queued_tokens=st.queued,
                )
            )
        t1 = time.perf_counter()
        d = policy.choose(r.tokens, BLOCK, cands)
        t2 = time.perf_counter()
        match_s.append(t1 - t0)
        choose_s.append(t2 - t1)
        e = int(d.chosen.engine.rsplit("-", 1)[1].split(":")[0])
        run, stored, removed = pools[e].serve(r.hashes)
        got = min(run, cap) * BLOCK
        pred_err += abs(got - d.predicted_hit_tokens)
        if removed:
            index.remove(keys[e], removed)
        if stored:
            index.store(keys[e], stored)
        warm = k >= len(reqs) // 2  # hit rates and TTFT over the second half: caches warm
        if warm:
            hit += got
            total += r.tokens
        t_first = load.add(r.t, e, r.tokens - got)
        # round robin on its own pools, same requests
        rr_load.advance(r.t)
        re = k % engines
        rrun, _, _ = rr_pools[re].serve(r.hashes)
        rgot = min(rrun, cap) * BLOCK
        rr_first = rr_load.add(r.t, re, r.tokens - rgot)
        if warm:
            rr_hit += rgot
            ttft.append(t_first)
            rr_ttft.append(rr_first)
    after = index.stats()
    gc.unfreeze()
    dec = [a + b for a, b in zip(match_s, choose_s, strict=True)]
    return {
        "engines": engines,
        "blocks_per_engine": blocks_per_engine,
        "requests": requests,
        "index_entries": after["entries"],
        "index_hashes": after["hashes"],
        "index_mb": after["approx_bytes"] / 2**20,
        "index_mb_filled": stats["approx_bytes"] / 2**20,
        "bytes_per_entry": after["approx_bytes"] / max(1, after["entries"]),
        "fill_s": fill_s,
        "match_us_mean": 1e6 * sum(match_s) / len(match_s),
        "choose_us_mean": 1e6 * sum(choose_s) / len(choose_s),
        "decision_us_p50": 1e6 * _pct(dec, 50),
        "decision_us_p99": 1e6 * _pct(dec, 99),
        "hit_rate": hit / total if total else 0.0,
        "rr_hit_rate": rr_hit / total if total else 0.0,
        "ttft_ms_p50": 1e3 * _pct(ttft, 50),
        "rr_ttft_ms_p50": 1e3 * _pct(rr_ttft, 50),
        "ttft_ms_p99": 1e3 * _pct(ttft, 99),
        "rr_ttft_ms_p99": 1e3 * _pct(rr_ttft, 99),
        "pred_error_tokens": pred_err / len(reqs) if reqs else 0.0,
    }


def markdown(rows: list[dict[str, Any]], command: str, img_rel: str | None) -> str:
    head = (
        f"Command: `{command}`.\n\n"
        "| engines | index entries | index MB | B/entry | match us | choose us | decision p50 us | "
        "decision p99 us | hit rate prefix | hit rate round robin | sim. TTFT p50 ms prefix "
        "/ RR | sim. TTFT p99 ms prefix / RR |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['engines']} | {r['index_entries']:,} | {r['index_mb']:.0f} | "
        f"{r['bytes_per_entry']:.0f} | {r['match_us_mean']:.0f} | {r['choose_us_mean']:.0f} | "
        f"{r['decision_us_p50']:.0f} | {r['decision_us_p99']:.0f} | "
        f"{100 * r['hit_rate']:.1f} % | {100 * r['rr_hit_rate']:.1f} % | "
        f"{r['ttft_ms_p50']:.0f} / {r['rr_ttft_ms_p50']:.0f} | "
        f"{r['ttft_ms_p99']:.0f} / {r['rr_ttft_ms_p99']:.0f} |"
        for r in rows
    ]
    text = head + "\n".join(lines) + "\n"
    if img_rel:
        text += (
            f"\n![decision time, index memory and hit rate vs fleet size]({img_rel}/simulate.png)\n"
        )
    return text


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from bench.report import _plt

    plt = _plt()
    xs = [r["engines"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.8), dpi=80)
    ax = axes[0]
    ax.plot(xs, [r["match_us_mean"] for r in rows], "o-", label="match")
    ax.plot(xs, [r["choose_us_mean"] for r in rows], "s-", label="choose")
    ax.plot(xs, [r["decision_us_p99"] for r in rows], "^--", label="decision p99")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("engines")
    ax.set_ylabel("microseconds")
    ax.set_title("decision time", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(xs, [r["index_mb"] for r in rows], "o-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("engines")
    ax.set_ylabel("MB")
    ax.set_title("index memory", fontsize=9)
    ax = axes[2]
    ax.plot(xs, [100 * r["hit_rate"] for r in rows], "o-", label="prefix")
    ax.plot(xs, [100 * r["rr_hit_rate"] for r in rows], "s-", label="round robin")
    ax.set_xscale("log")
    ax.set_ylim(0, 100)
    ax.set_xlabel("engines")
    ax.set_ylabel("% of prompt tokens")
    ax.set_title("hit rate", fontsize=9)
    ax.legend(fontsize=7)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import shlex

    ap = argparse.ArgumentParser(
        prog="python -m bench.simulate", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--engines", default="10,30,100,300,1000", help="comma list of fleet sizes")
    ap.add_argument("--blocks-per-engine", type=int, default=2048)
    ap.add_argument(
        "--requests", type=int, default=3000, help="decisions per size (at least 12/engine)"
    )
    ap.add_argument("--quick", action="store_true", help="sizes 10,100; 500 requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None, help="write the markdown section here")
    ap.add_argument("--img-dir", default=None)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in ("10,100" if a.quick else a.engines).split(",")]
    n = 500 if a.quick else a.requests
    rows = []
    for k in sizes:
        t = time.perf_counter()
        r = simulate(k, a.blocks_per_engine, n, a.seed, per_engine=4 if a.quick else 12)
        rows.append(r)
        print(
            f"{k:>5} engines: {r['index_entries']:>9,} entries {r['index_mb']:7.1f} MB, "
            f"decision p50 {r['decision_us_p50']:7.0f} us (match {r['match_us_mean']:.0f}, "
            f"choose {r['choose_us_mean']:.0f}), hit {100 * r['hit_rate']:.1f} % vs RR "
            f"{100 * r['rr_hit_rate']:.1f} % [{time.perf_counter() - t:.1f} s]",
            file=sys.stderr,
        )
    cmd = "python -m bench.simulate " + " ".join(
        shlex.quote(x) for x in (sys.argv[1:] if argv is None else argv)
    )
    if a.report:
        from bench.report import write_section

        report = Path(a.report)
        img = Path(a.img_dir) if a.img_dir else report.parent / "img"
        plot(rows, img / "simulate.png")
        try:
            rel = str(img.resolve().relative_to(report.parent.resolve()))
        except ValueError:
            rel = str(img)
        write_section(report, "simulate", markdown(rows, cmd, rel), title="Scale on paper")
    print(markdown(rows, cmd, None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
