"""msgpack codec for vLLM KV-event batches, every layout from vLLM 0.11 to 0.33.

Decoding is tolerant the way the spec's "robust decoder rule" says (§1.6): map events are
read by name, array events by position, unknown keys and trailing elements are ignored, and
hashes are normalised to unsigned 64-bit ints (signed int64 reinterpreted, digest bytes cut
to their last 8 bytes). Everything that goes wrong surfaces as ``CodecError`` with a reason,
so the subscriber can count a bad frame and carry on instead of dying on a KeyError.

Encoding writes what vLLM 0.33's msgspec encoder writes, byte for byte: a positional outer
array, map events with "type" first, optional fields omitted when None, and a map16 header
for BlockStored (msgspec sizes the header by the number of declared keys, not present ones).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgpack
import msgspec

from events.model import (
    EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Hash,
    KVEvent,
    KVEventBatch,
)

U64_MASK = (1 << 64) - 1
Layout = Literal["map", "array"]


class CodecError(ValueError):
    """A payload that is not a valid KV-event batch; the message says why."""


# Declared field names per event type, in vLLM's declaration order (positional layout).
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: cls.__struct_fields__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}
_HASH_FIELDS = ("block_hashes", "parent_block_hash")


# --------------------------------------------------------------------------------------
# Decoding


def _hash(v: Any, keep_bytes: bool, what: str) -> Hash:
    if type(v) is int:
        if -(1 << 63) <= v <= U64_MASK:
            return v & U64_MASK
        raise CodecError(f"{what}: integer hash {v} does not fit in 64 bits")
    if isinstance(v, bytes):
        if not v:
            raise CodecError(f"{what}: empty bytes hash")
        return v if keep_bytes else int.from_bytes(v[-8:], "big")
    raise CodecError(f"{what}: hash must be int or bytes, got {type(v).__name__}")


def _hash_list(v: Any, keep_bytes: bool, what: str) -> list[Hash]:
    if not isinstance(v, list):
        raise CodecError(f"{what}: expected a list of hashes, got {type(v).__name__}")
    # Fast path: the common case is a list of non-negative u64 ints.
    try:
        if v and min(v) >= 0 and max(v) <= U64_MASK and all(type(h) is int for h in v):
            return v
    except TypeError:
        pass
    return [_hash(h, keep_bytes, what) for h in v]


def _check_int(v: Any, what: str, optional: bool = True) -> None:
    if v is None and optional:
        return
    if type(v) is not int:
        raise CodecError(f"{what}: expected an int, got {type(v).__name__}")


def _check_str(v: Any, what: str) -> None:
    if v is not None and not isinstance(v, str):
        raise CodecError(f"{what}: expected a string, got {type(v).__name__}")


def _build_stored(d: dict[str, Any], keep_bytes: bool) -> BlockStored:
    for name in ("block_hashes", "token_ids", "block_size"):
        if name not in d:
            raise CodecError(f"BlockStored: missing field {name!r}")
    hashes = _hash_list(d["block_hashes"], keep_bytes, "BlockStored.block_hashes")
    parent = d.get("parent_block_hash")
    if parent is not None:
        parent = _hash(parent, keep_bytes, "BlockStored.parent_block_hash")
    toks = d["token_ids"]
    if not isinstance(toks, list):
        raise CodecError("BlockStored.token_ids: expected a list")
    _check_int(d["block_size"], "BlockStored.block_size", optional=False)
    if d["block_size"] <= 0:
        raise CodecError(f"BlockStored.block_size: must be positive, got {d['block_size']}")
    _check_int(d.get("lora_id"), "BlockStored.lora_id")
    _check_int(d.get("group_idx"), "BlockStored.group_idx")
    _check_int(d.get("kv_cache_spec_sliding_window"), "BlockStored.kv_cache_spec_sliding_window")
    for name in (
        "medium",
        "lora_name",
        "kv_cache_spec_kind",
        "locality",
        "ownership",
        "session_id",
    ):
        _check_str(d.get(name), f"BlockStored.{name}")
    extra = d.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise CodecError("BlockStored.extra_keys: expected a list or null")
    look = d.get("lookahead_token_ids")
    if look is not None and not isinstance(look, list):
        raise CodecError("BlockStored.lookahead_token_ids: expected a list or null")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=toks,
        block_size=d["block_size"],
        lora_id=d.get("lora_id"),
        medium=d.get("medium"),
        lora_name=d.get("lora_name"),
        extra_keys=extra,
        group_idx=d.get("group_idx"),
        kv_cache_spec_kind=d.get("kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=d.get("kv_cache_spec_sliding_window"),
        locality=d.get("locality"),
        ownership=d.get("ownership"),
        session_id=d.get("session_id"),
        lookahead_token_ids=look,
    )


_STR_OR_NONE = (str, type(None))
_INT_OR_NONE = (int, type(None))


def _build_removed(d: dict[str, Any], keep_bytes: bool) -> BlockRemoved:
    # Fast path for what vLLM sends (one u64 per event, a few short fields): this is the
    # event type an engine under eviction pressure sends most, one per evicted block.
    hashes = d.get("block_hashes")
    medium = d.get("medium")
    group = d.get("group_idx")
    locality = d.get("locality")
    ownership = d.get("ownership")
    if (
        type(hashes) is list
        and len(hashes) == 1
        and type(hashes[0]) is int
        and 0 <= hashes[0] <= U64_MASK
        and isinstance(medium, _STR_OR_NONE)
        and isinstance(group, _INT_OR_NONE)
        and type(group) is not bool
        and isinstance(locality, _STR_OR_NONE)
        and isinstance(ownership, _STR_OR_NONE)
    ):
        return BlockRemoved(hashes, medium, group, locality, ownership)
    if "block_hashes" not in d:
        raise CodecError("BlockRemoved: missing field 'block_hashes'")
    _check_int(d.get("group_idx"), "BlockRemoved.group_idx")
    for name in ("medium", "locality", "ownership"):
        _check_str(d.get(name), f"BlockRemoved.{name}")
    return BlockRemoved(
        block_hashes=_hash_list(d["block_hashes"], keep_bytes, "BlockRemoved.block_hashes"),
        medium=d.get("medium"),
        group_idx=d.get("group_idx"),
        locality=d.get("locality"),
        ownership=d.get("ownership"),
    )


def _decode_event(raw: Any, keep_bytes: bool) -> KVEvent:
    if isinstance(raw, dict):
        tag = raw.get("type")
        d = raw
    elif isinstance(raw, list):
        if not raw:
            raise CodecError("event: empty array")
        tag = raw[0]
        cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise CodecError(f"event: unknown type tag {tag!r}")
        names = _FIELDS[cls]
        d = dict(zip(names, raw[1 : 1 + len(names)], strict=False))
    else:
        raise CodecError(f"event: expected a map or an array, got {type(raw).__name__}")
    if tag == "BlockStored":
        return _build_stored(d, keep_bytes)
    if tag == "BlockRemoved":
        return _build_removed(d, keep_bytes)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise CodecError(f"event: unknown type {tag!r}")


_FAST_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _normalized(hashes: list[Hash], keep_bytes: bool, what: str) -> list[Hash]:
    for h in hashes:
        if type(h) is not int or h < 0:
            return [_hash(x, keep_bytes, what) for x in hashes]
    return hashes


def _fast_decode(payload: bytes, keep_bytes: bool) -> KVEventBatch | None:
    """The map layout of vLLM >= 0.24, decoded and type-checked in C; None if it doesn't fit.

    Anything unusual (array events, odd types, unknown event types) falls through to the
    tolerant generic path, which also produces the precise error message.
    """
    if not payload or not 0x92 <= payload[0] <= 0x9F:  # [ts, events, ...] as a fixarray
        return None
    try:
        batch = _FAST_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for ev in batch.events:
        if type(ev) is AllBlocksCleared:
            continue
        hashes = ev.block_hashes
        if len(hashes) == 1:
            h = hashes[0]
            if type(h) is not int or h < 0:
                ev.block_hashes = [_hash(h, keep_bytes, f"{ev.TYPE}.block_hashes")]
        else:
            ev.block_hashes = _normalized(hashes, keep_bytes, f"{ev.TYPE}.block_hashes")
        if type(ev) is BlockStored:
            if ev.block_size <= 0:
                raise CodecError(f"BlockStored.block_size: must be positive, got {ev.block_size}")
            p = ev.parent_block_hash
            if p is not None and (type(p) is not int or p < 0):
                ev.parent_block_hash = _hash(p, keep_bytes, "BlockStored.parent_block_hash")
    batch.ts = float(batch.ts)
    return batch


def decode_batch(payload: bytes, keep_bytes: bool = False) -> KVEventBatch:
    """Decode one msgpack payload (frame 2 of a live message) into a batch.

    ``keep_bytes`` keeps digest-bytes hashes as bytes instead of folding them to u64 (for
    tools that want to show what the engine sent).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    fast = _fast_decode(payload, keep_bytes)
    if fast is not None:
        return fast
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise CodecError(f"not a msgpack value: {e.__class__.__name__}: {e}") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise CodecError("batch: expected an array [ts, events, dp_rank]")
    ts, raw_events = obj[0], obj[1]
    if type(ts) not in (float, int):
        raise CodecError(f"batch.ts: expected a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise CodecError(f"batch.events: expected an array, got {type(raw_events).__name__}")
    rank = obj[2] if len(obj) > 2 else None
    _check_int(rank, "batch.data_parallel_rank")
    try:
        events = [_decode_event(e, keep_bytes) for e in raw_events]
    except CodecError:
        raise
    except Exception as e:  # unhashable keys, odd nesting: still the codec's error
        raise CodecError(f"event: {e.__class__.__name__}: {e}") from None
    return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=rank)


# --------------------------------------------------------------------------------------
# Encoding


def _map_header(n_declared: int, n_present: int) -> bytes:
    # msgspec picks the header from the number of declared keys (fields + "type").
    if n_declared <= 15:
        return bytes((0x80 | n_present,))
    return b"\xde" + n_present.to_bytes(2, "big")


def _encode_event_map(ev: KVEvent, pack) -> bytes:
    cls = type(ev)
    names = _FIELDS[cls]
    items: list[tuple[str, Any]] = [("type", cls.TYPE)]
    for name in names:
        v = getattr(ev, name)
        if v is None and name not in cls.REQUIRED:
            continue
        items.append((name, v))
    out = [_map_header(len(names) + 1, len(items))]
    for k, v in items:
        out.append(pack(k))
        out.append(pack(v))
    return b"".join(out)


def _encode_event_array(ev: KVEvent, pack, n_fields: int | None) -> bytes:
    cls = type(ev)
    names = _FIELDS[cls]
    if n_fields is not None:
        names = names[:n_fields]
    return pack([cls.TYPE, *(getattr(ev, n) for n in names)])


def encode_batch(
    batch: KVEventBatch, layout: Layout = "map", array_fields: dict[str, int] | None = None
) -> bytes:
    """Encode a batch as vLLM puts it on the wire.

    ``layout="array"`` writes vLLM <= 0.23's positional events; ``array_fields`` can cut
    each type to an older field count (e.g. {"BlockStored": 6} for 0.11) for tests.
    """
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    pack = packer.pack
    if layout == "map":
        evs = [_encode_event_map(e, pack) for e in batch.events]
    elif layout == "array":
        af = array_fields or {}
        evs = [_encode_event_array(e, pack, af.get(type(e).TYPE)) for e in batch.events]
    else:
        raise ValueError(f"layout must be 'map' or 'array', got {layout!r}")
    n = len(evs)
    if n < 16:
        arr = bytes((0x90 | n,))
    elif n < 0x10000:
        arr = b"\xdc" + n.to_bytes(2, "big")
    else:
        arr = b"\xdd" + n.to_bytes(4, "big")
    return b"\x93" + pack(float(batch.ts)) + arr + b"".join(evs) + pack(batch.data_parallel_rank)


def event_to_dict(ev: KVEvent) -> dict[str, Any]:
    """A JSON-friendly dict of every field (bytes as hex), for NDJSON output and debugging."""
    d: dict[str, Any] = {"type": type(ev).TYPE}
    for name in _FIELDS[type(ev)]:
        d[name] = _jsonable(getattr(ev, name))
    return d


def batch_to_dict(batch: KVEventBatch) -> dict[str, Any]:
    return {
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "events": [event_to_dict(e) for e in batch.events],
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def iter_block_hashes(batch: KVEventBatch) -> Iterable[Hash]:
    for ev in batch.events:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            yield from ev.block_hashes
