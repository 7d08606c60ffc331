"""Router replicas sharing one index, one view of load and the ingest work through Redis.

``SharedRuntime`` is what a router started with ``--index redis://...`` holds. It composes the
components of router/redis_*.py and owns the rules that tie them to the router runtime:

* **Index.** ``SharedIndex(RedisIndex, mirror)``: every replica matches through Redis (one Lua
  call); the mirror is the router's own ``MemoryIndex`` and holds the instances *this*
  replica ingests, so that it can answer while Redis is down and refill Redis afterwards.
* **Who ingests.** One lease per instance (``LeaseManager``). Only the holder follows the
  engine's events: on winning a lease it copies the instance's blocks and last seq from
  Redis into its mirror and subscribes from ``seq + 1`` (the engine's replay buffer fills the
  hole); every batch is applied together with its seq under the lease (fencing), so a
  replica that lost its lease stops at its next batch and a takeover never applies a batch
  twice.
* **Parity.** The holder publishes each instance's hash-parity verdict (state, scheme,
  stale flag) in the hash ``P parity`` every lease round; the other replicas adopt it. They
  never see the engine's events, and detecting the scheme themselves would mean following
  every stream, the very work leases divide.
* **Load.** ``ReplicaLoad``: in-flight requests and queued tokens of every replica, summed in
  Redis; the fleet's tickets update this replica's counts, which the policy always sees
  exactly (not as last flushed).
* **Redis down.** Nothing raises to the request path: matches come from the mirror, load from
  this replica's own counts, leases are kept. ``RedisState`` raises the degraded flag, logs
  it, probes, and on recovery re-claims this replica's leases, refills Redis from the mirror
  and rewrites the load before the flag clears.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from events.hashing import HashScheme
from events.model import KVEventBatch
from router.index import Match, MemoryIndex
from router.instance import InstanceKey
from router.redis_index import RedisIndex, SharedIndex
from router.redis_lease import LeaseManager, lease_key
from router.redis_load import Load, SharedLoad
from router.redis_state import REDIS_ERRORS, RedisState, replica_id

log = logging.getLogger("router.shared")

LEASE_TTL_MS = 3000


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# ---------------------------------------------------------------------------- parity records


@dataclass(frozen=True, slots=True)
class ParityRecord:
    """One instance's parity verdict as the ingesting replica sees it."""

    state: str
    scheme: HashScheme
    stale: bool = False
    message: str = ""

    def encode(self) -> str:
        s = self.scheme
        return json.dumps(
            {
                "state": self.state,
                "algo": s.algo,
                "seed": s.seed,
                "block_size": s.block_size,
                "extra_key_style": s.extra_key_style,
                "stale": self.stale,
                "message": self.message,
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> ParityRecord | None:
        """None for anything malformed (a record from another version is ignored, not fatal)."""
        try:
            d = json.loads(raw)
            scheme = HashScheme(
                algo=str(d["algo"]),
                seed=None if d.get("seed") is None else str(d["seed"]),
                block_size=int(d["block_size"]),
                extra_key_style=d.get("extra_key_style", "tagged"),
            )
            return cls(str(d["state"]), scheme, bool(d.get("stale")), str(d.get("message", "")))
        except (ValueError, TypeError, KeyError):
            return None


def adopt_parity(tracker: Any, inst: InstanceKey, rec: ParityRecord) -> bool:
    """Make ``tracker`` (a ParityTracker) say what the ingester says; True if it changed."""
    return tracker.adopt(inst, rec.state, rec.scheme, rec.message)


# ---------------------------------------------------------------------------- load


class ReplicaLoad(SharedLoad):
    """SharedLoad whose reader sees its own counts as they are now, not as last flushed.

    A burst on one replica would otherwise read Redis before its own increments reach it (up
    to a flush interval plus a round trip) and herd onto one engine. ``view()`` replaces this
    replica's published share of each sum with its live local count.
    """

    def __init__(self, state: RedisState, replica: str, **kw: Any) -> None:
        super().__init__(state, replica, **kw)
        self.confirmed: dict[InstanceKey, tuple[int, int]] = {}

    def change(self, inst: InstanceKey, requests: int, tokens: int) -> None:
        """Fleet load listener: signed deltas of one ticket."""
        if requests > 0 or tokens > 0:
            self.add(inst, max(requests, 0), max(tokens, 0))
        if requests < 0 or tokens < 0:
            self.sub(inst, max(-requests, 0), max(-tokens, 0))

    def _snapshot(self, insts: Collection[InstanceKey]) -> dict[InstanceKey, tuple[int, int]]:
        return {i: (self.local.get(i, [0, 0])[0], self.local.get(i, [0, 0])[1]) for i in insts}

    async def flush(self, full: bool = False) -> bool:
        snap = self._snapshot(list(self.local) if full else list(self._dirty))
        ok = await super().flush(full)
        if ok:
            self.confirmed.update(snap)
        return ok

    async def _on_recovered(self, lost: bool) -> None:
        snap = self._snapshot(list(self.local))
        await super()._on_recovered(lost)
        self.confirmed = snap

    async def view(self) -> dict[InstanceKey, Load]:
        """Fleet-wide load per instance; this replica's own counts alone while degraded."""
        if self.state.degraded:
            return self.local_totals()
        tot = await self.totals()
        if self.state.degraded:  # the read failed: totals() answered with the local view
            return tot
        out = dict(tot)
        for inst in set(self.local) | set(self.confirmed):
            r, t = self.local.get(inst, (0, 0))
            cr, ct = self.confirmed.get(inst, (0, 0))
            cur = out.get(inst, Load())
            out[inst] = Load(max(0, cur.in_flight - cr) + r, max(0, cur.queued_tokens - ct) + t)
        return out

    def zero(self, inst: InstanceKey) -> None:
        """The instance left the fleet: publish zeros for it (a ticket may still end later)."""
        if inst in self.local:
            self.local[inst] = [0, 0]
            self._dirty.add(inst)
            self._wake.set()


# ---------------------------------------------------------------------------- the runtime


@dataclass
class Hooks:
    """What the runtime needs from the router (router/server.py passes its methods)."""

    wanted: Callable[[], list[InstanceKey]]  # instances with an event stream to ingest
    start_ingest: Callable[[InstanceKey, int], None]  # follow from this seq on
    stop_ingest: Callable[[InstanceKey], Awaitable[None]]
    export_parity: Callable[[InstanceKey], ParityRecord | None]
    import_parity: Callable[[InstanceKey, ParityRecord], None]


class SharedRuntime:
    """Shared state of one router replica; also the ``RemoteIndex`` its EventApplier uses."""

    def __init__(
        self,
        url: str,
        hooks: Hooks,
        mirror: MemoryIndex,
        *,
        pending_ttl_s: float = 0.0,
        lease_ttl_ms: int = LEASE_TTL_MS,
        lease_interval: float | None = None,
        load_ttl_ms: int = 10_000,
        heartbeat: float = 2.0,
        probe_interval: float = 0.5,
    ) -> None:
        self.hooks = hooks
        self.state = RedisState(url, probe_interval=probe_interval)
        self.replica = replica_id()
        # Recovery callbacks run in registration order: re-claim leases, rewrite the load,
        # then refill the index from the mirror, so that only a lease holder writes one.
        self.state.on_recovered(self._reclaim)
        self.mirror = mirror
        self.pending_ttl_ms = int(pending_ttl_s * 1000)
        self.load = ReplicaLoad(self.state, self.replica, ttl_ms=load_ttl_ms, heartbeat=heartbeat)
        self.redis = RedisIndex(self.state, pending=self.pending_ttl_ms > 0)
        # Last to recover: the flag clears right after the index refill, leaving no window
        # in which ingest would write to the mirror only.
        self.index = SharedIndex(self.redis, mirror=mirror)
        self.leases = LeaseManager(
            self.state,
            self.replica,
            ttl_ms=lease_ttl_ms,
            interval=lease_interval,
            on_acquired=self._on_acquired,
            on_lost=self._on_lost,
        )
        self.parity_key = self.state.prefix + "parity"
        self.lease_changes: dict[tuple[str, str], int] = {}  # (instance, change) -> count
        self._stop = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._load_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, take what leases are free and read the parity records, then keep at it.

        One round runs before this returns, so a replica started late matches through Redis
        (and with the right schemes) from its first request."""
        if await self.state.connect():
            log.info("shared state on redis replica=%s prefix=%s", self.replica, self.state.prefix)
            await self.sync_once()
        self._load_task = asyncio.create_task(self.load.run(), name="shared-load")
        self._loop_task = asyncio.create_task(self._loop(), name="ingest-leases")

    async def stop(self) -> None:
        """Stop ingesting, then hand the leases back at once (fast takeover), withdraw load."""
        self._stop.set()
        if self._loop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        for t in list(self._background):
            t.cancel()
        for inst in sorted(self.leases.held):
            await self.hooks.stop_ingest(inst)
        await self.leases.release_all()
        self.load.stop()
        if self._load_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._load_task
        await self.state.aclose()

    async def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.leases.interval)
            if self._stop.is_set():
                break
            if self.state.degraded:
                continue  # the probe rebuilds; leases are re-claimed by _reclaim
            try:
                await self.sync_once()
            except Exception:  # a bug here must not stop lease renewal for good
                log.exception("lease round failed")

    async def sync_once(self) -> None:
        """One lease round and one parity exchange."""
        wanted = set(self.hooks.wanted())
        for inst in sorted(self.leases.held - wanted):
            await self._retire(inst)
        await self.leases.round(wanted)
        await self._sync_parity()

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- leases --------------------------------------------------------------------------

    def holds(self, inst: InstanceKey) -> bool:
        return inst in self.leases.held

    def _count_change(self, inst: InstanceKey, change: str) -> None:
        k = (str(inst), change)
        self.lease_changes[k] = self.lease_changes.get(k, 0) + 1

    async def _on_acquired(self, inst: InstanceKey) -> None:
        self._count_change(inst, "acquired")
        try:
            seq, refs = await self._snapshot(inst)
        except REDIS_ERRORS as exc:
            # Cannot read where the last holder stopped: rebuild from the engine's replay
            # buffer into the mirror; recovery refills Redis from it.
            self.state.failed(exc)
            seq, refs = None, {}
            self.index.dirty.add(inst)
        self.mirror.drop_instance(inst)
        for medium, counts in refs.items():
            flat = [h for h, c in counts.items() for _ in range(c)]
            if flat:
                self.mirror.store(inst, flat, medium)
        self.index.seqs[inst] = seq
        start = 0 if seq is None else seq + 1
        log.info(
            "ingest lease acquired instance=%s replica=%s resume_seq=%d blocks=%d",
            inst,
            self.replica,
            start,
            sum(len(c) for c in refs.values()),
        )
        self.hooks.start_ingest(inst, start)

    async def _snapshot(self, inst: InstanceKey) -> tuple[int | None, dict[str, dict[int, int]]]:
        """The instance's last seq and ref counts per medium, as the last holder left them
        (key layout in docs/redis.md; nobody writes them while we hold the lease)."""
        c, P = self.state.client, self.redis.P
        iid = await c.hget(P + "ids", str(inst))
        if iid is None:
            return None, {}
        iid = _s(iid)
        media = sorted(_s(m) for m in await c.smembers(f"{P}im:{iid}"))
        pipe = c.pipeline(transaction=True)
        pipe.hget(P + "seq", iid)
        for m in media:
            pipe.hgetall(f"{P}i:{iid}:{m}")
        res = await pipe.execute()
        seq = None if res[0] is None else int(res[0])
        refs = {
            m: {int(_s(h), 16): int(n) for h, n in raw.items()}
            for m, raw in zip(media, res[1:], strict=True)
        }
        return seq, refs

    async def _on_lost(self, inst: InstanceKey) -> None:
        self._count_change(inst, "lost")
        await self.hooks.stop_ingest(inst)
        self.index.forget(inst)

    async def _retire(self, inst: InstanceKey) -> None:
        """The instance left this replica's fleet: stop and drop its blocks while the lease is
        still ours (then the round releases it), so a gone engine leaves nothing in Redis."""
        await self.hooks.stop_ingest(inst)
        await self.index.drop_instance(inst)
        with contextlib.suppress(*REDIS_ERRORS):
            await self.state.client.hdel(self.parity_key, str(inst))

    async def _reclaim(self, lost: bool) -> None:
        """Recovery, first callback: keep each lease we held (renew it, or take it again if
        Redis lost it); an instance another replica took meanwhile is given up."""
        for inst in sorted(self.leases.held):
            if await self.leases.renew(inst) or await self.leases.try_acquire(inst):
                continue
            log.warning("ingest lease of %s taken by another replica during the outage", inst)
            self.leases.held.discard(inst)
            await self._on_lost(inst)

    # ---- parity --------------------------------------------------------------------------

    async def _sync_parity(self) -> None:
        c = self.state.client
        held = sorted(self.leases.held)
        try:
            recs = {str(i): r.encode() for i in held if (r := self.hooks.export_parity(i))}
            if recs:
                await c.hset(self.parity_key, mapping=recs)
            raw = await c.hgetall(self.parity_key)
        except REDIS_ERRORS as exc:
            self.state.failed(exc)
            return
        for name, value in raw.items():
            try:
                inst = InstanceKey.parse(_s(name))
            except ValueError:
                continue
            if inst in self.leases.held:
                continue
            rec = ParityRecord.decode(value)
            if rec is not None:
                self.hooks.import_parity(inst, rec)

    # ---- RemoteIndex (the ingest side) ---------------------------------------------------

    async def apply(self, key: InstanceKey, batch: KVEventBatch, seq: int | None) -> bool:
        res = await self.index.apply(key, batch, seq=seq, token=self.replica)
        if res is not None and res.fenced:
            log.warning("ingest fenced instance=%s: another replica holds its lease", key)
            self._count_change(key, "fenced")
            self.leases.held.discard(key)
            self.index.forget(key)
            return False
        return True

    async def drop(self, key: InstanceKey) -> int:
        n = self.mirror.instance_blocks(key)
        if not self.state.degraded:
            try:
                holder = await self.leases.holder(key)
            except REDIS_ERRORS as exc:
                self.state.failed(exc)
                holder = self.replica
            if holder != self.replica:
                # Not ours any more: the holder decides about the shared copy.
                self.index.forget(key)
                return sum(n.values())
        await self.index.drop_instance(key)
        return sum(n.values())

    def drop_soon(self, key: InstanceKey) -> None:
        """Drop the instance's blocks everywhere (from synchronous code), if we ingest it."""
        if self.holds(key):
            self._spawn(self.drop(key), f"drop {key}")

    def rebuild_soon(self, key: InstanceKey) -> None:
        """The engine was unreachable and is back: if we ingest it, rebuild it from seq 0."""
        if self.holds(key):
            self._spawn(self._rebuild(key), f"rebuild {key}")

    async def _rebuild(self, key: InstanceKey) -> None:
        await self.hooks.stop_ingest(key)
        await self.drop(key)
        if self.holds(key):
            self.index.seqs[key] = None
            self.hooks.start_ingest(key, 0)

    # ---- the request side ----------------------------------------------------------------

    async def match(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        if not hashes:
            return {}
        return await self.index.match(hashes, among)

    async def load_view(self) -> dict[InstanceKey, Load]:
        return await self.load.view()

    def add_pending_soon(self, inst: InstanceKey, hashes: Sequence[int]) -> None:
        """Predicted blocks, shared: other replicas see them in ``match`` for the TTL."""
        if self.pending_ttl_ms <= 0 or not hashes or self.state.degraded:
            return
        self._spawn(self._add_pending(inst, list(hashes)), "pending")

    async def _add_pending(self, inst: InstanceKey, hashes: list[int]) -> None:
        try:
            await self.redis.aadd_pending(inst, hashes, self.pending_ttl_ms)
        except REDIS_ERRORS as exc:
            self.state.failed(exc)

    def forget_instance(self, inst: InstanceKey) -> None:
        self.load.zero(inst)

    # ---- introspection -------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "namespace": self.state.config.namespace,
            "redis_degraded": self.state.degraded,
            "last_error": self.state.last_error or None,
            "leases_held": sorted(str(i) for i in self.leases.held),
            "dirty": sorted(str(i) for i in self.index.dirty),
        }

    def lease_key(self, inst: InstanceKey) -> str:
        return lease_key(self.state, inst)
