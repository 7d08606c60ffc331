"""The unit the router routes to and indexes: one data-parallel rank of one engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class InstanceKey:
    """(engine base URL, dp rank). Frozen and ordered so it can key dicts and sort stably.

    ``str()`` is the engine URL for rank 0 and ``URL#dpN`` otherwise, which is what the router
    puts in logs, metrics labels and the ``x-routed-to`` header.
    """

    engine: str
    rank: int = 0

    def __str__(self) -> str:
        return self.engine if self.rank == 0 else f"{self.engine}#dp{self.rank}"

    @classmethod
    def parse(cls, s: str) -> InstanceKey:
        """Inverse of ``str()``: ``http://h:8001#dp2`` -> InstanceKey("http://h:8001", 2)."""
        base, sep, tail = s.rpartition("#dp")
        if sep and tail.isdigit():
            return cls(base, int(tail))
        return cls(s, 0)


_DEFAULT_EVENTS_PORT = 5557
_DEFAULT_REPLAY_PORT = 5558


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-dp-rank endpoint rule (spec §2.5): tcp port + rank, inproc gets ``_dpN``.

    Rank 0 and empty endpoints are unchanged; other transports cannot be offset.
    """
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, _, port = endpoint.rpartition(":")
        p = int(port)
        return f"{base}:{p + rank if p else 0}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} for dp rank {rank}: use tcp://")


@dataclass
class EngineSpec:
    """One engine as configured: base URL, event endpoints (rank 0), dp ranks, known seed.

    ``events``/``replay`` default to ``tcp://<host of url>:5557`` / ``:5558``; rank k uses the
    port + k, as vLLM binds them. ``replay="none"`` (or an empty string) disables replay.
    """

    url: str
    events: str | None = None
    replay: str | None = None
    dp: int = 1
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    @property
    def host(self) -> str:
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        host = u.hostname or "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    def instances(self) -> list[InstanceKey]:
        return [InstanceKey(self.url, r) for r in range(self.dp)]

    def _endpoint(self, value: str | None, default_port: int, rank: int) -> str | None:
        if value is None:
            value = f"tcp://{self.host}:{default_port}"
        elif value.lower() in ("", "none", "off"):
            return None
        return offset_endpoint_port(value, rank)

    def events_endpoint(self, rank: int = 0) -> str | None:
        return self._endpoint(self.events, _DEFAULT_EVENTS_PORT, rank)

    def replay_endpoint(self, rank: int = 0) -> str | None:
        return self._endpoint(self.replay, _DEFAULT_REPLAY_PORT, rank)
