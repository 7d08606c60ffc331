"""Index truth check: the router's view of an instance against the engine's own block pool.

After a fault (restart, lost events, router restart) the only thing that matters is whether
the router's index says what the engine really caches. The engine shim serves its cache over
HTTP (``GET /debug/kv_cache``: every cached block hash per rank, duplicates included), so the
check goes through the same boundary a real deployment has and works for shims running in
another process. Helpers only, no tests.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.instance import InstanceKey


@dataclass(frozen=True)
class TruthDiff:
    """What the router believes minus what the engine holds, and the other way round."""

    key: InstanceKey
    router_only: frozenset[int]  # the router would predict hits the engine cannot give
    engine_only: frozenset[int]  # the engine holds blocks the router does not know about
    router_blocks: int
    engine_blocks: int

    @property
    def exact(self) -> bool:
        return not self.router_only and not self.engine_only

    @property
    def safe(self) -> bool:
        """Never over-predicts: every block the router knows is really there."""
        return not self.router_only

    def __str__(self) -> str:
        return (
            f"{self.key}: router={self.router_blocks} engine={self.engine_blocks} "
            f"router_only={len(self.router_only)} engine_only={len(self.engine_only)}"
        )


async def engine_truth(
    url: str, rank: int = 0, session: aiohttp.ClientSession | None = None
) -> Counter[int]:
    """The engine's cached event hashes with multiplicity (GET /debug/kv_cache)."""
    own = session is None
    s = session or aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
    try:
        async with s.get(url.rstrip("/") + "/debug/kv_cache") as r:
            r.raise_for_status()
            body = await r.json()
    finally:
        if own:
            await s.close()
    return Counter(int(h) for h in body["ranks"][str(rank)]["hashes"])


def router_view(router: Any, key: InstanceKey) -> Counter[int]:
    """The router's index for one instance (GPU medium), with refcounts."""
    return Counter(dict(router.index.instance_hashes(key)))


async def compare(router: Any, url: str, rank: int = 0) -> TruthDiff:
    key = InstanceKey(url.rstrip("/"), rank)
    truth = await engine_truth(url, rank)
    view = router_view(router, key)
    return TruthDiff(
        key,
        frozenset(set(view) - set(truth)),
        frozenset(set(truth) - set(view)),
        sum(view.values()),
        sum(truth.values()),
    )


async def assert_truth(
    router: Any, url: str, rank: int = 0, timeout: float = 10.0, exact: bool = True
) -> TruthDiff:
    """Wait (bounded) until the router's view of the instance equals the engine's cache.

    ``exact=True`` also compares refcounts (vLLM can hold one hash twice). With
    ``exact=False`` the router may know less than the engine (after an unfillable gap it
    starts empty and says so) but never more.
    """
    deadline = time.monotonic() + timeout
    key = InstanceKey(url.rstrip("/"), rank)
    while True:
        d = await compare(router, url, rank)
        ok = d.exact if exact else d.safe
        if ok and exact:
            ok = router_view(router, key) == await engine_truth(url, rank)
        if ok:
            return d
        if time.monotonic() > deadline:
            raise AssertionError(f"index truth check failed after {timeout}s: {d}")
        await asyncio.sleep(0.05)
