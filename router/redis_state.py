"""Connection to the shared Redis, and the replica's view of whether Redis is usable.

Every shared-state component (index, leases, load) goes through one ``RedisState``: it owns
the clients, built with short timeouts so that a dead Redis costs a request milliseconds, not
seconds, and the ``degraded`` flag that /metrics and logs report. A component that catches a
Redis error calls ``failed()`` and answers from its local view; a background probe notices
when Redis answers again, tells the components to rebuild (``on_recovered`` callbacks) and
clears the flag.

Redis can come back *empty* (a restart without persistence, the recommended setup). The probe
tells a restart from a network blip by an epoch key written at start: a missing or different
epoch means every shared key is gone, and the callbacks get ``lost=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry as SyncRetry

log = logging.getLogger("router.redis")

# Errors that mean "Redis cannot answer right now": the caller falls back to its local view.
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)

RecoveredCallback = Callable[[bool], Awaitable[None] | None]


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """What the ``--index redis://...`` URL says, plus the router's own options.

    The query string may carry ``ns`` (key namespace, one per model/fleet; default "default")
    and ``timeout`` (socket timeout in seconds); everything else (password, TLS, db) is
    redis-py's URL syntax, so ``rediss://:pw@host:6380/0`` works unchanged.
    """

    url: str
    namespace: str = "default"
    socket_timeout: float = 0.25
    connect_timeout: float = 0.25

    @classmethod
    def from_url(cls, url: str, **overrides: object) -> RedisConfig:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {url!r}")
        query = parse_qs(parts.query)
        ns = query.pop("ns", ["default"])[0]
        timeout = float(query.pop("timeout", ["0.25"])[0])
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        clean = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
        if "{" in ns or "}" in ns:
            raise ValueError("namespace must not contain '{' or '}' (it becomes a hash tag)")
        kw: dict = {"url": clean, "namespace": ns, "socket_timeout": timeout}
        kw["connect_timeout"] = timeout
        kw.update(overrides)
        return cls(**kw)

    def prefix(self) -> str:
        """Key prefix; the braces make it a Redis Cluster hash tag, so every key of one
        namespace lives in one slot and Lua scripts may touch several of them."""
        return f"pr:{{{self.namespace}}}:"


def replica_id() -> str:
    """A name unique to this process: lease tokens and load fields are keyed by it."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RedisState:
    """Clients, health flag and recovery for one Redis namespace.

    ``sync`` is a blocking client for tests, tools and the bench; ``client`` is the asyncio
    client the router's event loop uses, so no Redis call ever blocks the loop.
    """

    def __init__(self, config: RedisConfig | str, *, probe_interval: float = 0.5) -> None:
        self.config = RedisConfig.from_url(config) if isinstance(config, str) else config
        self.prefix = self.config.prefix()
        # No retries: redis-py's default retries with a backoff of up to seconds, which would
        # turn "Redis is down" into a stalled request; the caller falls back instead.
        kw = {
            "socket_timeout": self.config.socket_timeout,
            "socket_connect_timeout": self.config.connect_timeout,
            "health_check_interval": 0,
        }
        self.sync = redis.Redis.from_url(self.config.url, retry=SyncRetry(NoBackoff(), 0), **kw)
        self.client = aredis.Redis.from_url(self.config.url, retry=AsyncRetry(NoBackoff(), 0), **kw)
        self.probe_interval = probe_interval
        self.degraded = False
        self.degraded_since: float | None = None
        self.failures = 0  # Redis operations that failed (a counter for /metrics)
        self.recoveries = 0
        self.last_error: str = ""
        self._epoch: str | None = None
        self._callbacks: list[RecoveredCallback] = []
        self._probe: asyncio.Task | None = None

    @property
    def epoch_key(self) -> str:
        return self.prefix + "epoch"

    def key(self, *parts: object) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    def on_recovered(self, cb: RecoveredCallback) -> None:
        """Run ``cb(lost)`` after Redis answers again; ``lost`` means its data is gone."""
        self._callbacks.append(cb)

    # ---- health -------------------------------------------------------------------------

    def failed(self, exc: BaseException) -> None:
        """Record a failed operation; the first one flips the replica into degraded mode."""
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        if not self.degraded:
            self.degraded = True
            self.degraded_since = time.monotonic()
            log.warning(
                "redis degraded: %s; routing on the local view until it answers again",
                self.last_error,
            )
        self._start_probe()

    def ok(self) -> bool:
        return not self.degraded

    async def connect(self) -> bool:
        """Check Redis and claim or read the epoch; False (and degraded) if it is down."""
        try:
            self._epoch = await self._read_or_set_epoch()
            return True
        except REDIS_ERRORS as exc:
            self.failed(exc)
            return False

    async def _read_or_set_epoch(self) -> str:
        new = uuid.uuid4().hex
        await self.client.set(self.epoch_key, new, nx=True)
        cur = await self.client.get(self.epoch_key)
        return cur.decode() if isinstance(cur, bytes) else str(cur)

    def _start_probe(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # sync callers (tests, tools) probe with check_sync()
        if self._probe is None or self._probe.done():
            self._probe = loop.create_task(self._probe_loop(), name="redis-probe")

    async def _probe_loop(self) -> None:
        while self.degraded:
            await asyncio.sleep(self.probe_interval)
            with contextlib.suppress(*REDIS_ERRORS):
                await self.check()

    async def check(self) -> bool:
        """One probe: PING and epoch; on success after a failure, rebuild and clear the flag."""
        if self.degraded:
            # Pooled sockets opened before the outage are dead if Redis restarted; with no
            # retries each would fail one later call and flip the flag again.
            with contextlib.suppress(Exception):
                await self.client.connection_pool.disconnect(inuse_connections=False)
        try:
            await self.client.ping()
            epoch = await self._read_or_set_epoch()
        except REDIS_ERRORS as exc:
            self.failed(exc)
            return False
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        if self.degraded or lost:
            await self._recover(lost)
        return True

    async def _recover(self, lost: bool) -> None:
        log.warning(
            "redis answers again (data %s); rebuilding shared state", "lost" if lost else "kept"
        )
        for cb in self._callbacks:
            try:
                res = cb(lost)
                if asyncio.iscoroutine(res):
                    await res
            except REDIS_ERRORS as exc:
                self.failed(exc)
                return  # still not usable: stay degraded, the probe tries again
        self.recoveries += 1
        self.degraded = False
        self.degraded_since = None
        log.warning("redis recovered; degraded mode cleared")

    def check_sync(self) -> bool:
        """Blocking variant of the epoch check for code without an event loop (no callbacks)."""
        try:
            self.sync.ping()
            new = uuid.uuid4().hex
            self.sync.set(self.epoch_key, new, nx=True)
            cur = self.sync.get(self.epoch_key)
        except REDIS_ERRORS as exc:
            self.failed(exc)
            return False
        self._epoch = cur.decode() if isinstance(cur, bytes) else str(cur)
        self.degraded = False
        return True

    def metrics(self) -> dict[str, float]:
        """Figures for /metrics: ``router_redis_degraded`` and friends."""
        return {
            "redis_degraded": 1.0 if self.degraded else 0.0,
            "redis_failures_total": float(self.failures),
            "redis_recoveries_total": float(self.recoveries),
        }

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe
        with contextlib.suppress(Exception):
            await self.client.aclose()
        with contextlib.suppress(Exception):
            self.sync.close()
