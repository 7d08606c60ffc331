"""Hash parity: prove, per instance, that the router names blocks exactly as the engine does.

A different PYTHONHASHSEED, hash algorithm, block size or extra-key style makes every lookup
miss without any error (design §3.2, spec §3.3), so parity is checked, never assumed. Every
BlockStored whose parent is None carries the tokens of a chain's first blocks; recomputing
their hashes under the instance's scheme either matches (verified) or not. On a mismatch the
tracker tries the plausible schemes, then scans PYTHONHASHSEED 0..65535 against block 0
(``scan_seeds``, pure and CPU-bound: the runtime runs it in a thread), and finally gives up
on the engine's hashes: the instance is then indexed by keys the router derives from the
events' token ids (router/keys.py), so routing stays exact either way.

States per instance:

* ``unverified``: no block-0 event seen yet (trusted: nothing says otherwise);
* ``verified``: block-0 events match the configured scheme;
* ``adopted``: they match another scheme, found by the search, now in use (``auto`` mode);
* ``mismatch``: they match nothing tried so far; a seed scan is due (untrusted meanwhile);
* ``untrusted``: ``fixed`` mode found the engine's scheme but may not adopt it;
* ``token-keys``: nothing reproduces the engine's hashes; keys derive from token ids.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from events.hashing import (
    ALGORITHMS,
    HashingError,
    HashScheme,
    _cbor_head,
    _cbor_tokens,
    normalize_event_hash,
    to_event_hash,
)
from events.model import BlockStored, is_prefix_group

from .instance import InstanceKey

UNVERIFIED = "unverified"
VERIFIED = "verified"
ADOPTED = "adopted"
MISMATCH = "mismatch"
UNTRUSTED = "untrusted"
TOKEN_KEYS = "token-keys"
STATES = (UNVERIFIED, VERIFIED, ADOPTED, MISMATCH, UNTRUSTED, TOKEN_KEYS)

DEFAULT_SCAN = range(65536)

FIX_HINT = (
    "start every engine with the same PYTHONHASHSEED (or leave it unset everywhere) and the "
    "same --prefix-caching-hash-algo (sha256 or sha256_cbor), and tell the router with "
    "--hash-algo and --hash-seed (spec §3.3)"
)


class Unreproducible(Exception):
    """The event cannot be recomputed (unknown LoRA path, lookahead keys, odd shape)."""


# --------------------------------------------------------------------------------------
# Rebuilding a block's hash input from an event


def event_block_extras(
    ev: BlockStored, style: str, lora_paths: Mapping[str, str] | None = None
) -> list[tuple | None]:
    """The extra-keys tuple of each block of ``ev`` in ``style``, from what the event carries.

    Events publish keys untagged (LoRA name, MM ``[id, offset]``, salt, embeds digest, in that
    order, spec §3.5); the tagged style of vLLM >= 0.31 also hashes the LoRA path, which the
    event does not carry, so it comes from ``lora_paths`` (the router's config).
    """
    n = len(ev.block_hashes)
    if ev.lookahead_token_ids:
        raise Unreproducible("lookahead extra keys")
    raw = ev.extra_keys
    if raw is None:
        raw = [None] * n
    if len(raw) != n:
        raise Unreproducible("extra_keys length differs from block_hashes")
    out: list[tuple | None] = []
    for keys in raw:
        if not keys:
            if ev.lora_name is not None:
                keys = [ev.lora_name]
            else:
                out.append(None)
                continue
        items: list[Any] = []
        rest = list(keys)
        if ev.lora_name is not None:
            if not rest or rest[0] != ev.lora_name:
                raise Unreproducible("LoRA name missing from extra keys")
            rest.pop(0)
            if style == "tagged":
                if lora_paths is None or ev.lora_name not in lora_paths:
                    raise Unreproducible(f"path of LoRA {ev.lora_name!r} unknown")
                items.append(("lora", ev.lora_name, lora_paths[ev.lora_name]))
            else:
                items.append(ev.lora_name)
        for k in rest:
            if isinstance(k, (list, tuple)):
                items.append(("mm", *k) if style == "tagged" else tuple(k))
            elif isinstance(k, str):
                items.append(("cache_salt", k) if style == "tagged" else k)
            elif isinstance(k, (bytes, bytearray)):
                items.append(("prompt_embeds", bytes(k)) if style == "tagged" else bytes(k))
            else:
                raise Unreproducible(f"unknown extra key {k!r}")
        out.append(tuple(items))
    return out


def recompute(
    ev: BlockStored,
    scheme: HashScheme,
    lora_paths: Mapping[str, str] | None = None,
    max_blocks: int | None = None,
) -> list[int]:
    """Event hashes of the event's first blocks under ``scheme`` (parent must be None)."""
    bs = ev.block_size
    if scheme.block_size != bs:
        raise Unreproducible(f"scheme block size {scheme.block_size} != event's {bs}")
    n = len(ev.block_hashes)
    if len(ev.token_ids) != n * bs:
        raise Unreproducible("token_ids do not cover exactly the event's blocks")
    extras = event_block_extras(ev, scheme.extra_key_style, lora_paths)
    k = n if max_blocks is None else min(n, max_blocks)
    parent: bytes | None = None
    out = []
    for i in range(k):
        parent = scheme.hash_block(parent, ev.token_ids[i * bs : (i + 1) * bs], extras[i])
        out.append(to_event_hash(parent))
    return out


def _matches(
    ev: BlockStored, scheme: HashScheme, lora_paths: Mapping[str, str] | None, max_blocks: int
) -> bool:
    got = recompute(ev, scheme, lora_paths, max_blocks)
    want = [normalize_event_hash(h) for h in ev.block_hashes[: len(got)]]
    return got == want


def candidate_schemes(
    base: HashScheme, seeds: Iterable[str | None], block_size: int
) -> list[HashScheme]:
    """Plausible schemes, most likely first: the base, then every algo x seed x style."""
    seen: list[HashScheme] = []
    first = replace(base, block_size=block_size)
    seen.append(first)
    seed_list: list[str | None] = [base.seed, None, *seeds]
    styles = [base.extra_key_style] + [
        s for s in ("tagged", "untagged") if s != base.extra_key_style
    ]
    algos = [base.algo] + [a for a in ALGORITHMS if a != base.algo]
    for algo in algos:
        for seed in seed_list:
            for style in styles:
                s = HashScheme(algo=algo, seed=seed, block_size=block_size, extra_key_style=style)
                if s not in seen:
                    seen.append(s)
    return seen


def scan_seeds(
    ev: BlockStored,
    algos: Sequence[str] = ALGORITHMS,
    seeds: Iterable[int] = DEFAULT_SCAN,
    extra_key_style: str = "tagged",
) -> HashScheme | None:
    """The PYTHONHASHSEED (as a decimal string) that reproduces block 0 of ``ev``, if any.

    Cheap on purpose: only block 0 (parent None, no extra keys), two sha256 per seed and
    algorithm with the constant parts of the hash input built once. CPU-bound (about a second
    for 65536 seeds and both algorithms): call it in a thread, off the event loop.
    """
    bs = ev.block_size
    if ev.parent_block_hash is not None or len(ev.token_ids) < bs or not ev.block_hashes:
        return None
    if (ev.extra_keys and ev.extra_keys[0]) or ev.lora_name is not None:
        return None
    want = normalize_event_hash(ev.block_hashes[0])
    tokens = [int(t) for t in ev.token_ids[:bs]]
    sha = hashlib.sha256
    seeds = list(seeds)
    for algo in algos:
        if algo == "sha256_cbor":
            tail = _cbor_tokens(tokens) + b"\xf6"
            head = b"\x83\x58\x20"
            for s in seeds:
                b = str(s).encode()
                nh = sha(_cbor_head(3, len(b)) + b).digest()
                if int.from_bytes(sha(head + nh + tail).digest()[-8:], "big") == want:
                    return HashScheme(algo, str(s), bs, extra_key_style)
        elif algo == "sha256":
            marker = b"\xa5" * 32
            tmpl = pickle.dumps((marker, tuple(tokens), None), protocol=5)
            pre, post = tmpl.split(marker)
            dumps = pickle.dumps
            for s in seeds:
                nh = sha(dumps(str(s), protocol=5)).digest()
                if int.from_bytes(sha(pre + nh + post).digest()[-8:], "big") == want:
                    return HashScheme(algo, str(s), bs, extra_key_style)
    return None


# --------------------------------------------------------------------------------------
# Per-instance tracking


@dataclass(slots=True)
class ParityVerdict:
    inst: InstanceKey
    ok: bool  # the event matched the scheme in use (after any adoption in this call)
    state: str
    scheme: HashScheme  # the scheme now in use for this instance
    found: HashScheme | None = None  # the engine's scheme, when a search found it
    changed: bool = False  # the state or scheme changed: log it
    needs_scan: bool = False  # run scan_seeds(ev) in a thread, then call apply_scan()
    message: str = ""


@dataclass(slots=True)
class _Inst:
    configured: HashScheme
    scheme: HashScheme
    state: str = UNVERIFIED
    matches: int = 0
    mismatches: int = 0
    found: HashScheme | None = None
    scan_event: BlockStored | None = None
    message: str = ""


class ParityTracker:
    """Parity state of every instance; pure logic, driven by ingest."""

    def __init__(
        self,
        configured: HashScheme,
        candidate_seeds: Iterable[str] = (),
        mode: str = "auto",
        lora_paths: Mapping[str, str] | None = None,
        check_blocks: int = 2,
        key_algo: str = "sha256_cbor",
    ) -> None:
        if mode not in ("auto", "fixed"):
            raise ValueError(f"hash scheme mode must be auto or fixed, got {mode!r}")
        self.configured = configured
        self.candidate_seeds = [str(s) for s in candidate_seeds]
        self.mode = mode
        self.lora_paths = dict(lora_paths or {})
        self.check_blocks = check_blocks
        self.key_algo = key_algo
        self._insts: dict[InstanceKey, _Inst] = {}

    def _get(self, inst: InstanceKey) -> _Inst:
        st = self._insts.get(inst)
        if st is None:
            st = self._insts[inst] = _Inst(self.configured, self.configured)
        return st

    def set_configured(self, inst: InstanceKey, scheme: HashScheme) -> None:
        """A per-engine scheme from the config (e.g. its own hash_seed)."""
        st = self._get(inst)
        st.configured = st.scheme = scheme

    # ---- queries

    def state(self, inst: InstanceKey) -> str:
        st = self._insts.get(inst)
        return UNVERIFIED if st is None else st.state

    def scheme(self, inst: InstanceKey) -> HashScheme:
        """The scheme the prompt side must hash with for this instance."""
        st = self._insts.get(inst)
        return self.configured if st is None else st.scheme

    def trusted(self, inst: InstanceKey) -> bool:
        return self.state(inst) in (UNVERIFIED, VERIFIED, ADOPTED, TOKEN_KEYS)

    def uses_token_keys(self, inst: InstanceKey) -> bool:
        return self.state(inst) == TOKEN_KEYS

    def counts(self, inst: InstanceKey) -> tuple[int, int]:
        st = self._insts.get(inst)
        return (0, 0) if st is None else (st.matches, st.mismatches)

    def message(self, inst: InstanceKey) -> str:
        st = self._insts.get(inst)
        return "" if st is None else st.message

    def scan_event(self, inst: InstanceKey) -> BlockStored | None:
        st = self._insts.get(inst)
        return None if st is None else st.scan_event

    def snapshot(self) -> dict[str, dict]:
        """Per instance: state, scheme, counts, message (for /debug and metrics)."""
        return {
            str(k): {
                "state": st.state,
                "scheme": st.scheme.describe(),
                "found": st.found.describe() if st.found else None,
                "matches": st.matches,
                "mismatches": st.mismatches,
                "message": st.message,
            }
            for k, st in sorted(self._insts.items())
        }

    # ---- updates

    def reset(self, inst: InstanceKey) -> None:
        """The engine restarted: its scheme may have changed, so verify again from scratch."""
        st = self._get(inst)
        st.scheme = st.configured
        st.state = UNVERIFIED
        st.found = None
        st.scan_event = None
        st.message = ""

    def forget(self, inst: InstanceKey) -> None:
        self._insts.pop(inst, None)

    def adopt(self, inst: InstanceKey, state: str, scheme: HashScheme, message: str = "") -> bool:
        """Take a verdict reached elsewhere (the replica that ingests this instance); True if
        it changed anything. Router replicas that do not ingest an instance learn its scheme
        this way instead of each re-running detection."""
        st = self._get(inst)
        if st.state == state and st.scheme == scheme:
            return False
        st.state = state
        st.scheme = scheme
        st.message = message
        st.scan_event = None
        return True

    def observe(self, inst: InstanceKey, ev: BlockStored) -> ParityVerdict | None:
        """Check one BlockStored; None when it cannot be checked (parent set, other group,
        LoRA path unknown, ...) or the instance already uses token-derived keys."""
        if ev.parent_block_hash is not None or not ev.block_hashes or not is_prefix_group(ev):
            return None
        st = self._get(inst)
        if st.state == TOKEN_KEYS:
            return None
        scheme = st.scheme
        if scheme.block_size != ev.block_size:
            ok = False
        else:
            try:
                ok = _matches(ev, scheme, self.lora_paths, self.check_blocks)
            except (Unreproducible, HashingError):
                return None
        if ok:
            st.matches += 1
            changed = False
            if st.state in (UNVERIFIED, MISMATCH):
                st.state = VERIFIED if scheme == st.configured else ADOPTED
                changed = True
            return ParityVerdict(inst, True, st.state, scheme, st.found, changed)
        st.mismatches += 1
        if st.state == UNTRUSTED and st.found is not None:
            # fixed mode: keep checking the engine against what we found, for the counters.
            return ParityVerdict(inst, False, st.state, scheme, st.found, False, False, st.message)
        found = self._search(ev, st)
        if found is not None:
            return self._resolved(inst, st, found)
        was = st.state
        st.state = MISMATCH
        plain = not (ev.extra_keys and ev.extra_keys[0]) and ev.lora_name is None
        if plain:
            st.scan_event = ev
        n = len(candidate_schemes(st.configured, self.candidate_seeds, ev.block_size))
        st.message = f"{inst}: block hashes match none of the {n} candidate schemes; " + (
            "scanning PYTHONHASHSEED values" if plain else "waiting for a plain block-0 event"
        )
        return ParityVerdict(
            inst, False, st.state, scheme, None, was != MISMATCH, plain, st.message
        )

    def apply_scan(self, inst: InstanceKey, found: HashScheme | None) -> ParityVerdict:
        """The result of ``scan_seeds`` for this instance's ``scan_event``."""
        st = self._get(inst)
        st.scan_event = None
        if found is not None:
            return self._resolved(
                inst, st, replace(found, extra_key_style=st.scheme.extra_key_style)
            )
        st.state = TOKEN_KEYS
        st.found = None
        st.scheme = self.key_scheme(st.scheme.block_size)
        st.message = (
            f"{inst}: the engine's block hashes cannot be reproduced (no algorithm, seed, "
            f"block size or key style tried matches, PYTHONHASHSEED 0-65535 included); "
            f"routing uses keys derived from the events' token ids instead, which only covers "
            f"chains stored from now on. Fix: {FIX_HINT}."
        )
        return ParityVerdict(inst, False, st.state, st.scheme, None, True, False, st.message)

    def key_scheme(self, block_size: int) -> HashScheme:
        """The router's own scheme for token-derived keys (router/keys.py): untagged keys, so
        that a LoRA's path, which events do not carry, is not needed."""
        return HashScheme(self.key_algo, None, block_size, "untagged")

    # ---- internals

    def _search(self, ev: BlockStored, st: _Inst) -> HashScheme | None:
        for cand in candidate_schemes(st.configured, self.candidate_seeds, ev.block_size):
            if cand == st.scheme:
                continue
            try:
                if _matches(ev, cand, self.lora_paths, self.check_blocks):
                    return cand
            except (Unreproducible, HashingError):
                continue
        return None

    def _resolved(self, inst: InstanceKey, st: _Inst, found: HashScheme) -> ParityVerdict:
        st.found = found
        cfg = st.configured
        if self.mode == "auto":
            st.scheme = found
            st.state = ADOPTED
            st.message = (
                f"{inst}: engine hashes blocks with {found.describe()}, not the configured "
                f"{cfg.describe()}; adopted it (--hash-scheme auto)"
            )
        else:
            st.state = UNTRUSTED
            st.message = (
                f"{inst}: engine hashes blocks with {found.describe()}, not the configured "
                f"{cfg.describe()}; its matches are not trusted (--hash-scheme fixed). "
                f"Fix: {FIX_HINT}, or use --hash-scheme auto."
            )
        return ParityVerdict(
            inst, self.mode == "auto", st.state, st.scheme, found, True, False, st.message
        )
