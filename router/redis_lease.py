"""Ingest leases: exactly one router replica applies each instance's event stream.

Each replica subscribes only to the instances whose lease it holds. A lease is a Redis string
``pr:{ns}:lease:<instance>`` set with ``SET NX PX`` to the holder's token and renewed every
``ttl/3``; renew and release are compare-and-set Lua scripts, so a replica can never extend or
delete a lease another one took. When the holder dies its key expires and another replica's
next acquire round takes it: takeover within ``ttl + interval`` (about 4 s with the defaults).

The index's apply script checks the same key (fencing): a replica that lost its lease while
paused cannot apply one more batch on top of its successor's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from router.instance import InstanceKey
from router.redis_state import REDIS_ERRORS, RedisState

log = logging.getLogger("router.redis.lease")

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

LeaseCallback = Callable[[InstanceKey], Awaitable[None] | None]


def lease_key(state: RedisState, inst: InstanceKey | str) -> str:
    return state.prefix + "lease:" + str(inst)


class LeaseManager:
    """Acquires, renews and releases this replica's ingest leases.

    ``run()`` is the loop: each round renews the leases held and tries to take every free one
    in ``wanted()``. ``on_acquired(inst)`` fires when a lease is won (start ingesting: read
    ``RedisIndex.last_seq`` and replay from there), ``on_lost(inst)`` when one could not be
    renewed (stop ingesting that instance at once). While Redis is down held leases are kept
    as they are (the degraded flag is up) and checked on the first round after it returns.
    """

    def __init__(
        self,
        state: RedisState,
        token: str,
        *,
        ttl_ms: int = 3000,
        interval: float | None = None,
        on_acquired: LeaseCallback | None = None,
        on_lost: LeaseCallback | None = None,
    ) -> None:
        self.state = state
        self.token = token
        self.ttl_ms = ttl_ms
        self.interval = interval if interval is not None else ttl_ms / 3000.0
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.held: set[InstanceKey] = set()
        self._renew = state.client.register_script(_RENEW)
        self._release = state.client.register_script(_RELEASE)
        self._stop = asyncio.Event()

    # ---- single operations (each one round trip) -----------------------------------------

    async def try_acquire(self, inst: InstanceKey) -> bool:
        ok = await self.state.client.set(
            lease_key(self.state, inst), self.token, nx=True, px=self.ttl_ms
        )
        return bool(ok)

    async def renew(self, inst: InstanceKey) -> bool:
        res = await self._renew(keys=[lease_key(self.state, inst)], args=[self.token, self.ttl_ms])
        return bool(res)

    async def release(self, inst: InstanceKey) -> bool:
        res = await self._release(keys=[lease_key(self.state, inst)], args=[self.token])
        return bool(res)

    async def holder(self, inst: InstanceKey) -> str | None:
        v = await self.state.client.get(lease_key(self.state, inst))
        return v.decode() if isinstance(v, bytes) else v

    # ---- the loop ------------------------------------------------------------------------

    async def _fire(self, cb: LeaseCallback | None, inst: InstanceKey) -> None:
        if cb is None:
            return
        try:
            res = cb(inst)
            if asyncio.iscoroutine(res):
                await res
        except Exception:  # a callback bug must not stop lease renewal for the others
            log.exception("lease callback failed for %s", inst)

    async def round(self, wanted: Iterable[InstanceKey]) -> None:
        """One pass: renew what we hold, then try to take what nobody holds."""
        wanted = set(wanted)
        try:
            for inst in sorted(self.held):
                if inst not in wanted:
                    await self.release(inst)
                    self.held.discard(inst)
                    await self._fire(self.on_lost, inst)
                elif not await self.renew(inst):
                    log.warning("lease on %s lost to another replica", inst)
                    self.held.discard(inst)
                    await self._fire(self.on_lost, inst)
            for inst in sorted(wanted - self.held):
                if await self.try_acquire(inst):
                    log.info("lease on %s acquired: this replica ingests it", inst)
                    self.held.add(inst)
                    await self._fire(self.on_acquired, inst)
        except REDIS_ERRORS as exc:
            # Keep ingesting what we hold into the local mirror: nobody can write to Redis
            # meanwhile. The first round after Redis answers renews (or, after a restart,
            # finds the key gone, reports the loss and tries to re-acquire); the apply fence
            # stops us should another replica have taken a lease during a partition.
            self.state.failed(exc)

    async def run(self, wanted: Callable[[], Iterable[InstanceKey]]) -> None:
        """Lease loop until ``stop()``; then every held lease is released for a fast handover."""
        try:
            while not self._stop.is_set():
                await self.round(wanted())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval)
        finally:
            await self.release_all()

    def stop(self) -> None:
        self._stop.set()

    async def release_all(self) -> None:
        for inst in sorted(self.held):
            with contextlib.suppress(*REDIS_ERRORS):
                await self.release(inst)
        self.held.clear()
