"""Helpers for tests and benchmarks that run shims in-process (real sockets, real HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine_shim.engine import EngineConfig
from engine_shim.runner import RunningShim, start_shim
from engine_shim.server import KVEventsConfig, ShimConfig


def shim_config(
    *,
    events: bool = False,
    endpoint: str = "tcp://*:0",
    replay_endpoint: str | None = None,
    dp: int = 1,
    dev_mode: bool = False,
    max_request_body_bytes: int | None = None,
    **engine: Any,
) -> ShimConfig:
    """A small, fast shim: port 0, time_scale 0, 256 blocks, unless told otherwise."""
    eng = {"num_gpu_blocks": 256, "max_model_len": 2048, "time_scale": 0.0, **engine}
    cfg = ShimConfig(
        port=0,
        engine=EngineConfig(**eng),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=events, endpoint=endpoint, replay_endpoint=replay_endpoint
        ),
        data_parallel_size=dp,
        dev_mode=dev_mode,
    )
    if max_request_body_bytes is not None:
        cfg.max_request_body_bytes = max_request_body_bytes
    return cfg


@contextlib.asynccontextmanager
async def running_shim(
    tokenizer: Any = None, config: ShimConfig | None = None, **kw: Any
) -> AsyncIterator[RunningShim]:
    shim = await start_shim(config or shim_config(**kw), tokenizer=tokenizer)
    try:
        yield shim
    finally:
        await shim.stop()


async def wait_until(
    pred: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition"
) -> None:
    """Poll a condition with a deadline (for state changed by another task)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)
