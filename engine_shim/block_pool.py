"""The block pool: physical KV blocks, the LRU free queue, the hash map and the event queue.

It follows vLLM 0.33's rules (../shared/seeds, spec §4) because the router can only predict
an engine whose eviction order and events match the real one:

* block 0 is the null block and never handed out;
* one free queue; the front is evicted first. Freed blocks without a hash go to the front
  (they can never hit), blocks with a hash to the back (LRU);
* popping a block that still has a hash evicts that hash (one BlockRemoved per hash);
* identical content cached twice stays twice (duplicates), each with its own events;
* a reset fails while any block is in use, and emits AllBlocksCleared when it succeeds.

Only one KV-cache group (full attention) exists here, so the hash map is keyed by the digest.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from events.hashing import HashScheme, block_extra_keys, event_extra_keys, to_event_hash
from events.model import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from engine_shim.request import Request

GROUP_IDX = 0


class KVCacheBlock:
    """One physical block; while free it is also a node of the free queue."""

    __slots__ = ("block_hash", "block_id", "is_null", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.is_null = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks with sentinels: O(1) pop, append and remove-from-middle.

    The middle removal is what makes touching a hit block cheap; a deque could not do it.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def _link_after(self, prev: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        nxt = prev.next_free
        assert nxt is not None
        n = 0
        for b in blocks:
            b.prev_free = prev
            prev.next_free = b
            prev = b
            n += 1
        prev.next_free = nxt
        nxt.prev_free = prev
        self.num_free_blocks += n

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, {self.num_free_blocks} free")
        out = []
        cur = self.head.next_free
        for _ in range(n):
            assert cur is not None and cur is not self.tail
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        assert cur is not None
        self.head.next_free = cur
        cur.prev_free = self.head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        prev = self.tail.prev_free
        assert prev is not None
        self._link_after(prev, blocks)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the front, keeping their order (the first is evicted first)."""
        self._link_after(self.head, blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        cur = self.head.next_free
        while cur is not None and cur is not self.tail:
            yield cur
            cur = cur.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    """Allocates, frees, caches and evicts blocks; queues the KV events that this causes."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        scheme: HashScheme,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = True,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.scheme = scheme
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # digest -> {block_id: block}; insertion order decides which duplicate a hit gets.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.kv_event_queue: list[KVEvent] = []

    # -- lookup and caching ---------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self, request: Request, blocks: Sequence[KVCacheBlock], num_cached: int, num_full: int
    ) -> None:
        """Give blocks [num_cached, num_full) of a request their hash and announce them."""
        if num_cached >= num_full:
            return
        hashes = request.block_hashes
        new_ints: list[int] = []
        for i in range(num_cached, num_full):
            blk = blocks[i]
            if blk.is_null:
                continue
            digest = hashes[i]
            assert blk.block_hash is None, f"{blk} already cached"
            blk.block_hash = digest
            self.cached_block_hash_to_block.setdefault(digest, {})[blk.block_id] = blk
            new_ints.append(to_event_hash(digest))
        if self.enable_kv_cache_events:
            parent = to_event_hash(hashes[num_cached - 1]) if num_cached > 0 else None
            self.kv_event_queue.append(
                self._stored_event(request, new_ints, parent, num_cached, num_full)
            )

    def emit_cached_block_events(self, request: Request, num_hit_blocks: int) -> None:
        """Re-announce a request's hit blocks as BlockStored (kv_cache_report_mode=full)."""
        if not self.enable_kv_cache_events or num_hit_blocks == 0:
            return
        ints = [to_event_hash(h) for h in request.block_hashes[:num_hit_blocks]]
        self.kv_event_queue.append(self._stored_event(request, ints, None, 0, num_hit_blocks))

    def _stored_event(
        self, request: Request, hashes: list[int], parent: int | None, start: int, end: int
    ) -> BlockStored:
        bs = self.block_size
        style = self.scheme.extra_key_style
        extra = [
            event_extra_keys(block_extra_keys(i, style, request.cache_salt, request.lora))
            for i in range(start, end)
        ]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=request.all_token_ids[start * bs : end * bs],
            block_size=bs,
            lora_id=request.lora_int_id if request.lora_name else None,
            medium=self.medium,
            lora_name=request.lora_name,
            extra_keys=extra,
            group_idx=GROUP_IDX,
        )

    # -- allocation -----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks from the front of the free queue, evicting any hash they still carry."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        out = self.free_block_queue.popleft_n(num_blocks)
        for blk in out:
            if self.enable_caching:
                self._maybe_evict(blk)
            assert blk.ref_cnt == 0
            blk.ref_cnt = 1
        return out

    def _maybe_evict(self, blk: KVCacheBlock) -> bool:
        digest = blk.block_hash
        if digest is None:
            return False
        blk.block_hash = None
        same = self.cached_block_hash_to_block.get(digest)
        if same is None or same.pop(blk.block_id, None) is None:
            return False
        if not same:
            del self.cached_block_hash_to_block[digest]
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[to_event_hash(digest)], medium=self.medium, group_idx=GROUP_IDX
                )
            )
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take hit blocks into use: out of the free queue if idle, ref count up."""
        for blk in blocks:
            if blk.is_null:
                continue
            if blk.ref_cnt == 0:
                self.free_block_queue.remove(blk)
            blk.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release blocks, first = evicted first: unhashed to the front, hashed to the back."""
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        for blk in ordered_blocks:
            if blk.is_null:
                continue
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None or not self.enable_caching:
                    first.append(blk)
                else:
                    last.append(blk)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:  # the null block
            return False
        self.cached_block_hash_to_block = {}
        for blk in self.blocks:
            blk.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- observation ----------------------------------------------------------------------

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total else 0.0

    def cached_event_hashes(self) -> list[int]:
        """One u64 per cached block (duplicates included): the index truth for router tests."""
        return [
            to_event_hash(d)
            for d, blocks in self.cached_block_hash_to_block.items()
            for _ in blocks
        ]

    def take_events(self) -> list[KVEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
