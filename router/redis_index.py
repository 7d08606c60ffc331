"""The block index in Redis, shared by every router replica (``--index redis://...``).

Same contract and answers as ``MemoryIndex`` (tests/test_redis_index.py runs one set of cases
against both). Key layout (docs/redis.md); ``P`` is ``pr:{<namespace>}:``, whose braces are a
Redis Cluster hash tag, so every key of one namespace (one model's fleet) is in one slot and
each Lua script below may touch any of them:

* ``P ids`` / ``P names`` hashes: instance name <-> small integer id (``P nid`` counter). Ids
  keep the per-block members short; scripts intern names themselves, so clients cache nothing
  that a Redis restart could make wrong.
* ``P b:<hash hex16>`` set: who holds the block. Member ``<id>`` for the GPU, ``<id>:<MEDIUM>``
  for a lower tier. GPU-only sets of small ids are intsets, the most compact set encoding.
* ``P i:<id>:<MEDIUM>`` hash: the instance's reverse record, ``<hash hex16> -> ref count``
  (vLLM may hold one hash twice). It makes ``drop_instance`` and ``instance_hashes`` cheap.
* ``P im:<id>`` set: media the instance has used (for drop).
* ``P seq`` hash: ``<id> -> last applied seq``; written in the same script as the batch, so a
  replica that takes an ingest lease over never applies a batch twice.
* ``P p:<hash hex16>`` hash: pending (predicted) holders ``<id> -> expiry ms``, key TTL'd.
* ``P lease:<instance name>``: ingest lease (router/redis_lease.py), checked by apply (fence).

Hashes travel as one ARGV string of 16-hex-digit chunks: Lua numbers are doubles and cannot
hold a u64, and one long argument is cheaper to build and send than 512 short ones.

Sync or async: the BlockIndex methods are synchronous (the contract, tests, tools) and run on
a blocking client; the router's event loop uses the ``a*`` twins (``amatch``, ``aapply_seq``
...) on the asyncio client, so a Redis round trip never blocks the loop. Both share the pure
argument builders and result parsers below.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from events.hashing import normalize_event_hash
from events.model import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    is_prefix_group,
)
from router.index import ApplyResult, BlockIndex, Match, normalize_medium
from router.instance import InstanceKey
from router.redis_state import REDIS_ERRORS, RedisState

# ---------------------------------------------------------------------------- Lua scripts

_INTERN = """
local function intern(P, name)
  local id = redis.call('HGET', P .. 'ids', name)
  if not id then
    id = tostring(redis.call('INCR', P .. 'nid'))
    redis.call('HSET', P .. 'ids', name, id)
    redis.call('HSET', P .. 'names', id, name)
  end
  return id
end
local function fkey(P, h, m)
  if m == 'GPU' then return P .. 'b:' .. h end
  return P .. 'b:' .. h .. ':' .. m
end
local function unset(k, id)
  redis.call('SETBIT', k, id, 0)
  if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
end
local function drop(P, id)
  local n = 0
  local media = redis.call('SMEMBERS', P .. 'im:' .. id)
  for _, m in ipairs(media) do
    local rev = P .. 'i:' .. id .. ':' .. m
    local hs = redis.call('HKEYS', rev)
    for _, h in ipairs(hs) do unset(fkey(P, h, m), id) end
    n = n + #hs
    redis.call('DEL', rev)
  end
  redis.call('DEL', P .. 'im:' .. id)
  return n
end
local function store(P, id, m, hx)
  local rev = P .. 'i:' .. id .. ':' .. m
  redis.call('SADD', P .. 'im:' .. id, m)
  if m ~= 'GPU' then redis.call('SADD', P .. 'media', m) end
  for i = 1, #hx, 16 do
    local h = string.sub(hx, i, i + 15)
    if redis.call('HINCRBY', rev, h, 1) == 1 then
      redis.call('SETBIT', fkey(P, h, m), id, 1)
    end
  end
end
local function remove(P, id, m, hx)
  local rev = P .. 'i:' .. id .. ':' .. m
  for i = 1, #hx, 16 do
    local h = string.sub(hx, i, i + 15)
    local c = redis.call('HGET', rev, h)
    if c then
      if tonumber(c) <= 1 then
        redis.call('HDEL', rev, h)
        unset(fkey(P, h, m), id)
      else
        redis.call('HINCRBY', rev, h, -1)
      end
    end
  end
end
"""

# KEYS[1] = P..'seq'. ARGV: P, name, seq ('' = none), token ('' = no fence), then triples
# (op, medium, hexes) with op S(tore) R(emove) C(lear). Returns 1 applied, 0 duplicate seq,
# -1 fenced (the lease is not ours).
_APPLY = (
    _INTERN
    + """
local P, name, seq, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if token ~= '' and redis.call('GET', P .. 'lease:' .. name) ~= token then return -1 end
local id = intern(P, name)
if seq ~= '' then
  local last = redis.call('HGET', KEYS[1], id)
  if last and tonumber(last) >= tonumber(seq) then return 0 end
end
for i = 5, #ARGV, 3 do
  local op = ARGV[i]
  if op == 'S' then store(P, id, ARGV[i + 1], ARGV[i + 2])
  elseif op == 'R' then remove(P, id, ARGV[i + 1], ARGV[i + 2])
  elseif op == 'C' then drop(P, id) end
end
if seq ~= '' then redis.call('HSET', KEYS[1], id, seq) end
return 1
"""
)

# KEYS[1] = P..'seq'. ARGV: P, name. Drops the blocks *and* the seq record (engine restart).
_DROP = (
    _INTERN
    + """
local id = redis.call('HGET', ARGV[1] .. 'ids', ARGV[2])
if not id then return 0 end
redis.call('HDEL', KEYS[1], id)
return drop(ARGV[1], id)
"""
)

# KEYS[1] = P..'seq'. ARGV: P, hexes, among ('' = all, else space-separated names),
# pending ('1'/'0'). Holder sets are bitmaps (bit <id>), compared as Lua strings: while the
# same instances continue, a block costs one GET and one (interned) string comparison; only a
# change costs a few byte-wise bit operations. Tracks the GPU run and, per lower tier, the
# run where each block is on the GPU or that tier; stops when no run continues.
# Reply: {#ids, #gpu-pairs, names..., (name idx, run)..., (medium, name idx, run)...}.
_MATCH = """
local P, hx, among, pend = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'
local band, bor, bnot = bit.band, bit.bor, bit.bnot
local byte, char, sub = string.byte, string.char, string.sub
local POW = {128, 64, 32, 16, 8, 4, 2, 1}
-- bitmap strings carry no trailing zero bytes, so equal sets are equal strings
local function pack(t, n)
  while n > 0 and t[n] == 0 do n = n - 1 end
  if n == 0 then return '' end
  return char(unpack(t, 1, n))
end
local function sand(a, b)
  local n = math.min(#a, #b)
  local t = {}
  for i = 1, n do t[i] = band(byte(a, i), byte(b, i)) end
  return pack(t, n)
end
local function sor(a, b)
  if a == '' then return b end
  if b == '' then return a end
  local n = math.max(#a, #b)
  local t = {}
  for i = 1, n do t[i] = bor(byte(a, i) or 0, byte(b, i) or 0) end
  return pack(t, n)
end
local function trim(s)
  local n = #s
  while n > 0 and byte(s, n) == 0 do n = n - 1 end
  return sub(s, 1, n)
end
local function mask(ids)
  local t, n = {}, 0
  for id in pairs(ids) do n = math.max(n, math.floor(id / 8) + 1) end
  for i = 1, n do t[i] = 0 end
  for id in pairs(ids) do
    local i = math.floor(id / 8) + 1
    t[i] = bor(t[i], POW[id % 8 + 1])
  end
  return pack(t, n)
end
-- record run for every bit in old but not in new (old is a superset of new)
local function ended(old, new, run, out)
  for i = 1, #old do
    local x = byte(old, i)
    local y = byte(new, i) or 0
    if x ~= y then
      local d = band(x, bnot(y))
      for j = 1, 8 do
        if band(d, POW[j]) ~= 0 then out[(i - 1) * 8 + j - 1] = run end
      end
    end
  end
end
local function close(s, run, out) ended(s, '', run, out) end
local allow = nil
if among ~= '' then
  local ids = {}
  for name in string.gmatch(among, '%S+') do
    local id = redis.call('HGET', P .. 'ids', name)
    if id then ids[tonumber(id)] = true end
  end
  allow = mask(ids)
end
local now = 0
if pend then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local tiers = redis.call('SMEMBERS', P .. 'media')
local nblocks = #hx / 16
local alive = ''
local talive, truns, runs = {}, {}, {}
for _, m in ipairs(tiers) do truns[m] = {} end
local CH = 64
local chunk, base = {}, -CH
for b = 0, nblocks - 1 do
  if b >= base + CH then
    base = b
    local keys = {}
    for j = b, math.min(b + CH, nblocks) - 1 do
      keys[#keys + 1] = P .. 'b:' .. string.sub(hx, j * 16 + 1, j * 16 + 16)
    end
    chunk = redis.call('MGET', unpack(keys))
  end
  local g = chunk[b - base + 1] or ''
  if pend then
    local p = redis.call('HGETALL', P .. 'p:' .. sub(hx, b * 16 + 1, b * 16 + 16))
    if #p > 0 then
      local ids = {}
      for j = 1, #p, 2 do
        if tonumber(p[j + 1]) > now then ids[tonumber(p[j])] = true end
      end
      g = sor(g, mask(ids))
    end
  end
  if allow then g = sand(g, allow) end
  local any = false
  if b == 0 then
    alive = trim(g)
    any = alive ~= ''
    for _, m in ipairs(tiers) do
      local l = redis.call('GET', P .. 'b:' .. sub(hx, 1, 16) .. ':' .. m) or ''
      if allow then l = sand(l, allow) end
      talive[m] = sor(g, l)
      any = any or talive[m] ~= ''
    end
  else
    if g ~= alive and alive ~= '' then
      local new = sand(alive, g)
      if new ~= alive then
        ended(alive, new, b, runs)
        alive = new
      end
    end
    any = alive ~= ''
    for _, m in ipairs(tiers) do
      local s = talive[m]
      if s ~= '' then
        local l = redis.call('GET', P .. 'b:' .. sub(hx, b * 16 + 1, b * 16 + 16) .. ':' .. m)
        l = l or ''
        if allow then l = sand(l, allow) end
        local u = sor(g, l)
        if u ~= s then
          local new = sand(s, u)
          if new ~= s then
            ended(s, new, b, truns[m])
            talive[m] = new
          end
        end
        any = any or talive[m] ~= ''
      end
    end
  end
  if not any then break end
end
close(alive, nblocks, runs)
for _, m in ipairs(tiers) do close(talive[m] or '', nblocks, truns[m]) end
local ids, idx, out = {}, {}, {}
local function name_of(id)
  if idx[id] == nil then ids[#ids + 1] = tostring(id); idx[id] = #ids end
  return idx[id]
end
for id, r in pairs(runs) do if r > 0 then out[#out + 1] = name_of(id); out[#out + 1] = r end end
local gcount = #out
for med, tr in pairs(truns) do
  for id, r in pairs(tr) do
    if r > (runs[id] or 0) then
      out[#out + 1] = med; out[#out + 1] = name_of(id); out[#out + 1] = r
    end
  end
end
local res = {#ids, gcount}
if #ids > 0 then
  local names = redis.call('HMGET', P .. 'names', unpack(ids))
  for _, n in ipairs(names) do res[#res + 1] = n end
end
for _, v in ipairs(out) do res[#res + 1] = v end
return res
"""

# KEYS[1] = P..'seq'. ARGV: P, name, ttl ms, hexes.
_PENDING = (
    _INTERN
    + """
redis.replicate_commands()
local P, ttl, hx = ARGV[1], tonumber(ARGV[3]), ARGV[4]
local id = intern(P, ARGV[2])
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
for i = 1, #hx, 16 do
  local k = P .. 'p:' .. string.sub(hx, i, i + 15)
  redis.call('HSET', k, id, exp)
  redis.call('PEXPIRE', k, ttl)
end
return #hx / 16
"""
)


# ---------------------------------------------------------------------------- pure helpers


def hexes(hashes: Iterable[int]) -> str:
    """u64 hashes as one string of 16-hex-digit chunks (the scripts' wire form)."""
    hs = hashes if isinstance(hashes, list | tuple) else list(hashes)
    return struct.pack(f">{len(hs)}Q", *hs).hex()


def batch_ops(batch: KVEventBatch) -> tuple[list[str], ApplyResult]:
    """A batch as flat (op, medium, hexes) triples for the apply script, and the result the
    memory index would report for it (same counting rules as ``BlockIndex.apply``)."""
    ops: list[str] = []
    res = ApplyResult()
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            if not is_prefix_group(ev):
                res.ignored += len(ev.block_hashes)
                continue
            hx = hexes(normalize_event_hash(h) for h in ev.block_hashes)
            if isinstance(ev, BlockStored):
                ops += ["S", normalize_medium(ev.medium), hx]
                res.stored += len(ev.block_hashes)
            else:
                ops += ["R", normalize_medium(ev.medium), hx]
                res.removed += len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            ops += ["C", "", ""]
            res.cleared = True
    return ops, res


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_match(raw: list) -> dict[InstanceKey, Match]:
    """The match script's flat reply -> {instance: Match}."""
    nids, gcount = int(raw[0]), int(raw[1])
    names = [InstanceKey.parse(_s(n)) for n in raw[2 : 2 + nids]]
    body = raw[2 + nids :]
    out: dict[InstanceKey, Match] = {}
    for i in range(0, gcount, 2):
        out[names[int(body[i]) - 1]] = Match(int(body[i + 1]))
    for i in range(gcount, len(body), 3):
        inst = names[int(body[i + 1]) - 1]
        m = out.get(inst)
        if m is None:
            m = out[inst] = Match(0)
        if not m.tier_blocks:
            m.tier_blocks = {}
        m.tier_blocks[_s(body[i])] = int(body[i + 2])  # type: ignore[index]
    return out


# ---------------------------------------------------------------------------- the index


class SeqApply:
    """Outcome of ``apply_seq``: ``applied`` False means a duplicate seq or a lost lease."""

    __slots__ = ("applied", "fenced", "result")

    def __init__(self, applied: bool, fenced: bool, result: ApplyResult) -> None:
        self.applied = applied
        self.fenced = fenced
        self.result = result

    def __repr__(self) -> str:
        return f"SeqApply(applied={self.applied}, fenced={self.fenced}, result={self.result})"


class RedisIndex(BlockIndex):
    """BlockIndex on a shared Redis. Errors propagate (``redis.RedisError``/``OSError``):
    ``ResilientIndex`` is the wrapper that turns them into the degraded mode."""

    def __init__(self, state: RedisState | str, *, pending: bool = False) -> None:
        self.state = state if isinstance(state, RedisState) else RedisState(state)
        self.P = self.state.prefix
        self.pending = pending
        self._seq_key = self.P + "seq"
        s, a = self.state.sync, self.state.client
        self._s_apply, self._a_apply = s.register_script(_APPLY), a.register_script(_APPLY)
        self._s_drop, self._a_drop = s.register_script(_DROP), a.register_script(_DROP)
        self._s_match, self._a_match = s.register_script(_MATCH), a.register_script(_MATCH)
        self._s_pend, self._a_pend = s.register_script(_PENDING), a.register_script(_PENDING)

    # ---- argument builders (pure) --------------------------------------------------------

    def _apply_args(self, inst, ops, seq: int | None, token: str | None) -> list:
        return [self.P, str(inst), "" if seq is None else str(seq), token or "", *ops]

    def _match_args(self, hashes, among) -> list:
        names = "" if among is None else " ".join(str(i) for i in among)
        return [self.P, hexes(hashes), names, "1" if self.pending else "0"]

    # ---- BlockIndex (sync) ---------------------------------------------------------------

    def apply(self, inst: InstanceKey, batch: KVEventBatch) -> ApplyResult:
        return self.apply_seq(inst, batch).result

    def apply_seq(
        self,
        inst: InstanceKey,
        batch: KVEventBatch,
        seq: int | None = None,
        token: str | None = None,
    ) -> SeqApply:
        """Apply one batch and record its seq in one atomic script; a seq not above the last
        recorded one is skipped, and with ``token`` the batch is refused unless this replica
        holds the instance's lease."""
        ops, res = batch_ops(batch)
        code = int(
            self._s_apply(keys=[self._seq_key], args=self._apply_args(inst, ops, seq, token))
        )
        return SeqApply(code == 1, code == -1, res if code == 1 else ApplyResult())

    def store(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        self._s_apply(
            keys=[self._seq_key],
            args=self._apply_args(inst, ["S", medium, hexes(hashes)], None, None),
        )

    def remove(self, inst: InstanceKey, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        self._s_apply(
            keys=[self._seq_key],
            args=self._apply_args(inst, ["R", medium, hexes(hashes)], None, None),
        )

    def drop_instance(self, inst: InstanceKey) -> int:
        """Forget the instance's blocks and its last seq (an engine restart starts at 0)."""
        return int(self._s_drop(keys=[self._seq_key], args=[self.P, str(inst)]))

    def match(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        if not hashes:
            return {}
        return parse_match(
            self._s_match(keys=[self._seq_key], args=self._match_args(hashes, among))
        )

    def _iid(self, inst: InstanceKey) -> str | None:
        v = self.state.sync.hget(self.P + "ids", str(inst))
        return None if v is None else _s(v)

    def instance_hashes(self, inst: InstanceKey, medium: str = MEDIUM_GPU) -> dict[int, int]:
        iid = self._iid(inst)
        if iid is None:
            return {}
        raw = self.state.sync.hgetall(f"{self.P}i:{iid}:{medium}")
        return {int(_s(h), 16): int(c) for h, c in raw.items()}

    def instance_media(self, inst: InstanceKey) -> list[str]:
        iid = self._iid(inst)
        if iid is None:
            return []
        return sorted(_s(m) for m in self.state.sync.smembers(f"{self.P}im:{iid}"))

    def last_seq(self, inst: InstanceKey) -> int | None:
        """The last seq applied for the instance: where a new ingester resumes (+1)."""
        iid = self._iid(inst)
        v = None if iid is None else self.state.sync.hget(self._seq_key, iid)
        return None if v is None else int(v)

    def add_pending(self, inst: InstanceKey, hashes: Sequence[int], ttl_ms: int = 2000) -> None:
        """Predicted blocks (just routed there): count as GPU-held for ``ttl_ms`` in match
        when the index was built with ``pending=True``."""
        if hashes:
            self._s_pend(keys=[self._seq_key], args=[self.P, str(inst), ttl_ms, hexes(hashes)])

    def instances(self) -> list[InstanceKey]:
        return sorted(InstanceKey.parse(_s(n)) for n in self.state.sync.hkeys(self.P + "ids"))

    def stats(self) -> dict:
        r = self.state.sync
        ids = {_s(k): _s(v) for k, v in r.hgetall(self.P + "ids").items()}
        media_of = {iid: [_s(m) for m in r.smembers(f"{self.P}im:{iid}")] for iid in ids.values()}
        pipe = r.pipeline(transaction=False)
        pairs = [(iid, m) for iid, ms in media_of.items() for m in ms]
        for iid, m in pairs:
            pipe.hlen(f"{self.P}i:{iid}:{m}")
        lens = pipe.execute() if pairs else []
        per_medium: dict[str, dict[str, int]] = {}
        live = 0
        for (_, m), n in zip(pairs, lens, strict=True):
            per_medium.setdefault(m, {"entries": 0})["entries"] += int(n)
            live += 1 if n else 0
        mem = r.info("memory").get("used_memory", 0)
        return {
            "entries": sum(d["entries"] for d in per_medium.values()),
            "instances": len([i for i, ms in media_of.items() if ms]),
            "known_instances": len(ids),
            "redis_used_memory": int(mem),
            "media": per_medium,
        }

    # ---- asyncio twins (what the router's event loop calls) ------------------------------

    async def aapply_seq(
        self,
        inst: InstanceKey,
        batch: KVEventBatch,
        seq: int | None = None,
        token: str | None = None,
    ) -> SeqApply:
        ops, res = batch_ops(batch)
        code = int(
            await self._a_apply(keys=[self._seq_key], args=self._apply_args(inst, ops, seq, token))
        )
        return SeqApply(code == 1, code == -1, res if code == 1 else ApplyResult())

    async def aapply_many(
        self,
        inst: InstanceKey,
        items: Sequence[tuple[int | None, KVEventBatch]],
        token: str | None = None,
    ) -> list[SeqApply]:
        """Several batches in one pipelined round trip (what ingest sends when it has fallen
        behind); each batch is still its own atomic apply+seq script."""
        if not items:
            return []
        prepared = [batch_ops(b) for _, b in items]
        pipe = self.state.client.pipeline(transaction=False)
        for (seq, _), (ops, _) in zip(items, prepared, strict=True):
            await self._a_apply(
                keys=[self._seq_key], args=self._apply_args(inst, ops, seq, token), client=pipe
            )
        codes = await pipe.execute()
        return [
            SeqApply(int(c) == 1, int(c) == -1, res if int(c) == 1 else ApplyResult())
            for c, (_, res) in zip(codes, prepared, strict=True)
        ]

    async def adrop_instance(self, inst: InstanceKey) -> int:
        return int(await self._a_drop(keys=[self._seq_key], args=[self.P, str(inst)]))

    async def amatch(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        if not hashes:
            return {}
        raw = await self._a_match(keys=[self._seq_key], args=self._match_args(hashes, among))
        return parse_match(raw)

    async def alast_seq(self, inst: InstanceKey) -> int | None:
        c = self.state.client
        iid = await c.hget(self.P + "ids", str(inst))
        v = None if iid is None else await c.hget(self._seq_key, _s(iid))
        return None if v is None else int(v)

    async def aadd_pending(
        self, inst: InstanceKey, hashes: Sequence[int], ttl_ms: int = 2000
    ) -> None:
        if hashes:
            await self._a_pend(
                keys=[self._seq_key], args=[self.P, str(inst), ttl_ms, hexes(hashes)]
            )

    async def arefill(
        self, inst: InstanceKey, source: BlockIndex, seq: int | None, chunk: int = 4096
    ) -> int:
        """Reset the instance in Redis and copy it from a local index (the ingester's mirror),
        ref counts included, then record ``seq``: the "reset and refill" after Redis lost its
        data. Chunked so no single script blocks Redis for long."""
        await self.adrop_instance(inst)
        media = getattr(source, "instance_blocks", None)
        names = list(media(inst)) if media else [MEDIUM_GPU]
        n = 0
        for medium in names:
            refs = source.instance_hashes(inst, medium)
            flat = [h for h, c in refs.items() for _ in range(c)]
            for i in range(0, len(flat), chunk):
                part = flat[i : i + chunk]
                await self._a_apply(
                    keys=[self._seq_key],
                    args=self._apply_args(inst, ["S", medium, hexes(part)], None, None),
                )
            n += len(refs)
        if seq is not None:
            await self._a_apply(keys=[self._seq_key], args=self._apply_args(inst, [], seq, None))
        return n


class SharedIndex:
    """The router's face of the Redis index: never raises, falls back to a local view.

    ``mirror`` is a local index of the instances *this* replica ingests (it holds their
    leases): every batch goes there first, then to Redis. While Redis is down, ``match``
    answers from the mirror (a partial but exact view; ``{}`` without one, i.e. load-only
    routing) and applies only reach the mirror. When Redis answers again the instances that
    missed batches (all of them if Redis lost its data) are reset and refilled from the
    mirror, with their seq, before the degraded flag clears.
    """

    def __init__(self, index: RedisIndex, mirror: BlockIndex | None = None) -> None:
        self.index = index
        self.state = index.state
        self.mirror = mirror
        self.seqs: dict[InstanceKey, int | None] = {}
        self.dirty: set[InstanceKey] = set()
        self.state.on_recovered(self._rebuild)

    async def match(
        self, hashes: Sequence[int], among: Collection[InstanceKey] | None = None
    ) -> dict[InstanceKey, Match]:
        if not self.state.degraded:
            try:
                return await self.index.amatch(hashes, among)
            except REDIS_ERRORS as exc:
                self.state.failed(exc)
        return {} if self.mirror is None else self.mirror.match(hashes, among)

    async def apply(
        self,
        inst: InstanceKey,
        batch: KVEventBatch,
        seq: int | None = None,
        token: str | None = None,
    ) -> SeqApply | None:
        """Mirror, then Redis (atomic with seq and lease fence). None: Redis is down, the
        batch is in the mirror only and the instance will be refilled on recovery."""
        if self.mirror is not None:
            self.mirror.apply(inst, batch)
        self.seqs[inst] = seq
        if self.state.degraded:
            self.dirty.add(inst)
            return None
        try:
            if inst in self.dirty:
                # Missed by the recovery (a batch that came while it finished): copy the
                # instance over now; the copy includes this batch and records its seq.
                await self._refill(inst)
                return SeqApply(True, False, ApplyResult())
            return await self.index.aapply_seq(inst, batch, seq, token)
        except REDIS_ERRORS as exc:
            self.dirty.add(inst)
            self.state.failed(exc)
            return None

    async def drop_instance(self, inst: InstanceKey) -> None:
        """Engine restart or lost trust: forget it here and in Redis (seq too)."""
        if self.mirror is not None:
            self.mirror.drop_instance(inst)
        self.seqs.pop(inst, None)
        try:
            await self.index.adrop_instance(inst)
        except REDIS_ERRORS as exc:
            self.dirty.add(inst)
            self.state.failed(exc)

    def forget(self, inst: InstanceKey) -> None:
        """The lease went to another replica: stop mirroring the instance (Redis untouched)."""
        if self.mirror is not None:
            self.mirror.drop_instance(inst)
        self.seqs.pop(inst, None)
        self.dirty.discard(inst)

    async def _rebuild(self, lost: bool) -> None:
        todo = set(self.seqs) if lost else set(self.dirty)
        for inst in sorted(todo):
            await self._refill(inst)

    async def _refill(self, inst: InstanceKey) -> None:
        if self.mirror is not None:
            # Ingest keeps filling the mirror while the refill awaits Redis; a batch that
            # lands meanwhile may miss the copy, so refill again until the seq holds still.
            for _ in range(10):
                seq = self.seqs.get(inst)
                await self.index.arefill(inst, self.mirror, seq)
                if self.seqs.get(inst) == seq:
                    break
        else:
            await self.index.adrop_instance(inst)
        self.dirty.discard(inst)
