"""The KV-event model of vLLM 0.33: what an engine says about its prefix cache.

Field names, order and defaults are vLLM's (spec §1.5), because the map layout encodes
fields by name and the array layout by position: keeping the declaration order here is what
lets the codec write either layout and read both.

The classes are msgspec Structs with vLLM's struct options (tagged map events, positional
batch) so that the codec can decode the common case in C, several times faster than building
objects from a generic msgpack tree; everything else about them is plain attribute access.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

Hash = int | bytes

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# Attention kinds whose blocks form a prefix chain the router can match (spec §6.4 step 4).
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks that entered the prefix cache; ``token_ids`` holds all their tokens."""

    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None

    TYPE: ClassVar[str] = "BlockStored"
    # Fields vLLM declares without a default: always on the wire, even when null.
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    )


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks evicted from the cache (vLLM sends one hash per event)."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    TYPE: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium")


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The whole prefix cache was reset; no per-block removals precede it."""

    TYPE: ClassVar[str] = "AllBlocksCleared"
    REQUIRED: ClassVar[tuple[str, ...]] = ()


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type] = {c.TYPE: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published message: the events of one engine step."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = msgspec.field(
        default_factory=list
    )
    data_parallel_rank: int | None = None


def is_prefix_group(ev: BlockStored | BlockRemoved) -> bool:
    """Whether an event belongs to a KV-cache group the router indexes.

    Known main-attention kinds count; sliding-window, Mamba and other kinds do not. When
    the kind is unknown (older engines, BlockRemoved), group 0 or no group counts.
    """
    kind = getattr(ev, "kv_cache_spec_kind", None)
    if kind is not None:
        return kind in PREFIX_KINDS
    return ev.group_idx in (None, 0)
