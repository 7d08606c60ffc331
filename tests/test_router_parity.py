"""Hash parity: detection of wrong seed/algo/style/block size, seed scan, token-key fallback."""

from __future__ import annotations

import pytest

from events.hashing import HashScheme, LoRA, block_extra_keys, event_extra_keys
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index import Match, MemoryIndex
from router.instance import InstanceKey
from router.keys import KeyTranslator
from router.parity import (
    ADOPTED,
    MISMATCH,
    TOKEN_KEYS,
    UNTRUSTED,
    UNVERIFIED,
    VERIFIED,
    ParityTracker,
    recompute,
    scan_seeds,
)
from router.prompt import PromptHasher

A = InstanceKey("http://a:1")
B = InstanceKey("http://b:1")
TOKENS = [*range(40), 300, 70000, 151643, *range(1000, 1021)]  # 64 tokens


def engine_event(
    scheme: HashScheme,
    tokens=TOKENS,
    salt=None,
    lora: LoRA | None = None,
    start=0,
    parent_digest=None,
):
    """A BlockStored as a vLLM 0.33 engine with ``scheme`` would publish it."""
    bs = scheme.block_size
    digests = scheme.block_digests(tokens, cache_salt=salt, lora=lora)
    n = len(digests)
    blocks = range(start, n)
    extras = [
        event_extra_keys(block_extra_keys(i, "tagged", cache_salt=salt, lora=lora)) for i in blocks
    ]
    parent = None if start == 0 else int.from_bytes(digests[start - 1][-8:], "big")
    return BlockStored(
        [int.from_bytes(digests[i][-8:], "big") for i in blocks],
        parent,
        list(tokens[start * bs : n * bs]),
        bs,
        None,
        "GPU",
        lora.name if lora else None,
        extras,
        0,
        "full_attention",
    )


def test_recompute_matches_engine_events_with_extras():
    s = HashScheme()
    lora = LoRA("my-lora", "/adapters/my-lora")
    ev = engine_event(s, salt="s1", lora=lora)
    assert recompute(ev, s, {"my-lora": "/adapters/my-lora"}) == ev.block_hashes


def test_verified_when_scheme_matches():
    tr = ParityTracker(HashScheme())
    assert tr.state(A) == UNVERIFIED and tr.trusted(A)
    v = tr.observe(A, engine_event(HashScheme()))
    assert v.ok and v.changed and tr.state(A) == VERIFIED
    assert tr.observe(A, engine_event(HashScheme(), start=2)) is None  # parent set: unchecked
    assert tr.counts(A) == (1, 0)


@pytest.mark.parametrize(
    ("engine", "salt"),
    [
        (HashScheme(seed="0"), None),  # wrong seed (seed 0 is a standard candidate)
        (HashScheme(algo="sha256"), None),  # wrong algorithm
        (HashScheme(algo="sha256", seed="77"), None),  # configured candidate seed + algo
        (HashScheme(block_size=32), None),  # the event's block size
        (HashScheme(extra_key_style="untagged"), "s1"),  # a 0.29 engine: untagged keys
    ],
)
def test_mismatch_detected_and_adopted(engine, salt):
    tr = ParityTracker(HashScheme(), candidate_seeds=["0", "77"], mode="auto")
    v = tr.observe(A, engine_event(engine, salt=salt))
    assert not v.changed or v.state == ADOPTED
    assert tr.state(A) == ADOPTED and tr.trusted(A)
    assert tr.scheme(A).algo == engine.algo
    assert tr.scheme(A).seed == engine.seed
    assert tr.scheme(A).block_size == engine.block_size
    if salt:
        assert tr.scheme(A).extra_key_style == "untagged"
    assert "adopted" in tr.message(A)
    # From now on the prompt side's hashes under scheme(A) equal the engine's.
    assert PromptHasher().hashes(TOKENS, tr.scheme(A), cache_salt=salt) == engine.block_hashes(
        TOKENS, cache_salt=salt
    )
    assert tr.observe(A, engine_event(engine, tokens=TOKENS[::-1], salt=salt)).ok
    assert tr.counts(A) == (1, 1)


def test_fixed_mode_marks_untrusted_and_says_how_to_fix():
    tr = ParityTracker(HashScheme(), mode="fixed")
    v = tr.observe(A, engine_event(HashScheme(algo="sha256")))
    assert v.state == UNTRUSTED and not tr.trusted(A)
    assert v.found == HashScheme(algo="sha256")
    assert tr.scheme(A) == HashScheme()  # not adopted
    assert "PYTHONHASHSEED" in tr.message(A) and "--hash-scheme auto" in tr.message(A)


def test_seed_scan_finds_pythonhashseed_1234():
    engine = HashScheme(algo="sha256_cbor", seed="1234")
    tr = ParityTracker(HashScheme())
    ev = engine_event(engine)
    v = tr.observe(A, ev)
    assert v.state == MISMATCH and v.needs_scan and not tr.trusted(A)
    found = scan_seeds(tr.scan_event(A))
    assert found == HashScheme(seed="1234")
    v = tr.apply_scan(A, found)
    assert v.state == ADOPTED and tr.scheme(A).seed == "1234"
    assert scan_seeds(engine_event(HashScheme(algo="sha256", seed="4321"))) == HashScheme(
        algo="sha256", seed="4321"
    )


def test_unreproducible_engine_switches_to_token_keys():
    engine = HashScheme(seed="not-a-number")
    tr = ParityTracker(HashScheme())
    ev = engine_event(engine)
    assert tr.observe(A, ev).needs_scan
    assert scan_seeds(ev, seeds=range(2000)) is None
    v = tr.apply_scan(A, None)
    assert v.state == TOKEN_KEYS and v.changed and tr.uses_token_keys(A) and tr.trusted(A)
    assert "PYTHONHASHSEED" in v.message and "token ids" in v.message
    assert tr.observe(A, ev) is None  # no more checks
    assert tr.scheme(A) == tr.key_scheme(16)
    tr.reset(A)  # engine restarted: verify again
    assert tr.state(A) == UNVERIFIED and tr.scheme(A) == HashScheme()


def test_token_key_fallback_matches_across_instances():
    """Two engines with different unknown seeds: translated keys are the same for both, and
    equal to the prompt side's hashes under the key scheme."""
    idx = MemoryIndex()
    trans = {A: KeyTranslator(), B: KeyTranslator()}
    engines = {A: HashScheme(seed="random-a"), B: HashScheme(seed="random-b", algo="sha256")}
    salt = "tenant"
    for inst, eng in engines.items():
        # the chain arrives in two events: blocks 0-1, then 2-3 with a parent
        first = engine_event(eng, tokens=TOKENS[:32], salt=salt)
        second = engine_event(eng, salt=salt, start=2)
        batch = KVEventBatch(1.0, [first, second], 0)
        idx.apply(inst, trans[inst].translate_batch(batch))
    key_scheme = ParityTracker(HashScheme()).key_scheme(16)
    hashes = PromptHasher().hashes(TOKENS + [5] * 3, key_scheme, cache_salt=salt)
    assert idx.match(hashes) == {A: Match(4), B: Match(4)}
    assert PromptHasher().hashes(TOKENS, key_scheme) != hashes  # salt still separates
    # Removal by engine hash maps to the same key.
    eng_hash_b2 = engines[B].block_hashes(TOKENS, cache_salt=salt)[2]
    out = trans[B].translate_batch(KVEventBatch(2.0, [BlockRemoved([eng_hash_b2], "GPU")], 0))
    idx.apply(B, out)
    assert idx.match(hashes) == {A: Match(4), B: Match(2)}
    # A chain whose parent the translator never saw cannot be translated.
    t = KeyTranslator()
    out = t.translate_batch(KVEventBatch(1.0, [engine_event(engines[A], start=2)], 0))
    assert out.events == [] and t.untranslatable == 2
    # AllBlocksCleared empties the map and passes through.
    out = trans[A].translate_batch(KVEventBatch(3.0, [AllBlocksCleared()], 0))
    assert isinstance(out.events[0], AllBlocksCleared) and len(trans[A]) == 0


def test_key_translator_refcounts_duplicates():
    t = KeyTranslator()
    eng = HashScheme(seed="x")
    ev = engine_event(eng, tokens=TOKENS[:16])
    t.translate_batch(KVEventBatch(1.0, [ev, ev], 0))
    h = ev.block_hashes[0]
    key = t.key_of(h)
    rm = KVEventBatch(1.0, [BlockRemoved([h], "GPU")], 0)
    assert t.translate_batch(rm).events[0].block_hashes == [key]
    assert t.key_of(h) == key  # one copy left
    t.translate_batch(rm)
    assert t.key_of(h) is None


def test_lora_with_unknown_path_is_skipped_not_flagged():
    lora = LoRA("ad", "/p/ad")
    tr = ParityTracker(HashScheme())
    assert tr.observe(A, engine_event(HashScheme(), lora=lora)) is None
    tr2 = ParityTracker(HashScheme(), lora_paths={"ad": "/p/ad"})
    assert tr2.observe(A, engine_event(HashScheme(), lora=lora)).ok
