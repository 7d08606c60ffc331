"""The block-hash chain against vectors produced by vLLM 0.33's own code (spec §3)."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
from conftest import load_vector

from events.hashing import (
    HashingError,
    HashScheme,
    LoRA,
    _cbor_extra,
    _cbor_head,
    _cbor_tokens,
    block_extra_keys,
    event_extra_keys,
    none_hash,
    normalize_event_hash,
    prompt_embeds_digests,
    to_event_hash,
)

V = load_vector("block_hashes.json")
CASES = V["cases"]
LORA = LoRA(V["lora_request"]["lora_name"], V["lora_request"]["lora_path"])
SALT = V["cache_salt"]


def _case_id(c: dict) -> str:
    return f"{c['algo']}-seed{c['PYTHONHASHSEED']}-{c['extra']}-{c['num_tokens']}tok"


def _extras(extra: str) -> dict:
    return {
        "none": {},
        "cache_salt": {"cache_salt": SALT},
        "lora": {"lora": LORA},
        "lora+cache_salt": {"lora": LORA, "cache_salt": SALT},
    }[extra]


def _jsonish(v):
    if isinstance(v, (tuple, list)):
        return [_jsonish(x) for x in v]
    return v


def test_there_are_96_cases():
    assert len(CASES) == 96


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_vllm_vector(case):
    scheme = HashScheme(
        algo=case["algo"], seed=case["PYTHONHASHSEED"], block_size=case["block_size"]
    )
    tokens = V["tokens"][str(case["num_tokens"])]
    kw = _extras(case["extra"])
    digests = scheme.block_digests(tokens, **kw)
    assert [d.hex() for d in digests] == case["block_hashes_hex"]
    u64 = scheme.block_hashes(tokens, **kw)
    assert u64 == case["block_hashes_u64"]
    assert [to_event_hash(d) for d in digests] == u64
    # The i64 form (what a signed producer would send) folds back to the same u64.
    assert [normalize_event_hash(h) for h in case["block_hashes_i64"]] == u64
    assert [int.from_bytes(d[-8:], "big", signed=True) for d in digests] == case["block_hashes_i64"]
    keys = [
        block_extra_keys(i, "tagged", lora=kw.get("lora"), cache_salt=kw.get("cache_salt"))
        for i in range(len(digests))
    ]
    assert _jsonish(keys) == case["hash_input_extra_keys"]
    published = [_jsonish(event_extra_keys(k)) for k in keys] if keys else None
    assert published == case["event_extra_keys"]


@pytest.mark.parametrize("nh", V["none_hashes"], ids=lambda n: f"{n['algo']}-{n['PYTHONHASHSEED']}")
def test_none_hash(nh):
    assert none_hash(nh["algo"], nh["PYTHONHASHSEED"]).hex() == nh["none_hash_hex"]
    assert (
        HashScheme(algo=nh["algo"], seed=nh["PYTHONHASHSEED"]).none_hash.hex()
        == nh["none_hash_hex"]
    )


@pytest.mark.parametrize("dbg", V["debug_first_block"], ids=lambda d: f"{d['algo']}-{d['extra']}")
def test_first_block_serialization_is_vllms(dbg):
    """The exact bytes fed to sha256 for block 0 equal what vLLM serialized."""
    scheme = HashScheme(algo=dbg["algo"], seed=dbg["PYTHONHASHSEED"], block_size=dbg["block_size"])
    tokens = V["tokens"]["16"]
    kw = _extras(dbg["extra"])
    extra = block_extra_keys(0, "tagged", lora=kw.get("lora"), cache_salt=kw.get("cache_salt"))
    parent = scheme.none_hash
    if dbg["algo"] == "sha256_cbor":
        ours = (
            b"\x83"
            + _cbor_head(2, len(parent))
            + parent
            + _cbor_tokens(tokens)
            + _cbor_extra(extra)
        )
        assert ours == cbor2.dumps((parent, tuple(tokens), extra), canonical=True)
    else:
        ours = pickle.dumps((parent, tuple(tokens), extra), protocol=5)
    assert ours.hex() == dbg["serialized_hex"]
    assert hashlib.sha256(ours).hexdigest() == dbg["digest_hex"]
    assert scheme.hash_block(None, tokens, extra).hex() == dbg["digest_hex"]


# --------------------------------------------------------------------------------------
# Spec §3.9 table (0.33 tagged extra keys, and the untagged 0.29 rows)

T = [*range(40), 300, 70000, 151643, *range(1000, 1013)]
MY_LORA = LoRA("my-lora", "/adapters/my-lora")
TABLE = [
    (
        "sha256_cbor",
        None,
        "tagged",
        {},
        [2233398808101521225, 17911472383915781900, 15929016977416759163],
    ),
    ("sha256", None, "tagged", {}, [3262291359910021016, 7142137847444424233, 7380752211145616320]),
    (
        "sha256_cbor",
        "0",
        "tagged",
        {},
        [12687895063098490012, 1814341696565857452, 17065691619759125854],
    ),
    (
        "sha256",
        "0",
        "tagged",
        {},
        [7982712666671721126, 12675106281628537544, 10660473343213525115],
    ),
    (
        "sha256_cbor",
        None,
        "tagged",
        {"cache_salt": "s1"},
        [16868077126905186569, 1414065028342139162, 17314461395344803950],
    ),
    (
        "sha256_cbor",
        None,
        "untagged",
        {"cache_salt": "s1"},
        [13029194653155814067, 12818835090051502499, 14858517914871565464],
    ),
    (
        "sha256",
        None,
        "tagged",
        {"cache_salt": "s1"},
        [7027321370956117732, 10213922681512860221, 12650532193952587583],
    ),
    (
        "sha256",
        None,
        "untagged",
        {"cache_salt": "s1"},
        [1437345297742174673, 10699917258516603328, 9147417041553433068],
    ),
    (
        "sha256_cbor",
        None,
        "tagged",
        {"lora": MY_LORA},
        [14554600408563267446, 5304254642391274310, 2546400835048584276],
    ),
    (
        "sha256_cbor",
        None,
        "untagged",
        {"lora": MY_LORA},
        [4419866080380130645, 2240891630946247532, 14736714069195717115],
    ),
]


@pytest.mark.parametrize(("algo", "seed", "style", "kw", "expected"), TABLE)
def test_spec_table(algo, seed, style, kw, expected):
    scheme = HashScheme(algo=algo, seed=seed, block_size=16, extra_key_style=style)
    assert scheme.block_hashes(T, **kw) == expected


def test_spec_full_digests():
    cbor = HashScheme().block_digests(T)
    assert [d.hex() for d in cbor] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        "6b00838c8f59a721c7f0ea76c1a3b3235de4bb90b3ea93dbdd0f3c8ba017a77b",
    ]
    pk = HashScheme(algo="sha256").block_digests(T)
    assert pk[0].hex() == "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"


# --------------------------------------------------------------------------------------
# Prompt embeddings


def _reference_chain(algo: str, tokens, extras, bs: int = 16) -> list[bytes]:
    """Independent recomputation with the generic serializers (cbor2 / pickle)."""
    parent = none_hash(algo, None)
    out = []
    for i, extra in enumerate(extras):
        obj = (parent, tuple(tokens[i * bs : (i + 1) * bs]), extra)
        data = (
            cbor2.dumps(obj, canonical=True)
            if algo == "sha256_cbor"
            else pickle.dumps(obj, protocol=5)
        )
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize("style", ["tagged", "untagged"])
def test_prompt_embeds_digest_and_chain(dtype, algo, style):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    embeds = torch.randn(40, 8, generator=g).to(getattr(torch, dtype))
    digests = prompt_embeds_digests(embeds, 16)
    assert len(digests) == 2
    for i, d in enumerate(digests):
        part = embeds[i * 16 : (i + 1) * 16].contiguous()
        raw = (
            part.view(torch.int16).numpy().tobytes()
            if dtype == "bfloat16"
            else part.numpy().tobytes()
        )
        assert len(raw) == 16 * 8 * part.element_size()
        assert d == hashlib.sha256(raw).digest()
    tokens = [0] * 40
    scheme = HashScheme(algo=algo, extra_key_style=style)
    got = scheme.block_digests(tokens, embeds_digests=digests)
    extras = [(("prompt_embeds", d),) if style == "tagged" else (d,) for d in digests]
    assert got == _reference_chain(algo, tokens, extras)
    # The published form of the extra keys is the digest itself.
    assert event_extra_keys(block_extra_keys(0, style, embeds_digest=digests[0])) == [digests[0]]


def test_prompt_embeds_digest_of_a_non_contiguous_slice():
    torch = pytest.importorskip("torch")
    base = torch.arange(64 * 4, dtype=torch.float32).reshape(4, 64).t()  # non-contiguous
    (d,) = prompt_embeds_digests(base[:16], 16)
    assert d == hashlib.sha256(base[:16].contiguous().numpy().tobytes()).digest()


# --------------------------------------------------------------------------------------
# Chaining


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize(
    "kw", [{}, {"lora": MY_LORA}, {"cache_salt": "s1"}], ids=["plain", "lora", "salt"]
)
def test_chain_continuation_equals_whole_list(algo, kw):
    tokens = V["tokens"]["1000"]
    scheme = HashScheme(algo=algo)
    whole = scheme.block_digests(tokens, **kw)
    assert len(whole) == 62
    for k in (1, 5, 61):
        head = scheme.block_digests(tokens[: k * 16 + 3], **kw)
        assert head == whole[:k]
        tail = scheme.block_digests(tokens, parent=head[-1], start_block=k, **kw)
        assert tail == whole[k:]


def test_plain_chain_matches_generic_path():
    """The hand-written CBOR fast path equals cbor2 for large and small token ids."""
    tokens = [
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**18 - 1,
        2**18,
        2**32 - 1,
        2**32,
        5,
        6,
        7,
        8,
        9,
    ] * 3
    got = HashScheme().block_digests(tokens)
    assert got == _reference_chain("sha256_cbor", tokens, [None] * 3)


@pytest.mark.parametrize("bs", [16, 32])
def test_vectorised_long_chain_matches_generic_path(bs):
    """Long prompts take the numpy path: every CBOR int width, and a partial tail block."""
    edge = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 151_642, 7, 99_999]
    tokens = (edge * (64 * bs // len(edge) + 1))[: 40 * bs + 5]
    got = HashScheme(block_size=bs).block_digests(tokens)
    ref = _reference_chain("sha256_cbor", [*tokens[: 40 * bs]], [None] * 40, bs)
    assert got == ref
    # Continuing a chain and ids that do not fit 32 bits fall back to the exact paths.
    assert HashScheme(block_size=bs).block_digests(tokens, parent=got[3], start_block=4) == got[4:]
    big = [*tokens[: 40 * bs - 1], 2**40]
    assert HashScheme(block_size=bs).block_digests(big) == _reference_chain(
        "sha256_cbor", big, [None] * 40, bs
    )


def test_partial_block_not_hashed_and_errors():
    assert HashScheme().block_digests(list(range(15))) == []
    with pytest.raises(HashingError):
        HashScheme(algo="xxhash")
    with pytest.raises(HashingError):
        HashScheme(block_size=0)
