"""Which instance holds which block: the live map built from KV events (design §3.1-§3.4).

Layout, chosen for memory and for the match walk (docs/benchmarks.md, section 3):

* Each instance gets a small integer id and a one-bit mask ``1 << id``.
* Per medium ("GPU", "CPU", ...) a ``_Tier`` keeps ``holders: dict[hash, mask]``: one dict
  entry per distinct hash, whatever the number of instances holding it. The single-bit masks
  are pre-built objects shared by every entry, so a hash held by one instance costs only its
  dict slot and the hash int itself.
* A ref count of 1 is implicit in the bit; only the rare duplicates (vLLM storing one hash
  twice, spec §4.1) go into a per-instance side dict ``extra[id][hash] = count``.
* The per-instance reverse record is an append-only ``array('Q')`` log of the hashes it stored
  (8 bytes each, versus ~30-60 for a set entry). Dropping an instance clears its bit for
  every logged hash; the log is compacted when removals leave it twice as long as the live
  count, so its size stays proportional to what the instance holds.
* ``match`` walks the prompt's hashes with one dict probe and a few mask operations per block
  and stops as soon as no instance continues (chained hashes: a gap ends every run).
"""

from __future__ import annotations

import abc
import sys
from array import array
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from events.hashing import normalize_event_hash
from events.model import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    is_prefix_group,
)

from .instance import InstanceKey

__all__ = [
    "ApplyResult",
    "BlockIndex",
    "Match",
    "MemoryIndex",
    "normalize_medium",
]


def normalize_medium(medium: str | None) -> str:
    """Event medium as an index tier name: None means GPU; case is not significant."""
    return MEDIUM_GPU if medium is None else medium.upper()


_NO_TIERS: Mapping[str, int] = MappingProxyType({})


class Match:
    """One instance's hit for a prompt.

    ``blocks``: unbroken run of GPU-resident blocks from block 0. ``tier_blocks``: per lower
    tier (medium), the unbroken run from block 0 where each block is on the GPU *or* in that
    tier; only tiers that extend the run beyond ``blocks`` are listed. (A plain slotted class:
    match() builds up to one per instance per request, so construction cost matters.)
    """

    __slots__ = ("blocks", "tier_blocks")

    def __init__(self, blocks: int = 0, tier_blocks: Mapping[str, int] | None = None) -> None:
        self.blocks = blocks
        self.tier_blocks: Mapping[str, int] = _NO_TIERS if tier_blocks is None else tier_blocks

    @property
    def best_tier_blocks(self) -> int:
        """The longest run counting any one lower tier (>= blocks)."""
        return max(self.tier_blocks.values(), default=self.blocks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Match):
            return NotImplemented
        return self.blocks == other.blocks and dict(self.tier_blocks) == dict(other.tier_blocks)

    def __repr__(self) -> str:
        return f"Match(blocks={self.blocks}, tier_blocks={dict(self.tier_blocks)})"


@dataclass(slots=True)
class ApplyResult:
    """What one batch did to the index, for metrics and tests."""

    stored: int = 0
    removed: int = 0
    ignored: int = 0
    cleared: bool = False


class BlockIndex(abc.ABC):
    """The index contract; MemoryIndex now, a Redis-backed index for router replicas later."""

    def apply(self, inst: InstanceKey, batch: KVEventBatch) -> ApplyResult:
        """Apply one event batch of one instance, in order.

        Only prefix-indexable groups count (``is_prefix_group``); AllBlocksCleared drops the
        instance. Hashes are normalised to u64 here too, so raw decoder output is fine.
        """
        res = ApplyResult()
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if not is_prefix_group(ev):
                    res.ignored += len(ev.block_hashes)
                    continue
                hashes = [normalize_event_hash(h) for h in ev.block_hashes]
                self.store(inst, hashes, normalize_medium(ev.medium))
                res.stored += len(hashes)
            elif isinstance(ev, BlockRemoved):
                if not is_prefix_group(ev):
                    res.ignored += len(ev.block_hashes)
                    continue
                hashes = [normalize_event_hash(h) for h in ev.block_hashes]
                self.remove(inst, hashes, normalize_medium(ev.medium))
                res.removed += len(hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.drop_instance(inst)
                res.cleared = True
        return res

    @abc.abstractmethod
    def store(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        """One more reference per hash for (inst, medium)."""

    @abc.abstractmethod
    def remove(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        """One reference less per hash; unknown hashes are ignored (events may predate us)."""

    @abc.abstractmethod
    def drop_instance(self, inst: InstanceKey) -> int:
        """Forget every block of one instance (all media); returns how many entries went."""

    @abc.abstractmethod
    def match(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        """Per instance with at least one block: its run from block 0 (see Match)."""

    @abc.abstractmethod
    def instance_hashes(self, inst: InstanceKey, medium: str = MEDIUM_GPU) -> dict[int, int]:
        """hash -> ref count for one instance and medium (truth checks, debugging)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """entries, instances, hashes, approx_bytes (and per-medium detail)."""


class _Tier:
    """One medium's part of the index (see the module docstring for the layout)."""

    __slots__ = ("extra", "holders", "live", "logs")

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self.logs: dict[int, array] = {}
        self.live: dict[int, int] = {}  # iid -> distinct hashes held
        self.extra: dict[int, dict[int, int]] = {}  # iid -> {hash: refcount > 1}

    def store(self, iid: int, bit: int, hashes: Iterable[int]) -> None:
        holders = self.holders
        log = self.logs.get(iid)
        if log is None:
            log = self.logs[iid] = array("Q")
        added = 0
        for h in hashes:
            m = holders.get(h)
            if m is None:
                holders[h] = bit
            elif m & bit:
                ex = self.extra.setdefault(iid, {})
                ex[h] = ex.get(h, 1) + 1
                continue
            else:
                holders[h] = m | bit
            log.append(h)
            added += 1
        if added:
            self.live[iid] = self.live.get(iid, 0) + added

    def remove(self, iid: int, bit: int, hashes: Iterable[int]) -> None:
        holders = self.holders
        ex = self.extra.get(iid)
        gone = 0
        for h in hashes:
            m = holders.get(h)
            if m is None or not m & bit:
                continue
            if ex:
                c = ex.get(h)
                if c is not None:
                    if c > 2:
                        ex[h] = c - 1
                    else:
                        del ex[h]
                    continue
            m &= ~bit
            if m:
                holders[h] = m
            else:
                del holders[h]
            gone += 1
        if gone:
            live = self.live[iid] - gone
            self.live[iid] = live
            log = self.logs[iid]
            if len(log) > 2 * live + 1024:
                self._compact(iid, bit)

    def _compact(self, iid: int, bit: int) -> None:
        holders = self.holders
        seen: set[int] = set()
        out = array("Q")
        for h in self.logs[iid]:
            if h not in seen and holders.get(h, 0) & bit:
                seen.add(h)
                out.append(h)
        self.logs[iid] = out

    def drop(self, iid: int, bit: int) -> int:
        log = self.logs.pop(iid, None)
        n = self.live.pop(iid, 0)
        self.extra.pop(iid, None)
        if log is None:
            return 0
        holders = self.holders
        nbit = ~bit
        for h in log:
            m = holders.get(h)
            if m is not None and m & bit:
                m &= nbit
                if m:
                    holders[h] = m
                else:
                    del holders[h]
        return n

    def refs(self, iid: int, bit: int) -> dict[int, int]:
        out: dict[int, int] = {}
        holders = self.holders
        ex = self.extra.get(iid) or {}
        for h in self.logs.get(iid, ()):
            if holders.get(h, 0) & bit:
                out[h] = ex.get(h, 1)
        return out

    def nbytes(self) -> int:
        """Approximate heap bytes: containers plus the int objects they own."""
        n = sys.getsizeof(self.holders) + sum(sys.getsizeof(h) for h in self.holders)
        n += sum(a.buffer_info()[1] * a.itemsize + 64 for a in self.logs.values())
        n += sum(sys.getsizeof(d) for d in self.extra.values())
        return n


class MemoryIndex(BlockIndex):
    """The in-process index of one router (the default)."""

    def __init__(self) -> None:
        self._ids: dict[InstanceKey, int] = {}
        self._keys: list[InstanceKey | None] = []
        self._bits: list[int] = []  # pre-built 1 << id, shared by every single-holder entry
        self._free: list[int] = []
        self._tiers: dict[str, _Tier] = {MEDIUM_GPU: _Tier()}

    # ------------------------------------------------------------------ instances

    def _iid(self, inst: InstanceKey) -> int:
        iid = self._ids.get(inst)
        if iid is None:
            if self._free:
                iid = self._free.pop()
                self._keys[iid] = inst
            else:
                iid = len(self._keys)
                self._keys.append(inst)
                self._bits.append(1 << iid)
            self._ids[inst] = iid
        return iid

    def instances(self) -> list[InstanceKey]:
        return list(self._ids)

    def forget_instance(self, inst: InstanceKey) -> int:
        """Drop an instance's blocks and release its id (the engine left the fleet)."""
        n = self.drop_instance(inst)
        iid = self._ids.pop(inst, None)
        if iid is not None:
            self._keys[iid] = None
            self._free.append(iid)
        return n

    def _mask_of(self, insts: Collection[InstanceKey]) -> int:
        m = 0
        for inst in insts:
            iid = self._ids.get(inst)
            if iid is not None:
                m |= self._bits[iid]
        return m

    # ------------------------------------------------------------------ updates

    def store(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        iid = self._iid(inst)
        tier = self._tiers.get(medium)
        if tier is None:
            tier = self._tiers[medium] = _Tier()
        tier.store(iid, self._bits[iid], hashes)

    def remove(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        iid = self._ids.get(inst)
        tier = self._tiers.get(medium)
        if iid is None or tier is None:
            return
        tier.remove(iid, self._bits[iid], hashes)

    def drop_instance(self, inst: InstanceKey) -> int:
        iid = self._ids.get(inst)
        if iid is None:
            return 0
        bit = self._bits[iid]
        return sum(t.drop(iid, bit) for t in self._tiers.values())

    # ------------------------------------------------------------------ queries

    def match(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        if not hashes:
            return {}
        tiers = self._tiers
        gpu = tiers[MEDIUM_GPU].holders
        keys = self._keys
        bits = self._bits
        restrict = -1 if among is None else self._mask_of(among)
        runs: dict[int, int] = {}  # iid -> gpu run length

        alive = gpu.get(hashes[0], 0) & restrict
        n = len(hashes)
        if alive:
            get = gpu.get
            i = 1
            # Probe in chunks with C-level map/count: while the same instances continue
            # (the common case), a chunk costs no Python bytecode per block. A chunk with a
            # change is walked block by block; the walk ends at the first gap for everyone.
            while i < n:
                chunk = list(map(get, hashes[i : i + _CHUNK], _ZEROS))
                if chunk.count(alive) == len(chunk):
                    i += len(chunk)
                    continue
                for m in chunk:
                    if m != alive:
                        m &= alive
                        if m != alive:
                            _ended(alive & ~m, i, runs, bits)
                            alive = m
                            if not alive:
                                break
                    i += 1
                if not alive:
                    break
            if alive:
                _ended(alive, n, runs, bits)
        out = {keys[iid]: Match(run) for iid, run in runs.items()}  # type: ignore[misc]
        if len(tiers) > 1:
            self._match_tiers(hashes, restrict, out, runs)
        return out

    def _match_tiers(
        self, hashes: Sequence[int], restrict: int, out: dict[InstanceKey, Match], runs: dict
    ) -> None:
        gpu = self._tiers[MEDIUM_GPU].holders
        bits = self._bits
        keys = self._keys
        n = len(hashes)
        for medium, tier in self._tiers.items():
            if medium == MEDIUM_GPU or not tier.holders:
                continue
            lower = tier.holders
            truns: dict[int, int] = {}
            h0 = hashes[0]
            alive = (gpu.get(h0, 0) | lower.get(h0, 0)) & restrict
            i = 1 if alive else 0
            while alive and i < n:
                h = hashes[i]
                m = (gpu.get(h, 0) | lower.get(h, 0)) & alive
                if m != alive:
                    _ended(alive & ~m, i, truns, bits)
                    alive = m
                i += 1
            if alive:
                _ended(alive, n, truns, bits)
            for iid, run in truns.items():
                if run > runs.get(iid, 0):
                    inst = keys[iid]
                    mt = out.get(inst)  # type: ignore[arg-type]
                    if mt is None:
                        mt = out[inst] = Match(0)  # type: ignore[index]
                    if mt.tier_blocks is _NO_TIERS:
                        mt.tier_blocks = {}
                    mt.tier_blocks[medium] = run  # type: ignore[index]

    def instance_hashes(self, inst: InstanceKey, medium: str = MEDIUM_GPU) -> dict[int, int]:
        iid = self._ids.get(inst)
        tier = self._tiers.get(medium)
        if iid is None or tier is None:
            return {}
        return tier.refs(iid, self._bits[iid])

    def instance_blocks(self, inst: InstanceKey) -> dict[str, int]:
        """Distinct hashes held per medium by one instance (for /debug and gauges)."""
        iid = self._ids.get(inst)
        if iid is None:
            return {}
        return {m: t.live.get(iid, 0) for m, t in self._tiers.items() if t.live.get(iid)}

    def stats(self) -> dict:
        per_medium = {}
        entries = 0
        for medium, tier in self._tiers.items():
            e = sum(tier.live.values())
            entries += e
            per_medium[medium] = {"hashes": len(tier.holders), "entries": e}
        return {
            "entries": entries,
            "instances": len(self._ids),
            "hashes": sum(len(t.holders) for t in self._tiers.values()),
            "approx_bytes": sum(t.nbytes() for t in self._tiers.values()),
            "media": per_medium,
        }


_CHUNK = 32
_ZEROS = (0,) * _CHUNK


def _ended(mask: int, run: int, runs: dict[int, int], bits: list[int]) -> None:
    """Record ``run`` for every instance whose bit is in ``mask``."""
    while mask:
        low = mask & -mask
        runs[low.bit_length() - 1] = run
        mask ^= low
