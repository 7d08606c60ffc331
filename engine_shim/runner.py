"""Start a shim (HTTP server, engines, KV-event publishers) inside a running event loop.

Tests and benchmarks use ``await start_shim(config)`` to get a real server on a real port
without a subprocess; the CLI uses the same function and then waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine_shim.server import ShimConfig, ShimServer


@dataclass
class RunningShim:
    server: ShimServer
    runner: web.AppRunner
    url: str
    # (events endpoint, replay endpoint or None) per rank, as bound (port offsets applied).
    events_endpoints: list[tuple[str, str | None]]

    @property
    def engines(self):
        return self.server.engines

    async def stop(self) -> None:
        await self.runner.cleanup()
        for p in self.server.publishers:
            if p is not None:
                p.close()


def make_publishers(config: ShimConfig) -> list[Any]:
    kv = config.kv_events
    n = config.data_parallel_size
    if not kv.enable_kv_cache_events:
        return [None] * n
    if kv.publisher not in (None, "zmq"):
        if kv.publisher == "null":
            return [None] * n
        raise ValueError(f"--kv-events-config: unknown publisher {kv.publisher!r}")
    from events.publisher import ZmqEventPublisher

    pubs: list[Any] = []
    try:
        for rank in range(n):
            pubs.append(
                ZmqEventPublisher(
                    endpoint=kv.endpoint,
                    replay_endpoint=kv.replay_endpoint,
                    topic=kv.topic,
                    buffer_steps=kv.buffer_steps,
                    hwm=kv.hwm,
                    max_queue_size=kv.max_queue_size,
                    data_parallel_rank=rank,
                )
            )
    except Exception:
        for p in pubs:
            p.close()
        raise
    return pubs


async def start_shim(config: ShimConfig, tokenizer: Any = None) -> RunningShim:
    """Build everything, bind the port (0 = any free one) and start serving."""
    config.engine.enable_kv_cache_events = config.kv_events.enable_kv_cache_events
    publishers = make_publishers(config)
    try:
        server = ShimServer(config, tokenizer=tokenizer, publishers=publishers)
        runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
    except Exception:
        for p in publishers:
            if p is not None:
                p.close()
        raise
    port = config.port
    for s in runner.sites:
        server_obj = getattr(s, "_server", None)
        socks = getattr(server_obj, "sockets", None) or []
        for sock in socks:
            port = sock.getsockname()[1]
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    eps = [(p.endpoint, p.replay_endpoint) if p is not None else ("", None) for p in publishers]
    return RunningShim(server, runner, f"http://{host}:{port}", eps)
