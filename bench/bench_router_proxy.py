"""What the router costs: added latency and requests/s against going straight to an engine,
and the decision time by stage.

    .venv/bin/python -m bench.bench_router_proxy [--requests 4000] [--quick]

1. Proxy: one engine shim at --time-scale 0 (no simulated GPU time: pure HTTP work) in its
   own process, the router in its own process, this process as the load generator. Short
   chat prompts, non-streaming, max_tokens 1; 20 concurrent (requests/s) and 1 concurrent
   (p50 latency), each straight to the engine and through the router, side by side.
2. Decision time by stage (tokenize, hash, match, choose) of ``Router.decide`` for 2k- and
   8k-token chat prompts over 16 instances whose index holds the prompt's blocks.
3. Tokenization of the last turn of a 20-turn chat: the router's segment cache against
   tokenizing the whole rendered conversation.

On a shared 2-core machine the load generator, the router and the engine compete for the
same cores, so requests/s are a floor for the router, not its ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import aiohttp

from router.demo import MODEL, Processes, free_port, wait_ready


def chat(n: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say hi #{n % 50}"}],
        "max_tokens": 1,
        "temperature": 0,
    }


async def load(url: str, total: int, concurrency: int) -> tuple[float, list[float]]:
    """(requests/s, latencies) of ``total`` requests with ``concurrency`` in flight."""
    lat: list[float] = []
    it = iter(range(total))
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            for n in it:
                t0 = time.perf_counter()
                async with s.post(url + "/v1/chat/completions", json=chat(n)) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: status {r.status}")
                lat.append(time.perf_counter() - t0)

        # warm-up: connections, tokenizer segment caches
        for n in range(50):
            async with s.post(url + "/v1/chat/completions", json=chat(n)) as r:
                await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - t0), lat


async def proxy_bench(args: argparse.Namespace, procs: Processes) -> dict:
    py = sys.executable
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    http, ev, rep = free_port(), free_port(), free_port()
    kv = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{ev}",
        "replay_endpoint": f"tcp://*:{rep}",
    }
    shim = procs.start(
        [py, "-m", "engine_shim.cli", "--host", "127.0.0.1", "--port", str(http),
         "--kv-events-config", json.dumps(kv), "--time-scale", "0", "--served-model-name", MODEL,
         "--num-gpu-blocks", "4096", "--max-num-seqs", "256"],
        env,
    )  # fmt: skip
    rport = free_port()
    router = procs.start(
        [py, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(rport),
         "--log-level", "warning",
         "--engine", f"http://127.0.0.1:{http},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rep}"],
        env,
    )  # fmt: skip
    engine_url, router_url = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{rport}"
    await wait_ready(engine_url, "/health", 60, shim)
    await wait_ready(router_url, "/ready", 60, router)
    out: dict = {}
    for name, url in (("engine", engine_url), ("router", router_url)):
        c0 = process_cpu_s(router.pid)
        rps, _ = await load(url, args.requests, 20)
        c1 = process_cpu_s(router.pid)
        _, lat = await load(url, args.requests // 4, 1)
        c2 = process_cpu_s(router.pid)
        out[name] = {"rps_20": rps, "p50_1_ms": statistics.median(lat) * 1000}
        if name == "router" and None not in (c0, c1, c2):
            # 50 warm-up requests precede each timed run (see ``load``)
            out[name]["cpu_us_20"] = (c1 - c0) / (args.requests + 50) * 1e6
            out[name]["cpu_us_1"] = (c2 - c1) / (args.requests // 4 + 50) * 1e6
    return out


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), or None where unavailable.

    The router's requests/s on a shared machine depends on what the load generator and the
    engine leave it; its CPU time per request does not, so that is the figure to compare.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


async def decision_bench(args: argparse.Namespace) -> dict:
    from events.tokenizer import load_tokenizer
    from router.config import RouterConfig
    from router.instance import EngineSpec
    from router.server import Router

    tok = load_tokenizer()
    engines = [EngineSpec(f"http://10.0.0.{i}:8000", replay="none") for i in range(16)]
    router = Router(RouterConfig(engines=engines), hf_tokenizer=tok)
    for e in engines:
        router.fleet.add_engine(e)  # not started: no sockets, no health checks
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wizards",
        "quietly",
        "hex",
    ]
    out: dict = {}
    for target in (2048, 8192):
        text = " ".join(words[i % len(words)] + str(i % 97) for i in range(target // 2))
        ids = tok.encode(text, add_special_tokens=False)
        text = tok.decode(ids[: target - 20])
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "q"}],
        }
        d = await router.decide(body, "chat")
        hashes = next(iter(d.hashes.values()))
        keys = [st.key for st in router.fleet.instances()]
        for i, k in enumerate(keys[:6]):  # six instances hold part of the prompt
            router.index.store(k, hashes[: len(hashes) * (i + 1) // 6])
        stages: dict[str, list[float]] = {}
        for _ in range(args.decisions):
            d = await router.decide(body, "chat")
            for st, v in d.timings.items():
                stages.setdefault(st, []).append(v * 1e6)
        out[target] = {
            "prompt_tokens": d.prompt_tokens,
            "predicted_hit": d.predicted_hit_tokens,
            **{st: statistics.median(v) for st, v in stages.items()},
        }
        out[target]["hash+match+choose"] = (
            out[target]["hash"] + out[target]["match"] + out[target]["choose"]
        )
    return out


def tokenize_bench() -> dict:
    from events.tokenizer import encode_chat, load_tokenizer
    from router.prompt import PromptTokenizer

    tok = load_tokenizer()
    pt = PromptTokenizer(tok)
    msgs = [{"role": "system", "content": "You are helpful. " * 40}]
    for t in range(20):
        msgs.append(
            {"role": "user", "content": f"Turn {t}: " + "please explain caching in detail " * 12}
        )
        msgs.append(
            {"role": "assistant", "content": f"Answer {t}: " + "caching keeps computed state " * 12}
        )
    msgs.append({"role": "user", "content": "And the last question?"})
    body = {"messages": msgs}
    pt.chat_tokens({"messages": msgs[:-2]})  # earlier turns seen: their segments are cached
    assert pt.chat_tokens(body) == encode_chat(tok, msgs)
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        ids = pt.chat_tokens(body)
    seg = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        encode_chat(tok, msgs)
    whole = (time.perf_counter() - t0) / n
    return {"tokens": len(ids), "segment_cache_ms": seg * 1000, "whole_ms": whole * 1000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_router_proxy", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.decisions = 400, 30
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    print(f"== proxy overhead ({args.requests} short chat requests, engine shim at time scale 0)")
    procs = Processes()
    try:
        px = asyncio.run(proxy_bench(args, procs))
    finally:
        procs.stop()
    e, r = px["engine"], px["router"]
    print(f"{'':<22}{'direct to engine':>18}{'through router':>16}{'ratio':>8}")
    print(
        f"{'req/s, 20 concurrent':<22}{e['rps_20']:>18.0f}{r['rps_20']:>16.0f}{r['rps_20'] / e['rps_20']:>8.2f}"
    )
    print(
        f"{'p50 ms, 1 concurrent':<22}{e['p50_1_ms']:>18.2f}{r['p50_1_ms']:>16.2f}{r['p50_1_ms'] / e['p50_1_ms']:>8.2f}"
    )
    print(f"added p50 latency: {r['p50_1_ms'] - e['p50_1_ms']:.2f} ms")
    if "cpu_us_20" in r:
        print(
            f"router CPU per request: {r['cpu_us_20']:.0f} us at 20 concurrent, "
            f"{r['cpu_us_1']:.0f} us at 1 concurrent"
        )

    print("\n== decision time by stage, median us (16 instances, chat prompt)")
    dec = asyncio.run(decision_bench(args))
    cols = ("tokenize", "hash", "match", "choose", "hash+match+choose", "total")
    print(f"{'prompt tokens':<15}" + "".join(f"{c:>19}" for c in cols))
    for _target, row in dec.items():
        print(f"{row['prompt_tokens']:<15}" + "".join(f"{row[c]:>19.1f}" for c in cols))

    print("\n== tokenizing the last turn of a 20-turn chat")
    tb = tokenize_bench()
    print(
        f"{tb['tokens']} tokens: segment cache {tb['segment_cache_ms']:.2f} ms, whole conversation "
        f"{tb['whole_ms']:.2f} ms ({tb['whole_ms'] / tb['segment_cache_ms']:.1f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
