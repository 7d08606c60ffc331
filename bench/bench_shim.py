"""What one engine shim costs by itself, so router benchmarks on small machines can subtract it.

Starts ``engine-shim --time-scale 0`` (no simulated GPU time: everything measured is the
shim's own CPU: HTTP, JSON, tokenizer, scheduler, hashing) and, as the floor, a bare aiohttp
server that answers the same POST with a canned completion. Both run as subprocesses; an
aiohttp client sends short completion requests at concurrency 1 and 20.

Printed per scenario: requests/s, mean / p50 / p99 latency, and the shim's added latency
per request over the floor (mean minus floor mean) with the throughput ratio.

    .venv/bin/python -m bench.bench_shim [--requests 400] [--max-tokens 4] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from events.endpoints import free_tcp_port as free_port

CANNED = {
    "id": "cmpl-floor",
    "object": "text_completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "text": " a b c d", "finish_reason": "length", "logprobs": None}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
}


def floor_server(port: int) -> None:
    from aiohttp import web

    body = json.dumps(CANNED).encode()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_get("/health", lambda r: web.Response())
    print("floor ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start(cmd: list[str], ready: str) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{cmd[0]} exited: {p.wait()}")
        if line.startswith(ready):
            return p
    p.kill()
    raise RuntimeError(f"{cmd} not ready")


async def run_load(url: str, n: int, conc: int, max_tokens: int, stream: bool) -> dict:
    lat: list[float] = []
    counter = iter(range(n))

    async def worker(s: aiohttp.ClientSession) -> None:
        for i in counter:
            body = {"prompt": f"Request number {i}: say hello.", "max_tokens": max_tokens}
            if stream:
                body["stream"] = True
            t0 = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.perf_counter() - t0)

    conn = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(connector=conn) as s:
        for _ in range(min(20, n)):  # warm-up: connections, tokenizer caches
            async with s.post(
                url + "/v1/completions", json={"prompt": "warm", "max_tokens": 1}
            ) as r:
                await r.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(s) for _ in range(conc)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {
        "rps": n / wall,
        "mean_ms": statistics.fmean(lat) * 1e3,
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_shim")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--floor-server", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.floor_server is not None:
        floor_server(args.floor_server)
        return 0

    shim_port, floor_port = free_port(), free_port()
    shim_bin = str(Path(sys.executable).with_name("engine-shim"))
    shim = start(
        [shim_bin, "--port", str(shim_port), "--time-scale", "0", "--num-gpu-blocks", "4096"],
        "engine-shim ready",
    )
    floor = start(
        [sys.executable, "-m", "bench.bench_shim", "--floor-server", str(floor_port)], "floor ready"
    )
    try:
        print(f"engine-shim --time-scale 0, {args.requests} requests/scenario, max_tokens={args.max_tokens}"
              f"{', stream' if args.stream else ''}, cpus={os.cpu_count()}")  # fmt: skip
        print(f"{'scenario':<14}{'req/s':>9}{'mean ms':>9}{'p50 ms':>9}{'p99 ms':>9}"
              f"{'floor req/s':>13}{'floor ms':>10}{'added ms':>10}{'rps ratio':>11}")  # fmt: skip
        for conc in (1, 20):
            f = asyncio.run(
                run_load(
                    f"http://127.0.0.1:{floor_port}", args.requests, conc, args.max_tokens, False
                )
            )
            r = asyncio.run(
                run_load(
                    f"http://127.0.0.1:{shim_port}",
                    args.requests,
                    conc,
                    args.max_tokens,
                    args.stream,
                )
            )
            print(f"{'concurrency ' + str(conc):<14}{r['rps']:>9.0f}{r['mean_ms']:>9.2f}{r['p50_ms']:>9.2f}"
                  f"{r['p99_ms']:>9.2f}{f['rps']:>13.0f}{f['mean_ms']:>10.2f}"
                  f"{r['mean_ms'] - f['mean_ms']:>10.2f}{r['rps'] / f['rps']:>11.2f}")  # fmt: skip
    finally:
        for p in (shim, floor):
            p.terminate()
            p.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
