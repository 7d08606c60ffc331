"""Soak: a router in front of restarting engines, at a fixed request rate, for a bounded time.

Everything runs as separate processes, as in production: ``engine-shim`` engines and one
``prefix-router``. Every ``--restart-every`` seconds one engine (in turn) is stopped and
started again on the same ports (SIGTERM by default: the engine drains; ``--kill`` sends
SIGKILL, after which streams that had started on it cannot complete). The load is a mix of
shared-prefix chats, streaming and not. Every ``--sample-every`` seconds it prints the
router's RSS and open file descriptors and the request counts; at the end a summary
(``--json`` writes it to a file). Targets: zero lost requests, flat RSS after warm-up.

    .venv/bin/python -m bench.soak --minutes 10
    .venv/bin/python -m bench.soak --minutes 2 --engines 2 --rate 10 --restart-every 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from events.endpoints import free_tcp_port as free_port

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Engine:
    http: int
    events: int
    replay: int
    time_scale: float
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def flag(self) -> str:
        return (
            f"{self.url},events=tcp://127.0.0.1:{self.events},replay=tcp://127.0.0.1:{self.replay}"
        )

    async def start(self) -> None:
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine_shim.cli", "--host", "127.0.0.1",
            "--port", str(self.http), "--kv-events-config", json.dumps(kv),
            "--num-gpu-blocks", "1024", "--max-model-len", "4096",
            "--time-scale", str(self.time_scale), "--served-model-name", MODEL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await _ready(self.proc, "engine-shim")

    async def stop(self, kill: bool) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 90)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _ready(proc: asyncio.subprocess.Process, what: str, timeout: float = 60) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
        if not line:
            raise RuntimeError(f"{what} exited before it was ready")
        if b"ready" in line:
            asyncio.get_running_loop().create_task(_drain(proc.stdout))
            return


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def proc_stats(pid: int) -> tuple[float, int]:
    """(RSS in MiB, open file descriptors) of a process, from /proc."""
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    hit_tokens: int = 0
    prompt_tokens: int = 0

    def fail(self, why: str) -> None:
        self.failed += 1
        self.reasons[why] = self.reasons.get(why, 0) + 1


def make_body(rng: random.Random, prefixes: list[str], stream: bool) -> dict:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": rng.choice(prefixes)},
            {"role": "user", "content": f"question {rng.randrange(10**9)}"},
        ],
        "max_tokens": rng.randint(4, 24),
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(s: aiohttp.ClientSession, url: str, body: dict, c: Counts) -> None:
    t0 = time.monotonic()
    c.sent += 1
    try:
        async with asyncio.timeout(120):
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                data = await r.read()
        if r.status != 200:
            c.fail(f"http_{r.status}")
            return
        if body.get("stream"):
            if b'"error"' in data or not data.rstrip().endswith(b"data: [DONE]"):
                c.fail("stream_error")
                return
            usage = None
            for ev in data.split(b"\n\n"):
                if ev.startswith(b"data: {") and b'"usage"' in ev:
                    usage = json.loads(ev[6:]).get("usage")
        else:
            usage = json.loads(data).get("usage")
        if usage:
            c.prompt_tokens += usage.get("prompt_tokens") or 0
            c.hit_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        c.ok += 1
        c.latencies.append(time.monotonic() - t0)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        c.fail(type(e).__name__)


async def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    prefixes = [
        f"Tenant {i}. " + " ".join(rng.choice(words) for _ in range(args.prefix_words))
        for i in range(args.prefixes)
    ]
    engines = [
        Engine(free_port(), free_port(), free_port(), args.time_scale) for _ in range(args.engines)
    ]
    await asyncio.gather(*(e.start() for e in engines))
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    for e in engines:
        cmd += ["--engine", e.flag()]
    cmd += ["--health-interval-s", "0.5", "--log-level", "warning"]
    router = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    samples: list[dict] = []
    counts = Counts()
    try:
        await _ready(router, "prefix-router")
        url = f"http://127.0.0.1:{port}"
        t_start = time.monotonic()
        t_end = t_start + args.minutes * 60
        next_restart = t_start + args.restart_every
        next_sample = t_start
        victim = 0
        restarts: list[dict] = []
        tasks: set[asyncio.Task] = set()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as s:
            interval = 1.0 / args.rate
            t_next = t_start
            restart_task: asyncio.Task | None = None
            while time.monotonic() < t_end:
                now = time.monotonic()
                if now >= next_sample:
                    rss, fds = proc_stats(router.pid)
                    samples.append(
                        {
                            "t_s": round(now - t_start, 1),
                            "rss_mib": round(rss, 1),
                            "fds": fds,
                            "sent": counts.sent,
                            "ok": counts.ok,
                            "failed": counts.failed,
                            "in_flight": len(tasks),
                        }
                    )
                    print(json.dumps(samples[-1]), flush=True)
                    next_sample += args.sample_every
                if now >= next_restart and (restart_task is None or restart_task.done()):
                    e = engines[victim % len(engines)]
                    victim += 1

                    async def restart(e: Engine = e) -> None:
                        t0 = time.monotonic()
                        await e.stop(args.kill)
                        await e.start()
                        e.restarts += 1
                        restarts.append(
                            {"engine": e.url, "at_s": round(t0 - t_start, 1),
                             "down_s": round(time.monotonic() - t0, 2)}
                        )  # fmt: skip

                    restart_task = asyncio.create_task(restart())
                    next_restart += args.restart_every
                if now >= t_next:
                    body = make_body(rng, prefixes, rng.random() < args.stream_share)
                    t = asyncio.create_task(one_request(s, url, body, counts))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                    t_next += interval
                await asyncio.sleep(max(0.0, min(t_next, next_sample) - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=150)
            if restart_task is not None:
                await restart_task
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        rss, fds = proc_stats(router.pid)
        samples.append(
            {"t_s": round(time.monotonic() - t_start, 1), "rss_mib": round(rss, 1), "fds": fds,
             "sent": counts.sent, "ok": counts.ok, "failed": counts.failed, "in_flight": 0}
        )  # fmt: skip
    finally:
        if router.returncode is None:
            router.terminate()
            await router.wait()
        await asyncio.gather(*(e.stop(False) for e in engines))
    warm = [x for x in samples if x["t_s"] >= args.warmup_s] or samples
    lat = sorted(counts.latencies)

    def pct(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1) if lat else 0.0

    def metric_sum(name: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    return {
        "minutes": args.minutes,
        "engines": args.engines,
        "rate_rps": args.rate,
        "restart_every_s": args.restart_every,
        "restart_signal": "SIGKILL" if args.kill else "SIGTERM",
        "restarts": restarts,
        "sent": counts.sent,
        "ok": counts.ok,
        "failed": counts.failed,
        "failure_reasons": counts.reasons,
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
        "hit_rate": round(counts.hit_tokens / counts.prompt_tokens, 3)
        if counts.prompt_tokens
        else 0.0,
        "router_rss_mib": {
            "after_warmup": warm[0]["rss_mib"],
            "end": samples[-1]["rss_mib"],
            "max": max(x["rss_mib"] for x in warm),
        },
        "router_fds": {
            "after_warmup": warm[0]["fds"],
            "end": samples[-1]["fds"],
            "max": max(x["fds"] for x in warm),
        },
        "router_retries": metric_sum("router_retries_total"),
        "router_kv_restarts": metric_sum("router_kv_publisher_restarts_total"),
        "router_kv_gaps": metric_sum("router_kv_gaps_total"),
        "router_kv_replayed": metric_sum("router_kv_replayed_batches_total"),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--restart-every", type=float, default=60.0, help="seconds")
    ap.add_argument("--kill", action="store_true", help="SIGKILL engines instead of SIGTERM")
    ap.add_argument("--stream-share", type=float, default=0.5)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    out = asyncio.run(soak(args))
    summary = {k: v for k, v in out.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
