"""The msgpack codec against vLLM's wire format, every layout from 0.11 to 0.33 (spec §1.4-§1.7)."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from conftest import load_vector
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.codec import CodecError, batch_to_dict, decode_batch, encode_batch
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

U64 = 2**64 - 1


def full_stored(**kw) -> BlockStored:
    d = dict(
        block_hashes=[2233398808101521225, U64],
        parent_block_hash=17,
        token_ids=list(range(32)),
        block_size=16,
        lora_id=7,
        medium="GPU",
        lora_name="sql-adapter",
        extra_keys=[["sql-adapter"], None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
        ownership="kvcr",
        session_id="s-1",
        lookahead_token_ids=[[1, 2], [3, 4]],
    )
    d.update(kw)
    return BlockStored(**d)


def full_removed(**kw) -> BlockRemoved:
    d = dict(block_hashes=[5], medium="CPU", group_idx=1, locality="REMOTE", ownership="kvcr")
    d.update(kw)
    return BlockRemoved(**d)


# --------------------------------------------------------------------------------------
# Round trips


def test_map_round_trip_every_field():
    b = KVEventBatch(
        ts=1.25, events=[full_stored(), full_removed(), AllBlocksCleared()], data_parallel_rank=3
    )
    assert decode_batch(encode_batch(b)) == b
    assert encode_batch(b) == encode_batch(b, layout="map")


def test_array_round_trip_0_23_layout():
    b = KVEventBatch(
        ts=2.5,
        events=[
            full_stored(locality=None, ownership=None, session_id=None, lookahead_token_ids=None),
            full_removed(locality=None, ownership=None),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert decode_batch(encode_batch(b, layout="array")) == b


# Field counts (without the tag) of the positional layouts by vLLM version (spec §1.5).
OLD_ARRAYS = {
    "0.11": ({"BlockStored": 6, "BlockRemoved": 2}, {}),
    "0.15": ({"BlockStored": 7, "BlockRemoved": 2}, {}),
    "0.20": ({"BlockStored": 9, "BlockRemoved": 3}, {"extra_keys": [None, None], "group_idx": 0}),
    "0.22": (
        {"BlockStored": 11, "BlockRemoved": 3},
        {
            "extra_keys": [None, None],
            "group_idx": 0,
            "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 128,
        },
    ),
}


@pytest.mark.parametrize("version", sorted(OLD_ARRAYS))
def test_array_round_trip_old_field_counts(version):
    counts, extra = OLD_ARRAYS[version]
    stored = BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name="ad" if counts["BlockStored"] >= 7 else None,
        **extra,
    )
    removed = BlockRemoved(block_hashes=[11], medium="GPU", group_idx=extra.get("group_idx"))
    b = KVEventBatch(ts=1.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=0)
    payload = encode_batch(b, layout="array", array_fields=counts)
    raw = msgpack.unpackb(payload)
    assert len(raw[1][0]) == 1 + counts["BlockStored"]
    assert len(raw[1][1]) == 1 + counts["BlockRemoved"]
    assert decode_batch(payload) == b


# --------------------------------------------------------------------------------------
# The examples of spec §1.4 and §1.6


def spec_map_batch() -> KVEventBatch:
    h = 2233398808101521225
    return KVEventBatch(
        ts=1796009746.8132975,
        events=[
            BlockStored(
                block_hashes=[h],
                parent_block_hash=None,
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )


def test_spec_map_example_decoded_form():
    payload = encode_batch(spec_map_batch())
    assert msgpack.unpackb(payload) == [
        1796009746.8132975,
        [
            {
                "type": "BlockStored",
                "block_hashes": [2233398808101521225],
                "parent_block_hash": None,
                "token_ids": list(range(16)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": [None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [2233398808101521225],
                "medium": "GPU",
                "group_idx": 0,
            },
            {"type": "AllBlocksCleared"},
        ],
        1,
    ]
    assert decode_batch(payload) == spec_map_batch()


def test_spec_map_example_bytes():
    b = spec_map_batch()
    b.events = b.events[:1]
    payload = encode_batch(b)
    prefix = "93 cb41dac33bc4b40d11 91 de000b a474797065 ab426c6f636b53746f726564"
    assert payload.startswith(bytes.fromhex(prefix.replace(" ", "")))
    assert payload.endswith(b"\x01")
    # token_ids with 16 entries use array16; BlockRemoved gets a fixmap of 4.
    assert bytes.fromhex("dc0010") in payload
    removed = encode_batch(
        KVEventBatch(
            ts=1.0, events=[BlockRemoved([1], medium="GPU", group_idx=0)], data_parallel_rank=0
        )
    )
    assert removed[10] == 0x91 and removed[11] == 0x84


def test_spec_empty_batch_bytes():
    assert encode_batch(KVEventBatch(1.0, [])) == bytes.fromhex("93cb3ff000000000000090c0")


def test_spec_array_example():
    expected = [
        1.5,
        [
            [
                "BlockStored",
                [11, 12],
                None,
                [1, 2, 3, 4],
                2,
                None,
                "GPU",
                None,
                [None, None],
                0,
                "full_attention",
                None,
            ],
            ["BlockRemoved", [11], "GPU", 0],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    b = decode_batch(msgpack.packb(expected))
    assert b == KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                [11, 12],
                None,
                [1, 2, 3, 4],
                2,
                medium="GPU",
                extra_keys=[None, None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved([11], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = encode_batch(b, layout="array", array_fields={"BlockStored": 11, "BlockRemoved": 3})
    assert payload == msgpack.packb(expected)


def test_large_hashes_use_uint64():
    payload = encode_batch(KVEventBatch(0.0, [BlockRemoved([2**63 + 5], medium=None)], 0))
    assert bytes.fromhex("cf8000000000000005") in payload


# --------------------------------------------------------------------------------------
# Frames captured from vLLM 0.33


FRAMES = load_vector("wire_frames_vllm_0.33.json")["frames"]


@pytest.mark.parametrize("frame", FRAMES, ids=[f"seq{f['seq']}" for f in FRAMES])
def test_vllm_frames_decode_and_reencode(frame):
    payload = bytes.fromhex(frame["payload_hex"])
    assert bytes.fromhex(frame["seq_frame_hex"]) == frame["seq"].to_bytes(8, "big")
    assert bytes.fromhex(frame["topic_hex"]) == b""
    b = decode_batch(payload)
    ts, events, rank = frame["decoded"]
    assert b.ts == ts and b.data_parallel_rank == rank
    assert len(b.events) == len(events)
    for ev, exp in zip(b.events, events, strict=True):
        assert exp["type"] == type(ev).TYPE
        got = batch_to_dict(KVEventBatch(0.0, [ev]))["events"][0]
        for k, v in exp.items():
            assert got[k] == v, k
        # Everything the engine omitted is None here.
        assert all(v is None for k, v in got.items() if k not in exp)
    assert encode_batch(b) == payload


# --------------------------------------------------------------------------------------
# Tolerance: what older or newer producers may send


def _pack(events, outer_extra=()):
    return msgpack.packb([1.0, events, 0, *outer_extra], use_bin_type=True)


def test_signed_int64_hashes_reinterpret_to_u64():
    payload = _pack([{"type": "BlockRemoved", "block_hashes": [-1, -(2**63), 5], "medium": "GPU"}])
    assert decode_batch(payload).events[0].block_hashes == [U64, 2**63, 5]
    stored = _pack(
        [
            {
                "type": "BlockStored",
                "block_hashes": [-2],
                "parent_block_hash": -3,
                "token_ids": [1],
                "block_size": 1,
            }
        ]
    )
    ev = decode_batch(stored).events[0]
    assert ev.block_hashes == [U64 - 1] and ev.parent_block_hash == U64 - 2


def test_bytes_hashes_use_last_8_bytes():
    digest = bytes(range(32))
    payload = _pack(
        [
            {
                "type": "BlockStored",
                "block_hashes": [digest],
                "parent_block_hash": digest[:16],
                "token_ids": [1],
                "block_size": 1,
            }
        ]
    )
    ev = decode_batch(payload).events[0]
    assert ev.block_hashes == [int.from_bytes(digest[-8:], "big")]
    assert ev.parent_block_hash == int.from_bytes(digest[8:16], "big")
    assert decode_batch(payload, keep_bytes=True).events[0].block_hashes == [digest]


def test_missing_optional_fields_and_unknown_keys():
    payload = _pack(
        [
            {
                "type": "BlockStored",
                "block_hashes": [1],
                "token_ids": [1, 2],
                "block_size": 2,
                "future_field": {"x": 1},
            },
            {"block_hashes": [1], "type": "BlockRemoved", "new": [1, 2]},
            {"type": "AllBlocksCleared", "reason": "reset"},
        ]
    )
    b = decode_batch(payload)
    assert b.events == [BlockStored([1], None, [1, 2], 2), BlockRemoved([1]), AllBlocksCleared()]


def test_extra_trailing_elements_and_fourth_outer_element():
    ev = [
        "BlockStored",
        [1],
        None,
        [1, 2],
        2,
        None,
        "GPU",
        None,
        [None],
        0,
        "full_attention",
        None,
        "LOCAL",
        "own",
        "sess",
        None,
        "future",
        42,
    ]
    payload = _pack(
        [ev, ["BlockRemoved", [1], "GPU", 0, None, None, "extra"], ["AllBlocksCleared", 1]],
        outer_extra=(b"\x00" * 16,),
    )
    b = decode_batch(payload)
    assert b.events[0].session_id == "sess" and b.events[0].ownership == "own"
    assert b.events[1] == BlockRemoved([1], medium="GPU", group_idx=0)
    assert b.data_parallel_rank == 0


def test_two_element_outer_array_has_no_rank():
    assert decode_batch(msgpack.packb([2.0, []])).data_parallel_rank is None


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"ts": 1}, "expected an array"),
        ([1.0], "expected an array"),
        (["x", []], "batch.ts"),
        ([1.0, {}], "batch.events"),
        ([1.0, [], "r"], "data_parallel_rank"),
        ([1.0, [7]], "map or an array"),
        ([1.0, [{"type": "Nope"}]], "unknown type"),
        ([1.0, [["Nope"]]], "unknown type tag"),
        ([1.0, [[]]], "empty array"),
        ([1.0, [{"type": "BlockStored", "block_hashes": [1]}]], "missing field"),
        (
            [
                1.0,
                [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 1}],
            ],
            "hash must be int or bytes",
        ),
        (
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}]],
            "must be positive",
        ),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [b""]}]], "empty bytes"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]], "list of hashes"),
        ([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]], "expected a string"),
    ],
)
def test_malformed_payloads_raise_codec_error(obj, reason):
    with pytest.raises(CodecError, match=reason):
        decode_batch(msgpack.packb(obj, use_bin_type=True))


def test_not_msgpack():
    with pytest.raises(CodecError, match="not a msgpack value"):
        decode_batch(b"\xc1")
    with pytest.raises(CodecError):
        decode_batch(b"")
    with pytest.raises(CodecError):
        decode_batch(b"\x93\xcb")


# --------------------------------------------------------------------------------------
# Byte identity with msgspec and vLLM 0.33's struct options (spec §1.4)


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


def _to_msgspec(b: KVEventBatch) -> _Batch:
    evs = []
    for e in b.events:
        if isinstance(e, BlockStored):
            evs.append(_Stored(**{k: getattr(e, k) for k in _Stored.__struct_fields__}))
        elif isinstance(e, BlockRemoved):
            evs.append(_Removed(**{k: getattr(e, k) for k in _Removed.__struct_fields__}))
        else:
            evs.append(_Cleared())
    return _Batch(b.ts, evs, b.data_parallel_rank)


hashes = st.lists(st.integers(0, U64), min_size=1, max_size=5)
opt_str = st.none() | st.text(max_size=8)
opt_int = st.none() | st.integers(0, 1000)
stored_st = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(0, U64),
    token_ids=st.lists(st.integers(0, 2**20), max_size=40),
    block_size=st.integers(1, 64),
    lora_id=opt_int,
    medium=opt_str,
    lora_name=opt_str,
    extra_keys=st.none()
    | st.lists(st.none() | st.lists(st.text(max_size=4), max_size=2), max_size=3),
    group_idx=opt_int,
    kv_cache_spec_kind=opt_str,
    kv_cache_spec_sliding_window=opt_int,
    locality=opt_str,
    ownership=opt_str,
    session_id=opt_str,
    lookahead_token_ids=st.none()
    | st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=2),
)
removed_st = st.builds(
    BlockRemoved,
    block_hashes=hashes,
    medium=opt_str,
    group_idx=opt_int,
    locality=opt_str,
    ownership=opt_str,
)
batch_st = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(st.one_of(stored_st, removed_st, st.just(AllBlocksCleared())), max_size=20),
    data_parallel_rank=st.integers(0, 64),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_st)
def test_encoding_is_byte_identical_to_msgspec(b):
    payload = encode_batch(b)
    assert payload == msgspec.msgpack.encode(_to_msgspec(b))
    assert decode_batch(payload) == b


# --------------------------------------------------------------------------------------
# Fuzzing: only CodecError may escape


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_codec_error(data):
    try:
        decode_batch(data)
    except CodecError:
        pass


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=9),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4)
    ),
    max_leaves=12,
)


def _mutate(obj, path: list[int], replacement, mode: int):
    """Replace, delete or extend one nested element of a decoded payload."""
    if not path or not isinstance(obj, (list, dict)) or not obj:
        return replacement
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    k = keys[path[0] % len(keys)]
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    if len(path) == 1 and mode == 1:
        del out[k]
    elif len(path) == 1 and mode == 2 and isinstance(out, list):
        out.append(replacement)
    else:
        out[k] = _mutate(out[k], path[1:], replacement, mode)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([bytes.fromhex(f["payload_hex"]) for f in FRAMES]),
    st.lists(st.integers(0, 50), min_size=1, max_size=5),
    msgpack_values,
    st.integers(0, 2),
)
def test_mutated_valid_payloads_only_raise_codec_error(payload, path, replacement, mode):
    obj = msgpack.unpackb(payload)
    mutated = _mutate(obj, path, replacement, mode)
    try:
        data = msgpack.packb(mutated, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        decode_batch(data)
    except CodecError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([bytes.fromhex(f["payload_hex"]) for f in FRAMES]), st.data())
def test_truncated_or_flipped_payloads_only_raise_codec_error(payload, data):
    cut = data.draw(st.integers(0, len(payload)))
    pos = data.draw(st.integers(0, len(payload) - 1))
    flipped = bytearray(payload)
    flipped[pos] ^= data.draw(st.integers(1, 255))
    for candidate in (payload[:cut], bytes(flipped)):
        try:
            decode_batch(candidate)
        except CodecError:
            pass
