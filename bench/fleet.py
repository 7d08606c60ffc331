"""Fleet benchmark: one workload, several routing policies, the same fresh engines for each.

    python -m bench.fleet --workload chat --engines 4 \\
        --policy prefix,round_robin,least_loaded,prefix_no_pending,oracle [--quick] \\
        [--rate R | --closed-loop C] [--report docs/benchmarks.md]

K engine shims run as subprocesses (real HTTP, real KV events, a GPU cost model in real time
by default, small KV pools so that eviction matters). For each policy the engines' prefix
caches are reset (POST /reset_prefix_cache) so every policy starts cold; ``prefix`` and
``prefix_no_pending`` start a fresh ``prefix-router serve`` subprocess with the router's own
flags; the baselines and the upper bound choose in the client (bench/policies.py) and talk
to the engines directly, which spares them the router's hop. Each request is streamed and
recorded: chosen engine, predicted hit (x-prefix-hit-tokens), the engine's reported cached
tokens (usage.prompt_tokens_details.cached_tokens), TTFT, end-to-end latency, status.

Everything it starts runs in its own session and is stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench import workloads as wl
from bench.policies import (
    CLIENT_POLICIES,
    ROUTER_POLICIES,
    ClientPolicy,
    LoadBook,
    make_client_policy,
)
from events.endpoints import free_tcp_port as free_port

MODEL = "SmolLM2-135M-Instruct"
ALL_POLICIES = ("prefix", "prefix_no_pending", "round_robin", "least_loaded", "oracle")
ALL_WORKLOADS = ("chat", "shared", "agent", "unique", "mooncake")
HASH_ALGO = "sha256_cbor"
BLOCK_SIZE = 16

# Workload sizes. Full mode: a few minutes for all five policies on 2 cores; quick mode: the
# chat workload with five policies in well under two minutes.
FULL_SIZES: dict[str, dict[str, Any]] = {
    "chat": {"sessions": 48, "turns": 6, "rate": 14.0, "think_s": 1.0},
    "shared": {"requests": 240, "rate": 12.0},
    "agent": {"loops": 30, "steps": 6, "rate": 12.0},
    "unique": {"requests": 160, "rate": 8.0},
    "mooncake": {"limit": 160, "rate": 8.0},
}
QUICK_SIZES: dict[str, dict[str, Any]] = {
    "chat": {"sessions": 20, "turns": 5, "rate": 14.0, "think_s": 0.5},
    "shared": {"requests": 80, "rate": 12.0},
    "agent": {"loops": 12, "steps": 5, "rate": 12.0, "step_s": 0.2},
    "unique": {"requests": 60, "rate": 10.0},
    "mooncake": {"limit": 80, "rate": 8.0},
}


# ----------------------------------------------------------------------------------------
# Records


@dataclass
class Record:
    """What the client saw of one request."""

    id: str
    policy: str
    session: str | None
    group: str
    t_sched: float  # planned arrival, s from run start
    t_send: float = 0.0  # s from run start
    t_end: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    status: int = 0
    engine: int = -1
    predicted: int | None = None
    cached: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass
class PolicyRun:
    policy: str
    records: list[Record]
    wall_s: float
    cpu: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------
# CPU accounting: the machine's busy share and our own processes' CPU seconds


def _proc_stat_busy() -> tuple[float, float]:
    """(busy jiffies, total jiffies) over all CPUs, from /proc/stat (0, 0 off Linux)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()[1:]
    except OSError:
        return 0.0, 0.0
    vals = [float(x) for x in parts]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class CpuMeter:
    """Busy share of all CPUs between start() and stop(), plus CPU seconds per named pid."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._stat0 = _proc_stat_busy()
        self._self0 = time.process_time()
        self._p0 = {k: sum(_proc_cpu_s(p) for p in v) for k, v in self.pids.items()}

    def stop(self) -> dict[str, Any]:
        b1, t1 = _proc_stat_busy()
        b0, t0 = self._stat0
        wall = time.monotonic() - self._t0
        out: dict[str, Any] = {
            "machine_busy": (b1 - b0) / (t1 - t0) if t1 > t0 else None,
            "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "wall_s": wall,
            "cpu_s": {"client": time.process_time() - self._self0},
        }
        for k, v in self.pids.items():
            out["cpu_s"][k] = sum(_proc_cpu_s(p) for p in v) - self._p0.get(k, 0.0)
        return out


# ----------------------------------------------------------------------------------------
# Processes


class Processes:
    """Every child this benchmark starts, each in its own session, stopped in reverse order."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen:
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed by stop()
        p = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        p._bench_log = out  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop_one(self, p: subprocess.Popen, timeout: float = 5.0) -> None:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log = getattr(p, "_bench_log", None)
        if log not in (None, subprocess.DEVNULL):
            log.close()
        if p in self.procs:
            self.procs.remove(p)

    def stop(self) -> None:
        for p in reversed(list(self.procs)):
            self.stop_one(p)


@dataclass
class Engine:
    url: str
    events: str
    replay: str
    proc: subprocess.Popen

    def spec(self) -> str:
        return f"{self.url},events={self.events},replay={self.replay}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)  # engines and router both use vLLM's default NONE_HASH
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between policies
    return env


def start_engines(procs: Processes, args: argparse.Namespace, logdir: Path) -> list[Engine]:
    out = []
    for i in range(args.engines):
        http, ev, rep = free_port(), free_port(), free_port()
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{ev}",
            "replay_endpoint": f"tcp://*:{rep}",
        }
        cmd = [
            sys.executable, "-m", "engine_shim.cli", "--host", "127.0.0.1", "--port", str(http),
            "--kv-events-config", json.dumps(kv), "--num-gpu-blocks", str(args.gpu_blocks),
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(args.max_model_len),
            "--prefix-caching-hash-algo", HASH_ALGO, "--time-scale", str(args.time_scale),
            "--served-model-name", MODEL, "--seed", str(i), "--backend", args.backend,
        ]  # fmt: skip
        p = procs.start(cmd, _env(), logdir / f"engine-{i}.log")
        out.append(
            Engine(f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rep}", p)
        )
    return out


def start_router(
    procs: Processes, engines: Sequence[Engine], flags: list[str], logdir: Path, name: str
) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--hash-algo", HASH_ALGO, "--block-size", str(BLOCK_SIZE),
    ]  # fmt: skip
    for e in engines:
        cmd += ["--engine", e.spec()]
    p = procs.start(cmd + flags, _env(), logdir / f"router-{name}.log")
    return f"http://127.0.0.1:{port}", p


async def wait_ready(
    session: aiohttp.ClientSession,
    url: str,
    proc: subprocess.Popen,
    path: str = "/health",
    timeout: float = 60.0,
) -> None:
    """Poll ``url + path`` until it answers 200; fail early if the process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with status {proc.returncode} (see logs)")
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url}{path} not ready after {timeout:.0f} s")


async def engine_caches(session: aiohttp.ClientSession, engines: Sequence[Engine]) -> list[set]:
    """Every engine's cached block hashes right now (all ranks), from GET /debug/kv_cache."""

    async def one(e: Engine) -> set[int]:
        async with session.get(e.url + "/debug/kv_cache") as r:
            data = await r.json()
        out: set[int] = set()
        for rank in data["ranks"].values():
            out.update(rank["hashes"])
        return out

    return list(await asyncio.gather(*(one(e) for e in engines)))


async def router_decision_ms(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Mean decision time per stage (tokenize, hash, match, choose, total) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "router_decision_seconds":
            continue
        for s in fam.samples:
            stage = s.labels.get("stage", "")
            if s.name.endswith("_sum"):
                sums[stage] = s.value
            elif s.name.endswith("_count"):
                counts[stage] = s.value
    return {k: 1000 * v / counts[k] for k, v in sums.items() if counts.get(k)}


async def reset_engines(session: aiohttp.ClientSession, engines: Sequence[Engine]) -> None:
    """Empty every prefix cache and wait until the engines say they are empty."""
    for e in engines:
        async with session.post(e.url + "/reset_prefix_cache") as r:
            ok = (await r.json()).get("success")
            if not ok:
                raise RuntimeError(f"{e.url} refused to reset its prefix cache (requests running)")
    deadline = time.monotonic() + 10
    while any(await engine_caches(session, engines)):
        if time.monotonic() > deadline:
            raise RuntimeError("engine prefix caches not empty 10 s after reset")
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------------------
# Sending


def _is_content(obj: dict) -> bool:
    """A chunk that carries generated output (not the empty role chunk, not the usage)."""
    for ch in obj.get("choices") or ():
        if ch.get("finish_reason") is not None:
            return True
        if ch.get("text"):
            return True
        delta = ch.get("delta") or {}
        if delta.get("content"):
            return True
    return False


async def send_one(
    session: aiohttp.ClientSession,
    base: str,
    req: wl.WorkloadRequest,
    rec: Record,
    t0: float,
    on_first: Callable[[], None],
) -> str | None:
    """Stream one request into ``rec``; returns the router's x-routed-to (None if absent)."""
    path = "/v1/chat/completions" if req.kind == "chat" else "/v1/completions"
    start = time.perf_counter()
    rec.t_send = start - t0
    usage = None
    routed = None
    try:
        async with session.post(base + path, json=req.body(MODEL)) as r:
            rec.status = r.status
            hit = r.headers.get("x-prefix-hit-tokens")
            if hit is not None and hit.lstrip("-").isdigit():
                rec.predicted = int(hit)
            routed = r.headers.get("x-routed-to")
            if r.status != 200:
                rec.error = (await r.text())[:300]
                return routed
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                obj = json.loads(line[6:])
                if rec.ttft is None and _is_content(obj):
                    rec.ttft = time.perf_counter() - start
                    on_first()
                if obj.get("usage"):
                    usage = obj["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        rec.status = rec.status or 599
    finally:
        end = time.perf_counter()
        rec.t_end = end - t0
        rec.e2e = end - start
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached = details.get("cached_tokens") or 0
    elif rec.status == 200:
        rec.error = "no usage in the stream"
    return routed


@dataclass
class Target:
    """Where a policy's requests go: the router, or an engine chosen in the client."""

    name: str
    router_url: str | None
    client: ClientPolicy | None


class Runner:
    """Sends one workload under one policy and collects the records."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        engines: Sequence[Engine],
        requests: Sequence[wl.WorkloadRequest],
        prepared: dict[str, tuple[int, list[int]]],
        progress: bool,
    ) -> None:
        self.session = session
        self.engines = engines
        self.requests = requests
        self.prepared = prepared  # id -> (prompt tokens, block hashes), for client policies
        self.progress = progress
        self._url_index = {e.url: i for i, e in enumerate(engines)}

    async def run(
        self, target: Target, rate: float | None, closed_loop: int | None
    ) -> list[Record]:
        reqs = list(self.requests)
        if rate:
            reqs = wl.scale_to_rate(reqs, rate)
        sessions: dict[str, list[wl.WorkloadRequest]] = defaultdict(list)
        for r in sorted(reqs, key=lambda r: (r.t, r.turn)):
            sessions[r.session or f"~{r.id}"].append(r)
        for turns in sessions.values():
            turns.sort(key=lambda r: r.turn)
        book = LoadBook(len(self.engines))
        records: list[Record] = []
        bar = _progress(len(reqs), target.name, self.progress)
        t0 = time.perf_counter()

        async def do(req: wl.WorkloadRequest) -> None:
            rec = Record(req.id, target.name, req.session, req.group, req.t)
            records.append(rec)
            await self._one(target, req, rec, book, t0)
            if bar is not None:
                bar.update(1)

        async def play_session(turns: list[wl.WorkloadRequest], paced: bool) -> None:
            for req in turns:
                if paced:
                    delay = req.t - (time.perf_counter() - t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                await do(req)

        try:
            if closed_loop:
                queue = sorted(sessions.values(), key=lambda s: s[0].t)
                it = iter(queue)

                async def worker() -> None:
                    for s in it:
                        await play_session(s, paced=False)

                await asyncio.gather(*(worker() for _ in range(closed_loop)))
            else:
                await asyncio.gather(*(play_session(s, paced=True) for s in sessions.values()))
        finally:
            if bar is not None:
                bar.close()
        return sorted(records, key=lambda r: r.t_send)

    async def _one(
        self, target: Target, req: wl.WorkloadRequest, rec: Record, book: LoadBook, t0: float
    ) -> None:
        n_tokens, hashes = self.prepared.get(req.id, (0, []))
        if target.client is not None:
            caches = None
            if target.client.needs_cache:
                caches = await engine_caches(self.session, self.engines)
            engine, predicted = target.client.choose(book, n_tokens, hashes, caches)
            rec.engine, rec.predicted = engine, predicted
            queued = n_tokens - (predicted or 0)
            book.begin(req.id, engine, queued, hashes if target.client.needs_hashes else ())
            base = self.engines[engine].url
        else:
            assert target.router_url is not None
            base = target.router_url
        try:
            routed = await send_one(
                self.session, base, req, rec, t0, on_first=lambda: book.first_token(req.id)
            )
        finally:
            book.end(req.id)
        if target.client is None:
            rec.engine = self._url_index.get((routed or "").rstrip("/").split("#")[0], -1)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{desc:>18}", unit="req", leave=False, file=sys.stderr)


# ----------------------------------------------------------------------------------------
# Workloads


def build_workload(name: str, args: argparse.Namespace) -> list[wl.WorkloadRequest]:
    sizes = dict((QUICK_SIZES if args.quick else FULL_SIZES).get(name, {}))
    if name == "mooncake":
        trace = args.trace or wl.SYNTHETIC_TRACE
        reqs = wl.mooncake_workload(
            trace, limit=sizes.get("limit"), max_tokens=args.max_tokens, max_input=args.max_input
        )
        rate = sizes.get("rate") if args.trace is None else None  # a user trace keeps its pace
        return wl.scale_to_rate(reqs, rate) if rate else reqs
    fn = wl.WORKLOADS.get(name)
    if fn is None:
        path = Path(name)
        if path.exists():
            return wl.read_jsonl(path)[0]
        raise SystemExit(f"unknown workload {name!r}: use one of {', '.join(ALL_WORKLOADS)}")
    return fn(seed=args.seed, max_tokens=args.max_tokens, **sizes)


def prepare(requests: Sequence[wl.WorkloadRequest]) -> dict[str, tuple[int, list[int]]]:
    """Token count and block hashes per request, as the engines will compute them."""
    from events.hashing import HashScheme
    from events.tokenizer import encode_chat, encode_prompt, load_tokenizer

    tok = load_tokenizer()
    scheme = HashScheme(algo=HASH_ALGO, seed=None, block_size=BLOCK_SIZE)
    out = {}
    for r in requests:
        if r.kind == "chat":
            ids = encode_chat(tok, r.messages or [])
        elif isinstance(r.prompt, str):
            ids = encode_prompt(tok, r.prompt, True)
        else:
            ids = list(r.prompt or [])
        out[r.id] = (len(ids), scheme.block_hashes(ids))
    return out


def load_workloads(
    args: argparse.Namespace,
) -> dict[str, tuple[list[wl.WorkloadRequest], dict[str, tuple[int, list[int]]]]]:
    """Every workload of the run; token counts and hashes only when the upper bound runs."""
    out = {}
    for name in args.workload:
        requests = build_workload(name, args)
        if args.save_workload:
            label = name if name in wl.WORKLOADS else Path(name).stem
            wl.write_jsonl(Path(args.save_workload) / f"{label}.jsonl", requests, {"name": label})
        out[name] = (requests, prepare(requests) if "oracle" in args.policy else {})
    return out


# ----------------------------------------------------------------------------------------
# Main


async def _warm(session: aiohttp.ClientSession, base: str, n: int) -> None:
    """A few tiny unique requests so the first measured ones do not pay start-up costs."""
    for i in range(n):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"warm-up {i} {time.time_ns()}"}],
            "max_tokens": 2,
            "stream": True,
        }
        async with session.post(base + "/v1/chat/completions", json=body) as r:
            await r.read()


async def run_workload(
    name: str,
    workload: tuple[list[wl.WorkloadRequest], dict[str, tuple[int, list[int]]]],
    args: argparse.Namespace,
    procs: Processes,
    session: aiohttp.ClientSession,
    engines: Sequence[Engine],
    logdir: Path,
) -> dict[str, Any]:
    requests, prepared = workload
    runner = Runner(session, engines, requests, prepared, args.progress)
    runs: list[PolicyRun] = []
    for pol in args.policy:
        router_proc = None
        try:
            if pol in ROUTER_POLICIES:
                url, router_proc = start_router(procs, engines, ROUTER_POLICIES[pol], logdir, pol)
                await wait_ready(session, url, router_proc, "/ready")
                await _warm(session, url, len(engines))
                target = Target(pol, url, None)
            else:
                for e in engines:
                    await _warm(session, e.url, 1)
                target = Target(pol, None, make_client_policy(pol, len(engines), args.seed))
            await reset_engines(session, engines)
            pids = {"engines": [e.proc.pid for e in engines]}
            if router_proc is not None:
                pids["router"] = [router_proc.pid]
            meter = CpuMeter(pids)
            meter.start()
            t = time.perf_counter()
            recs = await runner.run(target, args.rate, args.closed_loop)
            wall = time.perf_counter() - t
            cpu = meter.stop()
            if target.router_url:
                cpu["router_decision_ms"] = await router_decision_ms(session, target.router_url)
            runs.append(PolicyRun(pol, recs, wall, cpu))
            ok = sum(1 for r in recs if r.status == 200 and r.error is None)
            print(f"  {name}/{pol}: {ok}/{len(recs)} ok in {wall:.1f} s", file=sys.stderr)
        finally:
            if router_proc is not None:
                procs.stop_one(router_proc)
    rate = args.rate or wl.request_rate(requests)
    return {
        "workload": name if name in wl.WORKLOADS else Path(name).stem,
        "requests": len(requests),
        "sessions": len({r.session for r in requests if r.session}),
        "rate": rate,
        "closed_loop": args.closed_loop,
        "runs": runs,
    }


async def main_async(args: argparse.Namespace, procs: Processes) -> list[dict[str, Any]]:
    logdir = Path(args.out) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    timeout = aiohttp.ClientTimeout(total=300)
    conn = aiohttp.TCPConnector(limit=0)
    results = []
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        print(f"starting {args.engines} engine shims ...", file=sys.stderr)
        engines = start_engines(procs, args, logdir)
        # Build (and, for the upper bound, tokenize) the workloads while the engines start.
        loading = asyncio.ensure_future(asyncio.to_thread(load_workloads, args))
        try:
            for e in engines:
                await wait_ready(session, e.url, e.proc)
        finally:
            loaded = await loading
        for name in args.workload:
            print(f"workload {name}:", file=sys.stderr)
            results.append(
                await run_workload(name, loaded[name], args, procs, session, engines, logdir)
            )
    return results


def command_line(argv: Sequence[str] | None) -> str:
    import shlex

    argv = list(sys.argv[1:] if argv is None else argv)
    return "python -m bench.fleet " + " ".join(shlex.quote(a) for a in argv)


def save_results(
    results: list[dict[str, Any]], args: argparse.Namespace, command: str, elapsed_s: float
) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "args": vars(args),
        "command": command,
        "elapsed_s": elapsed_s,
        "workloads": [],
    }
    for res in results:
        w = {k: v for k, v in res.items() if k != "runs"}
        w["runs"] = [
            {
                "policy": r.policy,
                "wall_s": r.wall_s,
                "cpu": r.cpu,
                "records": [asdict(x) for x in r.records],
            }
            for r in res["runs"]
        ]
        doc["workloads"].append(w)
    path = out / "results.json"
    path.write_text(json.dumps(doc))
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        default="chat",
        help=f"comma list of {', '.join(ALL_WORKLOADS)}, 'all', or a workload .jsonl file",
    )
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--policy", default=",".join(ALL_POLICIES), help="comma list, or 'all'")
    ap.add_argument("--quick", action="store_true", help="small sizes: < 2 min on 2 cores")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, default=None, help="open loop: Poisson req/s")
    mode.add_argument("--closed-loop", type=int, default=None, metavar="C", help="C at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-scale", type=float, default=1.0, help="engines' GPU cost model scale")
    ap.add_argument("--gpu-blocks", type=int, default=400, help="KV blocks per engine (16 tok)")
    ap.add_argument(
        "--backend",
        choices=("sim", "torch"),
        default="sim",
        help="engines' compute: simulated cost model, or SmolLM2-135M on the CPU (slow: 1-2 engines)",
    )
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    ap.add_argument("--max-input", type=int, default=3500, help="cut Mooncake prompts (tokens)")
    ap.add_argument("--trace", default=None, help="a Mooncake trace .jsonl (default: synthetic)")
    ap.add_argument("--save-workload", default=None, metavar="DIR", help="write workload JSONL")
    ap.add_argument("--out", default="/tmp/bench-fleet", help="results.json and logs go here")
    ap.add_argument("--report", default=None, help="write the markdown report here")
    ap.add_argument("--img-dir", default=None, help="PNG plots (default: next to the report)")
    ap.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty()
    )
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.workload = list(ALL_WORKLOADS) if args.workload == "all" else args.workload.split(",")
    args.policy = list(ALL_POLICIES) if args.policy == "all" else args.policy.split(",")
    bad = [p for p in args.policy if p not in ROUTER_POLICIES and p not in CLIENT_POLICIES]
    if bad:
        ap.error(f"unknown policy {', '.join(bad)}; known: {', '.join(ALL_POLICIES)}")
    if args.engines < 1 or args.gpu_blocks < 2:
        ap.error("need --engines >= 1 and --gpu-blocks >= 2")
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be > 0")
    if args.closed_loop is not None and args.closed_loop < 1:
        ap.error("--closed-loop must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    procs = Processes()

    def _term(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    t0 = time.monotonic()
    try:
        results = asyncio.run(main_async(args, procs))
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every process this benchmark started", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"bench.fleet: error: {e}", file=sys.stderr)
        return 1
    finally:
        procs.stop()
    elapsed = time.monotonic() - t0
    cmd = command_line(argv)
    path = save_results(results, args, cmd, elapsed)
    from bench import report

    print(report.fleet_markdown(results, args, elapsed, command=cmd))
    if args.report:
        img = Path(args.img_dir) if args.img_dir else Path(args.report).parent / "img"
        report.write_fleet_report(Path(args.report), results, args, img, elapsed, command=cmd)
        print(f"report: {args.report} (plots in {img}); raw records: {path}", file=sys.stderr)
    else:
        print(f"raw records: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
