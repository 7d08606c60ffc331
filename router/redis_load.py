"""Load shared by router replicas: in-flight requests and queued tokens per instance.

Each replica publishes *its own* absolute counts, never increments: field
``<replica>|<instance>|r`` (requests) and ``|t`` (queued tokens) of the hash ``pr:{ns}:load``,
plus its heartbeat time in the sorted set ``pr:{ns}:replicas``. Readers sum the fields of live
replicas (heartbeat newer than ``ttl``) in one Lua call and delete the fields of dead ones, so
a crashed replica's counts drain within ``ttl`` with nobody having to decrement for it.

Why absolute values rather than HINCRBY on forward and completion: a lost decrement (a timeout
after the server applied it, a replica killed between the two) would leave a count wrong
forever, and after a Redis restart the counts would start from zero while requests are in
flight. Writing the absolute value is idempotent, and the heartbeat rewrites every count, so
the shared view converges to the truth after any failure.

The local counts stay the source of truth for this replica: while Redis is down, ``totals()``
answers with them (the degraded, best-effort view the issue asks for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.instance import InstanceKey
from router.redis_state import REDIS_ERRORS, RedisState

log = logging.getLogger("router.redis.load")

# KEYS[1] load hash, KEYS[2] replicas zset; ARGV[1] ttl ms. Uses the server clock, so replica
# clocks need not agree. Returns a flat list: instance, requests, tokens, ...
_READ = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. cutoff)
local alive = {}
for _, r in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do alive[r] = true end
local all = redis.call('HGETALL', KEYS[1])
local req, tok, order, drop = {}, {}, {}, {}
for i = 1, #all, 2 do
  local f = all[i]
  local rep, inst, kind = string.match(f, '^(.-)|(.*)|([rt])$')
  if rep == nil or not alive[rep] then
    drop[#drop + 1] = f
  else
    if req[inst] == nil then req[inst] = 0; tok[inst] = 0; order[#order + 1] = inst end
    local v = tonumber(all[i + 1]) or 0
    if kind == 'r' then req[inst] = req[inst] + v else tok[inst] = tok[inst] + v end
  end
end
for i = 1, #drop, 500 do
  redis.call('HDEL', KEYS[1], unpack(drop, i, math.min(i + 499, #drop)))
end
local out = {}
for _, inst in ipairs(order) do
  out[#out + 1] = inst; out[#out + 1] = req[inst]; out[#out + 1] = tok[inst]
end
return out
"""

# KEYS[1] load hash, KEYS[2] replicas zset; ARGV[1] replica; ARGV[2..] field, value pairs.
_PUBLISH = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now, ARGV[1])
if #ARGV > 1 then redis.call('HSET', KEYS[1], unpack(ARGV, 2)) end
return now
"""


@dataclass(frozen=True, slots=True)
class Load:
    in_flight: int = 0
    queued_tokens: int = 0


class SharedLoad:
    """This replica's load counts, mirrored to Redis, and the fleet-wide sums read back.

    ``add`` / ``sub`` are synchronous (called from the proxy's request path; they never touch
    the network) and mark the instance dirty; ``flush()`` writes the dirty counts in one round
    trip, ``totals()`` reads the sums in one. ``run()`` heartbeats: full rewrite every
    ``heartbeat`` seconds, dirty counts every ``flush_interval``.
    """

    def __init__(
        self,
        state: RedisState,
        replica: str,
        *,
        ttl_ms: int = 10_000,
        heartbeat: float = 2.0,
        flush_interval: float = 0.005,
    ) -> None:
        if "|" in replica:
            raise ValueError("replica id must not contain '|'")
        self.state = state
        self.replica = replica
        self.ttl_ms = ttl_ms
        self.heartbeat = heartbeat
        self.flush_interval = flush_interval
        self.local: dict[InstanceKey, list[int]] = {}
        self._dirty: set[InstanceKey] = set()
        self._wake = asyncio.Event()
        self._stop = False
        self._load_key = state.prefix + "load"
        self._replicas_key = state.prefix + "replicas"
        self._read = state.client.register_script(_READ)
        self._publish = state.client.register_script(_PUBLISH)
        self._last_full = 0.0
        state.on_recovered(self._on_recovered)

    # ---- local counts (no I/O) -----------------------------------------------------------

    def add(self, inst: InstanceKey, requests: int = 1, tokens: int = 0) -> None:
        c = self.local.setdefault(inst, [0, 0])
        c[0] += requests
        c[1] += tokens
        self._dirty.add(inst)
        self._wake.set()

    def sub(self, inst: InstanceKey, requests: int = 1, tokens: int = 0) -> None:
        c = self.local.setdefault(inst, [0, 0])
        c[0] = max(0, c[0] - requests)
        c[1] = max(0, c[1] - tokens)
        self._dirty.add(inst)
        self._wake.set()

    def local_totals(self) -> dict[InstanceKey, Load]:
        return {k: Load(v[0], v[1]) for k, v in self.local.items()}

    # ---- Redis ---------------------------------------------------------------------------

    def _fields(self, insts) -> list:
        out: list = []
        for inst in insts:
            r, t = self.local.get(inst, (0, 0))
            out += [f"{self.replica}|{inst}|r", r, f"{self.replica}|{inst}|t", t]
        return out

    async def flush(self, full: bool = False) -> bool:
        """Publish dirty counts (all counts when ``full``) and the heartbeat; False if Redis
        is down (the counts stay dirty and go out with the next successful flush)."""
        insts = list(self.local) if full else list(self._dirty)
        self._dirty.clear()
        try:
            await self._publish(
                keys=[self._load_key, self._replicas_key],
                args=[self.replica, *self._fields(insts)],
            )
        except REDIS_ERRORS as exc:
            self._dirty.update(insts)
            self.state.failed(exc)
            return False
        if full:
            self._last_full = time.monotonic()
        return True

    async def totals(self) -> dict[InstanceKey, Load]:
        """Fleet-wide load per instance (all live replicas); the local view if Redis is down."""
        if self.state.degraded:
            return self.local_totals()
        try:
            flat = await self._read(keys=[self._load_key, self._replicas_key], args=[self.ttl_ms])
        except REDIS_ERRORS as exc:
            self.state.failed(exc)
            return self.local_totals()
        out: dict[InstanceKey, Load] = {}
        for i in range(0, len(flat), 3):
            name = flat[i].decode() if isinstance(flat[i], bytes) else flat[i]
            out[InstanceKey.parse(name)] = Load(int(flat[i + 1]), int(flat[i + 2]))
        return out

    async def _on_recovered(self, lost: bool) -> None:
        # A restarted Redis has no counts at all: rewrite ours in full (raises if still down).
        await self._publish(
            keys=[self._load_key, self._replicas_key],
            args=[self.replica, *self._fields(list(self.local))],
        )
        self._dirty.clear()

    async def run(self, periodic: Callable[[], None] | None = None) -> None:
        """Flush loop until ``stop()``; on stop this replica's fields are removed."""
        try:
            while not self._stop:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.heartbeat)
                self._wake.clear()
                if self._stop:
                    break
                due = time.monotonic() - self._last_full >= self.heartbeat
                if not self.state.degraded:
                    await self.flush(full=due)
                if periodic is not None:
                    periodic()
                await asyncio.sleep(self.flush_interval)  # batch a burst of changes
        finally:
            await self.withdraw()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    async def withdraw(self) -> None:
        """Remove this replica's counts at once (clean shutdown); a crash relies on the ttl."""
        fields = [f"{self.replica}|{inst}|{k}" for inst in self.local for k in "rt"]
        with contextlib.suppress(*REDIS_ERRORS):
            pipe = self.state.client.pipeline(transaction=True)
            if fields:
                pipe.hdel(self._load_key, *fields)
            pipe.zrem(self._replicas_key, self.replica)
            await pipe.execute()
