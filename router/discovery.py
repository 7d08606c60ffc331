"""Engines from DNS: the A/AAAA records of a headless Kubernetes Service, re-resolved.

A headless Service (clusterIP: None) answers with one address per ready pod, so the set of
engines is exactly the set of addresses. Each address becomes an engine
``http://IP:PORT`` with its event endpoints at the configured ports; pods that disappear
from DNS are removed (their ingest stops, their blocks are dropped).

Target syntax: ``dns://HOST:PORT[?events=5557][&replay=5558][&dp=N][&scheme=http]``
(``HOST:PORT`` alone also works).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from router.fleet import Fleet
from router.instance import EngineSpec
from router.tasks import cancel_and_wait

log = logging.getLogger("router.discovery")

Resolver = Callable[[str, int], Awaitable[list[str]]]


class DiscoveryError(ValueError):
    pass


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int
    events_port: int | None = None
    replay_port: int | None = None
    dp: int = 1
    scheme: str = "http"

    def spec_for(self, ip: str) -> EngineSpec:
        host = f"[{ip}]" if ":" in ip else ip
        events = f"tcp://{host}:{self.events_port}" if self.events_port else None
        replay = f"tcp://{host}:{self.replay_port}" if self.replay_port else None
        return EngineSpec(
            url=f"{self.scheme}://{host}:{self.port}", events=events, replay=replay, dp=self.dp
        )


def parse_target(s: str) -> DnsTarget:
    """``dns://svc.ns.svc.cluster.local:8000?events=5557&replay=5558&dp=2``."""
    raw = s if "://" in s else "dns://" + s
    u = urlsplit(raw)
    if u.scheme != "dns":
        raise DiscoveryError(f"discovery target must start with dns://, got {s!r}")
    if not u.hostname:
        raise DiscoveryError(f"discovery target {s!r} has no host")
    try:
        port = u.port or 8000
    except ValueError as e:
        raise DiscoveryError(f"bad port in discovery target {s!r}") from e
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    unknown = set(q) - {"events", "replay", "dp", "scheme"}
    if unknown:
        raise DiscoveryError(f"unknown discovery options {sorted(unknown)} in {s!r}")
    try:
        events = int(q["events"]) if "events" in q else None
        replay = int(q["replay"]) if "replay" in q else None
        dp = int(q.get("dp", "1"))
    except ValueError as e:
        raise DiscoveryError(f"events, replay and dp must be integers in {s!r}") from e
    if dp < 1:
        raise DiscoveryError("dp must be at least 1")
    scheme = q.get("scheme", "http")
    if scheme not in ("http", "https"):
        raise DiscoveryError("scheme must be http or https")
    return DnsTarget(u.hostname, port, events, replay, dp, scheme)


async def resolve_dns(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    ips = {info[4][0] for info in infos}
    return sorted(ips, key=lambda ip: (ipaddress.ip_address(ip).version, ipaddress.ip_address(ip)))


class DnsDiscovery:
    """Re-resolve every ``interval_s`` and sync the fleet to the answer.

    A failed lookup keeps the current fleet (DNS hiccups must not empty it); an empty
    answer does empty it, since that is what a Service with no ready pods says.
    """

    def __init__(
        self,
        fleet: Fleet,
        target: DnsTarget,
        interval_s: float = 10.0,
        resolver: Resolver | None = None,
    ) -> None:
        self.fleet = fleet
        self.target = target
        self.interval_s = interval_s
        self.resolver = resolver or resolve_dns
        self.lookups = 0
        self.failures = 0
        self._task: asyncio.Task | None = None

    async def resolve_once(self) -> bool:
        self.lookups += 1
        try:
            ips = await self.resolver(self.target.host, self.target.port)
        except (OSError, socket.gaierror) as e:
            self.failures += 1
            log.warning("dns discovery lookup failed host=%s error=%s", self.target.host, e)
            return False
        added, removed = self.fleet.sync(self.target.spec_for(ip) for ip in ips)
        if added or removed:
            log.info("dns discovery host=%s added=%s removed=%s", self.target.host, added, removed)
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="dns-discovery")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.resolve_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dns discovery round failed")
            await asyncio.sleep(self.interval_s)
