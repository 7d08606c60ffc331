"""A real fleet for router tests: engine shims (in-process) and a router on loopback ports.

Helpers only (no tests here): test_router_e2e.py and test_router_http.py import them.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from conftest import free_port

from engine_shim.engine import EngineConfig
from engine_shim.runner import RunningShim, start_shim
from engine_shim.server import KVEventsConfig, ShimConfig
from router.config import RouterConfig
from router.instance import EngineSpec, InstanceKey
from router.server import Router, build_app

MODEL = "SmolLM2-135M-Instruct"


async def wait_for(pred, timeout: float = 10.0, what: str = "condition", interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class ShimSlot:
    """One engine: its ports survive a restart, so the router sees the same engine again."""

    http_port: int
    events_port: int
    replay_port: int
    hash_seed: str | None = None
    hash_algo: str = "sha256_cbor"
    num_gpu_blocks: int = 512
    time_scale: float = 0.0
    dp: int = 1
    shim: RunningShim | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def spec(self) -> EngineSpec:
        return EngineSpec(
            url=self.url,
            events=f"tcp://127.0.0.1:{self.events_port}",
            replay=f"tcp://127.0.0.1:{self.replay_port}",
            dp=self.dp,
        )

    def shim_config(
        self, engine_extra: dict[str, Any] | None = None, kv_extra: dict[str, Any] | None = None
    ) -> ShimConfig:
        """The shim's config; subclasses add engine or publisher settings through the extras."""
        return ShimConfig(
            host="127.0.0.1",
            port=self.http_port,
            engine=EngineConfig(
                num_gpu_blocks=self.num_gpu_blocks,
                block_size=16,
                hash_algo=self.hash_algo,
                hash_seed=self.hash_seed,
                time_scale=self.time_scale,
                max_model_len=4096,
                **(engine_extra or {}),
            ),
            served_model_name=MODEL,
            kv_events=KVEventsConfig(
                enable_kv_cache_events=True,
                endpoint=f"tcp://*:{self.events_port}",
                replay_endpoint=f"tcp://*:{self.replay_port}",
                **(kv_extra or {}),
            ),
            data_parallel_size=self.dp,
            dev_mode=True,
        )

    async def start(self, tokenizer: Any) -> RunningShim:
        self.shim = await start_shim(self.shim_config(), tokenizer=tokenizer)
        return self.shim

    async def stop(self) -> None:
        if self.shim is not None:
            await self.shim.stop()
            self.shim = None


def new_slot(**kw: Any) -> ShimSlot:
    return ShimSlot(free_port(), free_port(), free_port(), **kw)


@dataclass
class HarnessFleet:
    slots: list[ShimSlot]
    router: Router
    runner: web.AppRunner
    port: int
    extra: dict = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def key(self, i: int, rank: int = 0) -> InstanceKey:
        return InstanceKey(self.slots[i].url, rank)

    def router_blocks(self, i: int, rank: int = 0) -> set[int]:
        return set(self.router.index.instance_hashes(self.key(i, rank)))

    def engine_blocks(self, i: int, rank: int = 0) -> set[int]:
        shim = self.slots[i].shim
        assert shim is not None
        pool = shim.engines[rank]
        return set(pool_hashes(pool))

    async def joined(self, timeout: float = 10.0) -> None:
        """Every instance's event stream is live (its subscriber has seen a batch or replay)."""

        def ok() -> bool:
            return all(k in self.router.ingest._subs for k in self.router.fleet._instances)

        await wait_for(ok, timeout, "subscribers")


def pool_hashes(engine: Any) -> list[int]:
    """The engine's cached block hashes (event form), read from the shim's debug view."""
    return list(engine.kv.block_pool.cached_event_hashes())


@asynccontextmanager
async def running_fleet(
    tokenizer: Any, slots: list[ShimSlot], external: list[ShimSlot] = (), **router_kw: Any
):
    """Shims in ``slots`` start in-process; ``external`` ones are already running elsewhere."""
    for s in slots:
        await s.start(tokenizer)
    kw: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "engines": [s.spec() for s in [*slots, *external]],
        "health_interval_s": 0.2,
        "connect_timeout_s": 1.0,
        "request_timeout_s": 30.0,
        "pending_ttl_s": 2.0,
    }
    kw.update(router_kw)
    cfg = RouterConfig(**kw)
    router = Router(cfg, hf_tokenizer=tokenizer)
    app = build_app(router)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", cfg.port)
    await site.start()
    fleet = HarnessFleet([*slots, *external], router, runner, cfg.port)
    try:
        yield fleet
    finally:
        await runner.cleanup()
        for s in slots:
            await s.stop()


def chat_body(system: str, user: str, **kw: Any) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    body.update(kw)
    return body


def long_text(seed: int, words: int = 200) -> str:
    """Deterministic distinct text of a given length (each seed its own prefix)."""
    vocab = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
        "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
    ]  # fmt: skip
    out = [f"Document {seed}."]
    x = seed * 7919 + 13
    for _ in range(words):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(vocab[x % len(vocab)])
    return " ".join(out)


class ShimProcess:
    """An engine shim in its own process, so that a test can SIGKILL it mid-request."""

    def __init__(self, slot: ShimSlot) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 30.0) -> None:
        import json as _json
        import os
        import sys

        s = self.slot
        kv = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://*:{s.events_port}",
            "replay_endpoint": f"tcp://*:{s.replay_port}",
        }
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if s.hash_seed is not None:
            env["PYTHONHASHSEED"] = s.hash_seed
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine_shim.cli",
            "--host", "127.0.0.1", "--port", str(s.http_port),
            "--kv-events-config", _json.dumps(kv),
            "--num-gpu-blocks", str(s.num_gpu_blocks), "--block-size", "16",
            "--prefix-caching-hash-algo", s.hash_algo, "--max-model-len", "4096",
            "--time-scale", str(s.time_scale), "--served-model-name", MODEL, "--seed", "0",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise AssertionError("engine-shim did not print its ready line")
            line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            if not line:
                raise AssertionError("engine-shim exited before it was ready")
            if b"ready" in line:
                return

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def wait(self) -> None:
        if self.proc is not None:
            self.kill()
            await self.proc.wait()
