"""KVCacheManager: the prefix-cache decisions of one engine, with vLLM 0.33's names and rules.

The scheduler asks it two things per admission: how much of a prompt is already cached
(``get_computed_blocks``) and whether the rest fits (``allocate_slots``). Both follow the
seeds exactly (lookup stops at the first miss and never covers the last token; touch before
pop; blocks are hashed the moment they become full), so a trace recorded from vLLM's own
manager replays step for step against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_shim.block_pool import BlockPool, KVCacheBlock
from engine_shim.request import Request, RequestBlockHasher
from events.hashing import HashScheme
from events.model import BlockStored, KVEvent

KV_CACHE_SPEC_KIND = "full_attention"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Token counts since the last ``make_prefix_cache_stats`` (vLLM's PrefixCacheStats)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """One full-attention KV-cache group over a BlockPool."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int = 16,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | None = None,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = True,
        *,
        max_model_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.max_model_len = max_model_len
        self.scheme = HashScheme(algo=hash_algo, seed=hash_seed, block_size=block_size)
        self.block_hasher = RequestBlockHasher(self.scheme)
        self.block_pool = BlockPool(
            num_gpu_blocks,
            block_size,
            self.scheme,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's blocks already carry their hash.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Lifetime totals, for /metrics counters.
        self.total_queries = 0
        self.total_hits = 0

    # -- lookup ---------------------------------------------------------------------------

    def _ensure_hasher(self, request: Request) -> None:
        if self.enable_caching and not request.has_block_hasher:
            request.set_block_hasher(self.block_hasher)

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix in whole blocks, capped at num_tokens - 1 tokens."""
        self._ensure_hasher(request)
        if not self.prefix_cache_lookup_enabled(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            blk = pool.get_cached_block(h)
            if blk is None:
                break
            hits.append(blk)
        if hits and request.kv_cache_report_mode == "full":
            pool.emit_cached_block_events(request, len(hits))
        return hits, len(hits) * self.block_size

    # -- allocation -----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens; None when they don't fit.

        An admission fits only if its new blocks plus its idle hit blocks (which touching
        takes out of the free queue) fit in the free queue.
        """
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be positive when no hit is adopted")
        self._ensure_hasher(request)
        rid = request.request_id
        hit_blocks = new_computed_blocks or []
        pool = self.block_pool
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_local_computed + num_new_tokens
        if self.max_model_len is not None:
            num_slots = min(num_slots, self.max_model_len)
        held = self.req_to_blocks.get(rid, [])
        num_required = cdiv(num_slots, self.block_size)
        num_new_blocks = max(num_required - len(held) - len(hit_blocks), 0)
        num_evictable = sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)
        if num_new_blocks + num_evictable > pool.get_num_free_blocks():
            return None

        req_blocks = self.req_to_blocks.setdefault(rid, held)
        if hit_blocks:
            pool.touch(hit_blocks)
            req_blocks.extend(hit_blocks)
            self.num_cached_block[rid] = len(req_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            self._cache_blocks(request, min(num_slots, request.num_tokens))
        return new_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed = len(request.block_hashes) * self.block_size
        num_full = min(num_tokens, num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request | str) -> None:
        """Release a finished, aborted or preempted request's blocks, tail first."""
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, [])
        self.num_cached_block.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    # -- stats and events -----------------------------------------------------------------

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admission's lookup (queries = all its tokens, hits = hit tokens)."""
        if not self.prefix_cache_lookup_enabled(request):
            return
        preempted = request.num_preemptions > 0
        self.prefix_cache_stats.record(request.num_tokens, num_hits, preempted)
        if not preempted:
            self.total_queries += request.num_tokens
            self.total_hits += num_hits

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVEvent]:
        events = self.block_pool.take_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                ev.kv_cache_spec_kind = KV_CACHE_SPEC_KIND
        return events

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
