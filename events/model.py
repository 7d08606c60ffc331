"""The KV-event model of vLLM 0.33: what an engine says about its prefix cache.

Field names, order and defaults are vLLM's (spec §1.5), because the map layout encodes
fields by name and the array layout by position: keeping the declaration order here is what
lets the codec write either layout and read both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

Hash = Union[int, bytes]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# Attention kinds whose blocks form a prefix chain the router can match (spec §6.4 step 4).
PREFIX_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})


@dataclass(slots=True)
class BlockStored:
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


@dataclass(slots=True)
class BlockRemoved:
    """Blocks evicted from the cache (vLLM sends one hash per event)."""

    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    TYPE: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium")


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset; no per-block removals precede it."""

    TYPE: ClassVar[str] = "AllBlocksCleared"
    REQUIRED: ClassVar[tuple[str, ...]] = ()


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES: dict[str, type] = {c.TYPE: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


@dataclass(slots=True)
class KVEventBatch:
    """One published message: the events of one engine step."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
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
