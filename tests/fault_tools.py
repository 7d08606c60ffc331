"""Tools for the fault tests: a TCP relay that can lose traffic, and engine slots with knobs.

The relay sits between the router's SUB socket and an engine's PUB socket so that a test can
drop the connection (ZMQ reconnects by itself and loses what was sent meanwhile) or stop
reading (the engine's PUB reaches its high-water mark and drops batches), which are the two
real ways a KV-event stream loses batches. Helpers only, no tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from conftest import free_port
from router_harness import ShimSlot

from engine_shim.runner import RunningShim, start_shim
from router.config import RouterConfig
from router.instance import EngineSpec
from router.server import Router, build_app


class TcpRelay:
    """Forwards one listening port to ``upstream``; can cut, refuse or stall the traffic."""

    def __init__(self, upstream_port: int, rcvbuf: int | None = None) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.rcvbuf = rcvbuf
        self.refusing = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.connections = 0

    async def start(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        return self

    def cut(self) -> None:
        """Drop every open connection (both sides see a reset)."""
        for a, b in self._pairs:
            for w in (a, b):
                with contextlib.suppress(Exception):
                    w.transport.abort()
        self._pairs.clear()

    def pause(self) -> None:
        """Stop reading from upstream: its socket buffers fill and the sender backs up."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.refusing:
            cw.transport.abort()
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if self.rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.upstream_port))
        except OSError:
            sock.close()
            cw.transport.abort()
            return
        ur, uw = await asyncio.open_connection(sock=sock, limit=1024)
        self.connections += 1
        self._pairs.append((cw, uw))
        for src, dst, gated in ((cr, uw, False), (ur, cw, True)):
            t = asyncio.create_task(self._pump(src, dst, gated))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gated: bool):
        try:
            while True:
                if gated:
                    await self._flowing.wait()
                data = await src.read(1024)
                if not data:
                    break
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.transport.abort()


@dataclass
class FaultSlot(ShimSlot):
    """A ShimSlot whose router-side endpoints and publisher settings a test can change."""

    events_via: int | None = None  # the router subscribes here (a relay) instead
    replay_for_router: bool = True  # False: the router is told the engine has no replay
    kv: dict[str, Any] = field(default_factory=dict)  # extra KVEventsConfig fields
    max_num_seqs: int | None = None

    def spec(self) -> EngineSpec:
        port = self.events_via or self.events_port
        return EngineSpec(
            url=self.url,
            events=f"tcp://127.0.0.1:{port}",
            replay=f"tcp://127.0.0.1:{self.replay_port}" if self.replay_for_router else "none",
            dp=self.dp,
        )

    async def start(self, tokenizer: Any) -> RunningShim:
        eng: dict[str, Any] = {}
        if self.max_num_seqs is not None:
            eng["max_num_seqs"] = self.max_num_seqs
        self.shim = await start_shim(self.shim_config(eng, self.kv), tokenizer=tokenizer)
        return self.shim


def fault_slot(**kw: Any) -> FaultSlot:
    return FaultSlot(free_port(), free_port(), free_port(), **kw)


@dataclass
class RouterHandle:
    router: Router
    runner: web.AppRunner
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def router_on(
    tokenizer: Any, engines: list[EngineSpec], **kw: Any
) -> AsyncIterator[RouterHandle]:
    """A router process-equivalent (own index, own sockets) in front of running engines."""
    opts: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": free_port(),
        "engines": engines,
        "health_interval_s": 0.2,
        "connect_timeout_s": 1.0,
        "request_timeout_s": 30.0,
        "pending_ttl_s": 2.0,
    }
    opts.update(kw)
    cfg = RouterConfig(**opts)
    router = Router(cfg, hf_tokenizer=tokenizer)
    runner = web.AppRunner(build_app(router), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", cfg.port).start()
    try:
        yield RouterHandle(router, runner, cfg.port)
    finally:
        await runner.cleanup()


class LoopThread:
    """An event loop in a thread, so that synchronous hypothesis tests can drive async servers."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, timeout: float = 10.0) -> Any:
        """``fn()`` on the loop's thread (state owned by the loop is read there, not here)."""

        async def _call() -> Any:
            return fn()

        return self.run(_call(), timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()
