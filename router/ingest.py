"""Ingest: one KV-event stream per instance, applied to the index in seq order.

``EventApplier`` holds the rules and no sockets (tests drive it with plain batches);
``Ingest`` runs one asyncio task per instance around ``AsyncEventSubscriber``, which repairs
gaps by replay itself and reports what it could not repair.

Rules (issue 4 §2, design §3.5):

* Each task starts from seq 0, so the router rebuilds an instance's blocks from the engine's
  replay buffer when it (or the router) starts.
* "restart" (seq went backwards) or an unfillable "gap" drops the instance's blocks and
  predictions and marks it stale; the next applied batch clears the mark.
* Every BlockStored of block 0 (parent None) goes to the parity tracker, which decides the
  instance's hash scheme; instances whose scheme cannot be found are indexed by token-derived
  keys (KeyTranslator), so that matching stays exact.
* Stored hashes confirm the predictions (pending entries) made for the instance.

Shared index (``--index redis://``): the applier gets a ``remote`` (router/shared.py) that
applies each batch to the local mirror and to Redis with its seq, under the replica's ingest
lease. Ingest then starts each instance at the seq after the last one Redis recorded, and a
batch refused because the lease moved (fencing) ends that instance's task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq.asyncio

from events.model import BlockStored, KVEventBatch, is_prefix_group
from events.subscriber import AsyncEventSubscriber, StreamItem
from router.fleet import Fleet, InstanceState
from router.instance import InstanceKey
from router.metrics import RouterMetrics
from router.tasks import cancel_and_wait

log = logging.getLogger("router.ingest")


@dataclass
class InstanceStreamStats:
    batches: int = 0
    events: int = 0
    replayed: int = 0
    gaps: int = 0
    restarts: int = 0
    bad_frames: int = 0
    drops: int = 0
    last_seq: int | None = None
    last_event_at: float | None = None
    last_problem: str | None = None


class RemoteIndex(Protocol):
    """Where a shared-index replica sends batches (router/shared.py implements it)."""

    async def apply(self, key: InstanceKey, batch: KVEventBatch, seq: int | None) -> bool:
        """Apply to mirror and shared index; False: this replica lost the lease (stop)."""
        ...

    async def drop(self, key: InstanceKey) -> int:
        """Forget the instance's blocks (and its last seq) locally and in the shared index."""
        ...


class EventApplier:
    """Applies stream items of any instance to the router's state (index, pending, parity).

    ``translate`` (optional) returns a batch re-keyed for instances whose engine hashes the
    router cannot reproduce; ``observe`` (optional) feeds the parity tracker. With ``remote``
    the index writes go through it (``ahandle``), because they are network calls.
    """

    def __init__(
        self,
        index: Any,
        pending: Any,
        fleet: Fleet,
        metrics: RouterMetrics,
        observe: Callable[[InstanceKey, BlockStored], None] | None = None,
        translate: Callable[[InstanceKey, KVEventBatch], KVEventBatch | None] | None = None,
        on_drop: Callable[[InstanceKey, str], None] | None = None,
        remote: RemoteIndex | None = None,
    ) -> None:
        self.index = index
        self.pending = pending
        self.fleet = fleet
        self.metrics = metrics
        self.observe = observe
        self.translate = translate
        self.on_drop = on_drop
        self.remote = remote
        self.stats: dict[InstanceKey, InstanceStreamStats] = {}

    def stats_of(self, key: InstanceKey) -> InstanceStreamStats:
        st = self.stats.get(key)
        if st is None:
            st = self.stats[key] = InstanceStreamStats()
        return st

    def handle(self, key: InstanceKey, item: StreamItem) -> None:
        action = self._count(key, item)
        if action == "apply":
            self.apply(key, item.batch)  # type: ignore[arg-type]
        elif action:
            self.drop(key, action)

    async def ahandle(self, key: InstanceKey, item: StreamItem) -> bool:
        """``handle`` for a shared index; False when the lease is gone (stop ingesting)."""
        if self.remote is None:
            self.handle(key, item)
            return True
        action = self._count(key, item)
        if action == "apply":
            return await self.aapply(key, item.batch, item.seq)  # type: ignore[arg-type]
        if action:
            await self.adrop(key, action)
        return True

    def _count(self, key: InstanceKey, item: StreamItem) -> str | None:
        """Stats and metrics of one item; what to do: "apply", a drop reason, or None."""
        label = str(key)
        s = self.stats_of(key)
        if item.kind == "batch" and item.batch is not None:
            if item.replayed:
                s.replayed += 1
                self.metrics.replays.labels(label).inc()
            s.last_seq = item.seq
            return "apply"
        if item.kind == "restart":
            s.restarts += 1
            self.metrics.restarts.labels(label).inc()
            return item.detail or "publisher restarted"
        if item.kind == "gap":
            s.gaps += 1
            self.metrics.gaps.labels(label).inc()
            return item.detail or "unfillable gap"
        if item.kind == "bad_frame":
            s.bad_frames += 1
            s.last_problem = item.detail
            self.metrics.bad_frames.labels(label).inc()
            log.warning("bad event frame instance=%s seq=%s detail=%s", key, item.seq, item.detail)
        return None

    def apply(self, key: InstanceKey, batch: KVEventBatch) -> None:
        target = self._prepare(key, batch)
        self.index.apply(key, target)
        self._applied(key, batch, target)

    async def aapply(self, key: InstanceKey, batch: KVEventBatch, seq: int | None) -> bool:
        """Through the remote (mirror + shared index, with seq and lease fence)."""
        assert self.remote is not None
        target = self._prepare(key, batch)
        if not await self.remote.apply(key, target, seq):
            return False
        self._applied(key, batch, target)
        return True

    def _prepare(self, key: InstanceKey, batch: KVEventBatch) -> KVEventBatch:
        """Parity check of the batch's block-0 events, then the batch the index should get."""
        if self.observe is not None:
            for ev in batch.events:
                if (
                    isinstance(ev, BlockStored)
                    and ev.parent_block_hash is None
                    and is_prefix_group(ev)
                ):
                    self.observe(key, ev)
        target = batch
        if self.translate is not None:
            t = self.translate(key, batch)
            if t is not None:
                target = t
        return target

    def _applied(self, key: InstanceKey, batch: KVEventBatch, target: KVEventBatch) -> None:
        s = self.stats_of(key)
        stored: list[int] = []
        for ev in target.events:
            if isinstance(ev, BlockStored) and is_prefix_group(ev):
                stored.extend(ev.block_hashes)  # type: ignore[arg-type]
        if stored:
            self.pending.confirm(key, stored)
        n = len(batch.events)
        s.batches += 1
        s.events += n
        s.last_event_at = time.time()
        self.metrics.events_applied.labels(str(key)).inc(n)
        self.metrics.batches_applied.labels(str(key)).inc()
        st = self.fleet.get(key)
        if st is not None and st.stale:
            st.stale = False
            log.info("instance index rebuilding from new events instance=%s", key)

    def drop(self, key: InstanceKey, reason: str) -> None:
        """The instance's blocks can no longer be trusted: forget them until new events come."""
        self._dropped(key, reason, self.index.drop_instance(key))

    async def adrop(self, key: InstanceKey, reason: str) -> None:
        """``drop`` through the remote: the shared index forgets the blocks and the seq too."""
        if self.remote is None:
            self.drop(key, reason)
        else:
            self._dropped(key, reason, await self.remote.drop(key))

    def _dropped(self, key: InstanceKey, reason: str, n: int) -> None:
        s = self.stats_of(key)
        s.drops += 1
        s.last_problem = reason
        self.pending.drop_instance(key)
        st = self.fleet.get(key)
        if st is not None:
            st.stale = True
        if self.on_drop is not None:
            self.on_drop(key, reason)
        log.warning("instance blocks dropped instance=%s blocks=%d reason=%s", key, n, reason)


class Ingest:
    """One subscriber task per instance; started and stopped as the fleet changes."""

    def __init__(
        self,
        applier: EventApplier,
        replay_timeout_s: float = 2.0,
        subscriber_factory: Callable[..., AsyncEventSubscriber] = AsyncEventSubscriber,
    ) -> None:
        self.applier = applier
        self.replay_timeout_s = replay_timeout_s
        self._factory = subscriber_factory
        self._tasks: dict[InstanceKey, asyncio.Task] = {}
        self._subs: dict[InstanceKey, AsyncEventSubscriber] = {}
        self._ctx: zmq.asyncio.Context | None = None

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    def start(self, st: InstanceState, from_seq: int = 0) -> None:
        """Start following an instance's events (no-op without an events endpoint).

        ``from_seq``: the first seq wanted; the subscriber replays from it before reading live
        (0 rebuilds from the engine's buffer; a shared index resumes after its last seq)."""
        key = st.key
        if key in self._tasks:
            return
        endpoint = st.spec.events_endpoint(key.rank)
        if not endpoint:
            log.warning("no events endpoint instance=%s: routing by load only", key)
            return
        replay = st.spec.replay_endpoint(key.rank)
        self._tasks[key] = asyncio.create_task(
            self._run(key, endpoint, replay, from_seq), name=f"ingest {key}"
        )

    async def stop(self, key: InstanceKey) -> None:
        task = self._tasks.pop(key, None)
        sub = self._subs.pop(key, None)
        await cancel_and_wait(task)
        if sub is not None:
            sub.close()

    def restart(self, st: InstanceState) -> None:
        """Follow the instance again from seq 0 (its replay buffer rebuilds the blocks)."""
        self.stop_soon(st.key)
        self.start(st)

    def stop_soon(self, key: InstanceKey) -> None:
        """From a synchronous fleet callback: stop the task without awaiting it."""
        task = self._tasks.pop(key, None)
        sub = self._subs.pop(key, None)
        if task is not None:
            task.cancel()
        if sub is not None:
            sub.close()

    async def close(self) -> None:
        for key in list(self._tasks):
            await self.stop(key)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def running(self) -> list[InstanceKey]:
        return list(self._tasks)

    async def _run(
        self, key: InstanceKey, endpoint: str, replay: str | None, from_seq: int = 0
    ) -> None:
        backoff = 0.2
        while True:
            try:
                sub = self._factory(
                    endpoint,
                    replay_endpoint=replay,
                    from_seq=from_seq,
                    replay_timeout_s=self.replay_timeout_s,
                    context=self._context(),
                )
            except Exception as e:  # bad endpoint: say so, retry slowly
                log.error("cannot subscribe instance=%s endpoint=%s error=%s", key, endpoint, e)
                await asyncio.sleep(min(backoff, 10.0))
                backoff *= 2
                continue
            self._subs[key] = sub
            log.info(
                "following events instance=%s endpoint=%s replay=%s from_seq=%d",
                key,
                endpoint,
                replay,
                from_seq,
            )
            try:
                while True:
                    item = await sub.recv()
                    if item is not None and not await self.applier.ahandle(key, item):
                        # Fenced: another replica holds the lease now and continues the stream.
                        log.warning("ingest lease lost instance=%s; stopped following", key)
                        if self._tasks.get(key) is asyncio.current_task():
                            del self._tasks[key]
                        return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event stream failed instance=%s; resubscribing", key)
                await self.applier.adrop(key, "event stream failed")
                from_seq = 0  # the blocks are gone: rebuild from the engine's replay buffer
                await asyncio.sleep(min(backoff, 10.0))
                backoff *= 2
            finally:
                self._subs.pop(key, None)
                sub.close()
