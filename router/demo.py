"""``make demo``: four engine shims, the router, and the same chat workload twice.

1. Start four engine shims (subprocesses, real-time cost model of a GPU, small KV pools so that
   the caches evict) and the router (a subprocess, as deployed) on free loopback ports.
2. Replay a multi-turn chat workload (a few shared system prompts, many conversations,
   several turns each, conversations running concurrently) through the router.
3. Reset the engines' prefix caches and replay the same workload with plain round robin
   straight to the engines.
4. Print one table: the engines' own reported hit rate (usage.prompt_tokens_details.
   cached_tokens), TTFT p50/p90, requests/s and each engine's share of the requests.

Everything started here is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from events.endpoints import free_tcp_port as free_port

MODEL = "SmolLM2-135M-Instruct"

TOPICS = [
    "You are a support assistant for a cloud storage product. Answer questions about buckets, "
    "lifecycle rules, access policies, replication, versioning and billing.",
    "You are a travel planner. Build itineraries, compare transport options, suggest hotels "
    "and restaurants, and warn about visas, weather and local holidays.",
    "You are a senior Python reviewer. Point out bugs, race conditions, missing tests, unclear "
    "names and performance problems, and propose concrete patches.",
    "You are a cooking coach. Explain techniques, substitutions, timings and food safety for "
    "home cooks, with metric and imperial units.",
]
WORDS = [
    "system",
    "network",
    "request",
    "cache",
    "latency",
    "throughput",
    "memory",
    "token",
    "budget",
    "policy",
    "shard",
    "replica",
    "window",
    "queue",
    "batch",
    "stream",
    "region",
    "quota",
    "schedule",
    "backup",
    "restore",
    "migrate",
    "archive",
    "index",
    "kitchen",
    "sauce",
    "oven",
    "recipe",
    "flight",
    "hotel",
    "museum",
    "train",
    "ticket",
    "passport",
    "review",
    "patch",
    "commit",
]


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(1000 + i)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"{TOPICS[i % len(TOPICS)]}\nReference notes {i}: {body}"


def user_turn(conv: int, turn: int, words: int) -> str:
    rng = random.Random(conv * 100 + turn)
    return f"Question {turn} of conversation {conv}: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


@dataclass
class Result:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    target: str


@dataclass
class Phase:
    name: str
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    errors: int = 0


@dataclass
class Workload:
    conversations: int = 32
    turns: int = 5
    concurrency: int = 12
    system_prompts: int = 4
    system_words: int = 300
    user_words: int = 120
    max_tokens: int = 24


async def run_conversation(
    session: aiohttp.ClientSession, conv: int, wl: Workload, pick, phase: Phase
) -> None:
    messages = [
        {"role": "system", "content": system_prompt(conv % wl.system_prompts, wl.system_words)}
    ]
    for turn in range(wl.turns):
        messages.append({"role": "user", "content": user_turn(conv, turn, wl.user_words)})
        url = pick()
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": wl.max_tokens,
            "temperature": 0,
            "seed": conv,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        ttft = None
        text: list[str] = []
        usage = None
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    phase.errors += 1
                    return
                target = r.headers.get("x-routed-to", url)
                async for line in r.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    obj = json.loads(line[6:])
                    for ch in obj.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") or ""
                        if piece and ttft is None:  # the first generated token, not the role chunk
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                    if obj.get("usage"):
                        usage = obj["usage"]
        except aiohttp.ClientError:
            phase.errors += 1
            return
        details = (usage or {}).get("prompt_tokens_details") or {}
        phase.results.append(
            Result(
                ttft if ttft is not None else time.perf_counter() - t0,
                (usage or {}).get("prompt_tokens", 0),
                details.get("cached_tokens") or 0,
                target,
            )
        )
        messages.append({"role": "assistant", "content": "".join(text)})


async def run_phase(name: str, wl: Workload, pick) -> Phase:
    phase = Phase(name)
    sem = asyncio.Semaphore(wl.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(conv: int) -> None:
            async with sem:
                await run_conversation(session, conv, wl, pick, phase)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(wl.conversations)))
        phase.seconds = time.perf_counter() - t0
    return phase


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def table(phases: list[Phase], engines: list[str]) -> str:
    head = f"{'mode':<14}{'requests':>9}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p90':>11}{'req/s':>8}   share per engine"
    lines = [head, "-" * (len(head) + 12)]
    for ph in phases:
        r = ph.results
        prompt = sum(x.prompt_tokens for x in r)
        hit = sum(x.cached_tokens for x in r) / prompt if prompt else 0.0
        ttfts = [x.ttft * 1000 for x in r]
        share = Counter(x.target for x in r)
        shares = " ".join(f"{100 * share.get(e, 0) / max(1, len(r)):.0f}%" for e in engines)
        lines.append(
            f"{ph.name:<14}{len(r):>9}{hit:>10.1%}{pct(ttfts, 50):>9.0f}ms{pct(ttfts, 90):>9.0f}ms"
            f"{len(r) / ph.seconds if ph.seconds else 0:>8.1f}   {shares}"
            + (f"  ({ph.errors} errors)" if ph.errors else "")
        )
    return "\n".join(lines)


class Processes:
    """Every child process this demo starts, stopped in reverse order on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children ourselves
        )
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


async def wait_ready(url: str, path: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process for {url} exited with {proc.returncode}")
            try:
                async with s.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready after {timeout:.0f}s")


async def main_async(args: argparse.Namespace, procs: Processes) -> int:
    py = sys.executable
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between the two phases
    engines = []
    started = []
    for _ in range(args.engines):
        http, ev, rep = free_port(), free_port(), free_port()
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{ev}",
            "replay_endpoint": f"tcp://*:{rep}",
        }
        cmd = [
            py, "-m", "engine_shim.cli", "--host", "127.0.0.1", "--port", str(http),
            "--kv-events-config", json.dumps(kv), "--num-gpu-blocks", str(args.gpu_blocks),
            "--block-size", "16", "--max-model-len", "4096", "--time-scale", str(args.time_scale),
            "--served-model-name", MODEL, "--seed", "0",
        ]  # fmt: skip
        p = procs.start(cmd, env)
        url = f"http://127.0.0.1:{http}"
        engines.append((url, ev, rep))
        started.append((url, p))
    router_port = free_port()
    cmd = [
        py,
        "-m",
        "router",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--log-level",
        "warning",
    ]
    for url, ev, rep in engines:
        cmd += ["--engine", f"{url},events=tcp://127.0.0.1:{ev},replay=tcp://127.0.0.1:{rep}"]
    router = procs.start(cmd, env)
    router_url = f"http://127.0.0.1:{router_port}"
    print(f"starting {args.engines} engine shims and the router ...", flush=True)
    for url, p in started:
        await wait_ready(url, "/health", 60, p)
    await wait_ready(router_url, "/ready", 60, router)
    engine_urls = [u for u, _, _ in engines]

    wl = Workload(conversations=args.conversations, turns=args.turns, concurrency=args.concurrency)
    n_req = wl.conversations * wl.turns
    print(
        f"workload: {wl.conversations} conversations x {wl.turns} turns ({n_req} requests), "
        f"{wl.system_prompts} shared system prompts, {wl.concurrency} conversations at a time",
        flush=True,
    )
    print("phase 1: through the prefix router ...", flush=True)
    routed = await run_phase("prefix router", wl, lambda: router_url)

    async with aiohttp.ClientSession() as s:
        for url in engine_urls:
            async with s.post(url + "/reset_prefix_cache") as r:
                ok = (await r.json()).get("success")
                if not ok:
                    print(f"warning: {url} did not reset its prefix cache", flush=True)
    print("phase 2: plain round robin, caches reset ...", flush=True)
    rr_counter = iter(range(10**9))
    rr = await run_phase(
        "round robin", wl, lambda: engine_urls[next(rr_counter) % len(engine_urls)]
    )

    print()
    print(table([routed, rr], engine_urls))
    print()
    print("hit rate = cached prompt tokens / prompt tokens, as the engines report them; "
          "TTFT = time to first streamed token seen by the client.")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument(
        "--gpu-blocks", type=int, default=300, help="KV blocks per engine (small: evicts)"
    )
    ap.add_argument(
        "--time-scale",
        type=float,
        default=2.0,
        help="engine cost model time scale (1 = an H100 running Llama-3.1-8B; 2 = half as fast)",
    )
    args = ap.parse_args(argv)
    procs = Processes()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return asyncio.run(main_async(args, procs))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    finally:
        procs.stop()


if __name__ == "__main__":
    sys.exit(main())
