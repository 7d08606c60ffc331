"""Predicted blocks: what a routed prompt will store before its events say so (design §3.7).

Between a routing decision and the engine's BlockStored events there are tens of
milliseconds; a burst of requests with one new prefix would otherwise scatter, because none
of them sees the others' blocks in the index yet. So the router records the prompt's block
hashes for the chosen instance with a short time to live; the events confirm them (the
entries go, the index has them now) or the TTL ends them (the engine evicted them, or the
request failed).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from .instance import InstanceKey


class PendingEntries:
    """hash -> {instance: expiry}, walked like the index (unbroken run from block 0)."""

    def __init__(self, ttl_s: float = 2.0) -> None:
        if ttl_s < 0:
            raise ValueError(f"pending TTL must be >= 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._by_hash: dict[int, dict[InstanceKey, float]] = {}
        self._heap: list[tuple[float, int, InstanceKey]] = []  # (expiry, hash, inst), lazy
        self._count = 0

    def add(self, inst: InstanceKey, hashes: Sequence[int], now: float) -> None:
        """Record the prompt's blocks as pending on ``inst`` until ``now + ttl``."""
        if self.ttl_s <= 0:
            return
        exp = now + self.ttl_s
        by_hash = self._by_hash
        for h in hashes:
            holders = by_hash.get(h)
            if holders is None:
                holders = by_hash[h] = {}
            if inst not in holders:
                self._count += 1
            holders[inst] = exp
            heapq.heappush(self._heap, (exp, h, inst))

    def match(self, hashes: Sequence[int], now: float) -> dict[InstanceKey, int]:
        """Per instance, the run of unexpired pending blocks from block 0."""
        out: dict[InstanceKey, int] = {}
        if not hashes:
            return out
        first = self._by_hash.get(hashes[0])
        if not first:
            return out
        alive = {inst for inst, exp in first.items() if exp > now}
        for i, h in enumerate(hashes[1:], 1):
            if not alive:
                break
            holders = self._by_hash.get(h)
            if holders is None:
                for inst in alive:
                    out[inst] = i
                alive = set()
                break
            for inst in list(alive):
                exp = holders.get(inst)
                if exp is None or exp <= now:
                    out[inst] = i
                    alive.discard(inst)
        for inst in alive:
            out[inst] = len(hashes)
        return out

    def confirm(self, inst: InstanceKey, hashes: Iterable[int]) -> int:
        """The instance's events stored these hashes: they are no longer predictions."""
        n = 0
        by_hash = self._by_hash
        for h in hashes:
            holders = by_hash.get(h)
            if holders is not None and holders.pop(inst, None) is not None:
                n += 1
                if not holders:
                    del by_hash[h]
        self._count -= n
        return n

    def drop_instance(self, inst: InstanceKey) -> int:
        """Forget every prediction for one instance (it failed, or its stream restarted)."""
        n = 0
        for h in [h for h, holders in self._by_hash.items() if inst in holders]:
            holders = self._by_hash[h]
            del holders[inst]
            n += 1
            if not holders:
                del self._by_hash[h]
        self._count -= n
        return n

    def expire(self, now: float) -> int:
        """Remove entries whose TTL ended; returns how many went."""
        heap = self._heap
        by_hash = self._by_hash
        n = 0
        while heap and heap[0][0] <= now:
            _exp, h, inst = heapq.heappop(heap)
            holders = by_hash.get(h)
            if holders is None:
                continue
            cur = holders.get(inst)
            if cur is not None and cur <= now:  # a later add() refreshed it otherwise
                del holders[inst]
                n += 1
                if not holders:
                    del by_hash[h]
        self._count -= n
        # The heap holds stale tuples for refreshed or confirmed entries; rebuild it when it
        # grows far beyond the live count so memory stays bounded under steady traffic.
        if len(heap) > 4 * self._count + 4096:
            self._heap = [
                (exp, h, inst) for h, holders in by_hash.items() for inst, exp in holders.items()
            ]
            heapq.heapify(self._heap)
        return n

    def count(self) -> int:
        """Live (instance, hash) predictions, expired ones included until expire() runs."""
        return self._count
