"""The fleet: which instances exist, which are healthy, and how loaded each one is.

State is plain Python owned by the event loop (no locks); the only asyncio part is
``HealthChecker``. Load is counted locally per router process: requests in flight, and the
uncached prompt tokens of requests that have not yet produced a first byte (their prefill is
still queued on the engine), which is the load term of the policy's cost in tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp

from router.instance import EngineSpec, InstanceKey
from router.tasks import cancel_and_wait

log = logging.getLogger("router.fleet")


@dataclass
class InstanceState:
    """One routable unit: (engine, dp rank), its health and local load."""

    key: InstanceKey
    spec: EngineSpec
    healthy: bool = True
    stale: bool = False
    in_flight: int = 0
    queued_tokens: int = 0
    health_failures: int = 0
    last_error: str | None = None
    since: float = field(default_factory=time.monotonic)

    @property
    def url(self) -> str:
        return self.spec.url.rstrip("/")

    @property
    def rank(self) -> int:
        return self.key.rank

    def describe(self) -> dict:
        return {
            "instance": str(self.key),
            "url": self.url,
            "rank": self.rank,
            "healthy": self.healthy,
            "stale": self.stale,
            "in_flight": self.in_flight,
            "queued_tokens": self.queued_tokens,
            "last_error": self.last_error,
        }


@dataclass
class Ticket:
    """A request's claim on an instance's load, released exactly once."""

    key: InstanceKey
    queued: int
    first_byte: bool = False
    done: bool = False


Listener = Callable[[InstanceState], None]
# (instance, change in requests in flight, change in queued tokens): shared load (redis_load).
LoadListener = Callable[[InstanceKey, int, int], None]


class Fleet:
    """Engines and their instances; tells listeners when instances come and go."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineSpec] = {}
        self._instances: dict[InstanceKey, InstanceState] = {}
        self._on_added: list[Listener] = []
        self._on_removed: list[Listener] = []
        self._on_health: list[Listener] = []
        self._on_load: list[LoadListener] = []

    # -- membership ---------------------------------------------------------------------

    def on_added(self, fn: Listener) -> None:
        self._on_added.append(fn)

    def on_removed(self, fn: Listener) -> None:
        self._on_removed.append(fn)

    def on_health_change(self, fn: Listener) -> None:
        self._on_health.append(fn)

    def on_load(self, fn: LoadListener) -> None:
        """Told every change of a ticket's load (router replicas publish theirs to Redis)."""
        self._on_load.append(fn)

    def add_engine(self, spec: EngineSpec) -> list[InstanceState]:
        """Register an engine (idempotent by URL); returns the instances that are new."""
        url = spec.url.rstrip("/")
        if url in self._engines:
            return []
        self._engines[url] = spec
        added = []
        for key in spec.instances():
            st = InstanceState(key=key, spec=spec)
            self._instances[key] = st
            added.append(st)
            for fn in self._on_added:
                fn(st)
        log.info("engine added url=%s instances=%s", url, [str(s.key) for s in added])
        return added

    def remove_engine(self, url: str) -> list[InstanceState]:
        url = url.rstrip("/")
        spec = self._engines.pop(url, None)
        if spec is None:
            return []
        gone = [st for st in self._instances.values() if st.url == url]
        for st in gone:
            del self._instances[st.key]
            for fn in self._on_removed:
                fn(st)
        log.info("engine removed url=%s", url)
        return gone

    def sync(self, specs: Iterable[EngineSpec]) -> tuple[list[str], list[str]]:
        """Make the fleet equal to ``specs`` (discovery); returns (added urls, removed urls)."""
        want = {s.url.rstrip("/"): s for s in specs}
        removed = [u for u in self._engines if u not in want]
        for u in removed:
            self.remove_engine(u)
        added = [u for u, s in want.items() if u not in self._engines]
        for u in added:
            self.add_engine(want[u])
        return added, removed

    # -- queries ------------------------------------------------------------------------

    def engines(self) -> list[EngineSpec]:
        return list(self._engines.values())

    def instances(self) -> list[InstanceState]:
        return list(self._instances.values())

    def get(self, key: InstanceKey) -> InstanceState | None:
        return self._instances.get(key)

    def routable(self) -> list[InstanceState]:
        return [st for st in self._instances.values() if st.healthy]

    def any_healthy(self) -> bool:
        return any(st.healthy for st in self._instances.values())

    def healthy_engine_urls(self) -> list[str]:
        seen: dict[str, None] = {}
        for st in self._instances.values():
            if st.healthy:
                seen.setdefault(st.url, None)
        return list(seen)

    # -- health -------------------------------------------------------------------------

    def set_engine_health(self, url: str, ok: bool, detail: str | None = None) -> None:
        url = url.rstrip("/")
        for st in self._instances.values():
            if st.url == url:
                self._set_health(st, ok, detail)

    def mark_failed(self, key: InstanceKey, detail: str) -> None:
        """Passive health: a connect error on the request path takes the engine out at once."""
        st = self._instances.get(key)
        if st is not None:
            self.set_engine_health(st.url, False, detail)

    def _set_health(self, st: InstanceState, ok: bool, detail: str | None) -> None:
        if ok:
            st.health_failures = 0
            st.last_error = None
        else:
            st.health_failures += 1
            st.last_error = detail
        if st.healthy != ok:
            st.healthy = ok
            st.since = time.monotonic()
            log.warning(
                "instance %s instance=%s url=%s detail=%s",
                "healthy" if ok else "unhealthy",
                st.key,
                st.url,
                detail,
            )
            for fn in self._on_health:
                fn(st)

    # -- load ---------------------------------------------------------------------------

    def begin(self, key: InstanceKey, queued_tokens: int) -> Ticket:
        st = self._instances.get(key)
        queued = max(0, int(queued_tokens))
        if st is not None:
            st.in_flight += 1
            st.queued_tokens += queued
            for fn in self._on_load:
                fn(key, 1, queued)
        return Ticket(key=key, queued=queued)

    def first_byte(self, t: Ticket) -> None:
        """The engine answered: its prefill is done, so the prompt no longer queues there."""
        if t.first_byte or t.done:
            return
        t.first_byte = True
        st = self._instances.get(t.key)
        if st is not None:
            st.queued_tokens = max(0, st.queued_tokens - t.queued)
        if t.queued:
            for fn in self._on_load:
                fn(t.key, 0, -t.queued)

    def end(self, t: Ticket) -> None:
        if t.done:
            return
        self.first_byte(t)
        t.done = True
        st = self._instances.get(t.key)
        if st is not None:
            st.in_flight = max(0, st.in_flight - 1)
        for fn in self._on_load:
            fn(t.key, -1, 0)


class HealthChecker:
    """GET /health on every engine each interval; one failure takes it out, one success back."""

    def __init__(
        self,
        fleet: Fleet,
        session: aiohttp.ClientSession,
        interval_s: float,
        timeout_s: float = 2.0,
    ) -> None:
        self.fleet = fleet
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="health-checker")

    def poke(self) -> None:
        """Check now (a request just failed to connect somewhere)."""
        self._wake.set()

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def check_all(self) -> None:
        specs = self.fleet.engines()
        if specs:
            await asyncio.gather(*(self._check(s.url.rstrip("/")) for s in specs))

    async def _check(self, url: str) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self.session.get(url + "/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                detail = None if ok else f"/health answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        self.fleet.set_engine_health(url, ok, detail)

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop health checking
                log.exception("health check round failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
