"""Token-derived block keys: exact routing for engines whose hashes cannot be reproduced.

When no scheme reproduces an engine's hashes (a random NONE_HASH, an unknown seed; design
§3.2, spec §6.1 - the llm-d approach), the router names that engine's blocks itself: each
BlockStored carries the tokens of its blocks and its parent's engine hash, so the router
chains its *own* scheme's digests through the parents it has seen and keeps a map from the
engine's hash to its key. The translated batch goes to the same index; the prompt side hashes
with the same router scheme (``ParityTracker.key_scheme``), so a prompt matches every such
instance that holds its blocks, whatever each engine's seed.

A chain can only be translated from its block 0 on: blocks whose parent was stored before the
translator started are skipped (counted in ``untranslatable``) until a new chain arrives.
"""

from __future__ import annotations

from collections.abc import Mapping

from events.hashing import HashScheme, normalize_event_hash, to_event_hash
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, is_prefix_group

from .parity import Unreproducible, event_block_extras


class KeyTranslator:
    """Engine hash -> router key for one instance."""

    def __init__(
        self, algo: str = "sha256_cbor", lora_paths: Mapping[str, str] | None = None
    ) -> None:
        self.algo = algo
        self.lora_paths = dict(lora_paths or {})
        self._schemes: dict[int, HashScheme] = {}
        self._digest: dict[int, bytes] = {}  # engine hash -> router digest (for chaining)
        self._extra_refs: dict[int, int] = {}  # engine hash -> refcount when > 1
        self.translated = 0
        self.untranslatable = 0

    def key_scheme(self, block_size: int) -> HashScheme:
        s = self._schemes.get(block_size)
        if s is None:
            s = self._schemes[block_size] = HashScheme(self.algo, None, block_size, "untagged")
        return s

    def __len__(self) -> int:
        return len(self._digest)

    def key_of(self, engine_hash: int) -> int | None:
        d = self._digest.get(normalize_event_hash(engine_hash))
        return None if d is None else to_event_hash(d)

    def translate_batch(self, batch: KVEventBatch) -> KVEventBatch:
        out: list = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if not is_prefix_group(ev):
                    out.append(ev)
                    continue
                t = self._stored(ev)
                if t is not None:
                    out.append(t)
            elif isinstance(ev, BlockRemoved):
                if not is_prefix_group(ev):
                    out.append(ev)
                    continue
                keys = self._removed(ev)
                if keys:
                    out.append(
                        BlockRemoved(keys, ev.medium, ev.group_idx, ev.locality, ev.ownership)
                    )
            elif isinstance(ev, AllBlocksCleared):
                self._digest.clear()
                self._extra_refs.clear()
                out.append(ev)
        return KVEventBatch(batch.ts, out, batch.data_parallel_rank)

    def _stored(self, ev: BlockStored) -> BlockStored | None:
        n = len(ev.block_hashes)
        bs = ev.block_size
        parent: bytes | None = None
        if ev.parent_block_hash is not None:
            parent = self._digest.get(normalize_event_hash(ev.parent_block_hash))
            if parent is None:
                self.untranslatable += n
                return None
        if len(ev.token_ids) != n * bs:
            self.untranslatable += n
            return None
        try:
            extras = event_block_extras(ev, "untagged", self.lora_paths)
        except Unreproducible:
            self.untranslatable += n
            return None
        scheme = self.key_scheme(bs)
        parent_key = None if parent is None else to_event_hash(parent)
        keys = []
        for i, h in enumerate(ev.block_hashes):
            parent = scheme.hash_block(parent, ev.token_ids[i * bs : (i + 1) * bs], extras[i])
            eh = normalize_event_hash(h)
            if eh in self._digest:
                self._extra_refs[eh] = self._extra_refs.get(eh, 1) + 1
            else:
                self._digest[eh] = parent
            keys.append(to_event_hash(parent))
        self.translated += n
        return BlockStored(
            keys,
            parent_key,
            ev.token_ids,
            bs,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
            ev.locality,
            ev.ownership,
            ev.session_id,
            ev.lookahead_token_ids,
        )

    def _removed(self, ev: BlockRemoved) -> list[int]:
        keys = []
        for h in ev.block_hashes:
            eh = normalize_event_hash(h)
            d = self._digest.get(eh)
            if d is None:
                continue
            keys.append(to_event_hash(d))
            c = self._extra_refs.get(eh)
            if c is None:
                del self._digest[eh]
            elif c > 2:
                self._extra_refs[eh] = c - 1
            else:
                del self._extra_refs[eh]
        return keys
