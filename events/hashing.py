"""vLLM's prefix-cache block-hash chain, recomputed outside the engine.

The router can only look a prompt up in the index if it names each block exactly as the
engine did, so everything here reproduces vLLM 0.33 bit for bit (spec §3): the hash of
block i is ``H((parent_digest, tuple(tokens_of_block_i), extra_keys))`` where the parent of
block 0 is NONE_HASH, and the event hash is the digest's low 64 bits.

``sha256_cbor`` is the hot path: instead of calling ``cbor2.dumps`` once per block (about
6x the cost of the bare sha256 calls) we write the canonical CBOR bytes ourselves from a
table of pre-encoded token ids, and keep cbor2 only for the rare extra keys.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import cbor2

Algo = Literal["sha256_cbor", "sha256"]
ExtraKeyStyle = Literal["tagged", "untagged"]

ALGORITHMS: tuple[str, ...] = ("sha256_cbor", "sha256")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
U64_MASK = (1 << 64) - 1
_PICKLE_PROTOCOL = 5


class HashingError(ValueError):
    """A hash scheme was asked for something vLLM cannot hash (unknown algorithm, bad input)."""


# --------------------------------------------------------------------------------------
# Canonical CBOR, written by hand for the shapes vLLM hashes.


def _cbor_head(major: int, n: int) -> bytes:
    """The initial bytes of a CBOR item with the smallest argument encoding (canonical)."""
    mt = major << 5
    if n < 24:
        return bytes((mt | n,))
    if n < 0x100:
        return bytes((mt | 24, n))
    if n < 0x10000:
        return bytes((mt | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((mt | 26,)) + n.to_bytes(4, "big")
    return bytes((mt | 27,)) + n.to_bytes(8, "big")


def _cbor_int(n: int) -> bytes:
    if n >= 0:
        return _cbor_head(0, n)
    return _cbor_head(1, -1 - n)


# Token ids are small non-negative ints; a table of their encodings turns the per-token
# work into one list index. 2**18 covers every vocabulary in use today; larger ids fall
# back to _cbor_int.
_TOKEN_TABLE_SIZE = 1 << 18
_token_table: list[bytes] | None = None


def _table() -> list[bytes]:
    global _token_table
    if _token_table is None:
        t = [bytes((i,)) for i in range(24)]
        t += [b"\x18" + bytes((i,)) for i in range(24, 0x100)]
        t += [b"\x19" + i.to_bytes(2, "big") for i in range(0x100, 0x10000)]
        pack = struct.Struct(">BI").pack
        t += [pack(0x1A, i) for i in range(0x10000, _TOKEN_TABLE_SIZE)]
        _token_table = t
    return _token_table


def _cbor_tokens(tokens: Sequence[int]) -> bytes:
    table = _table()
    try:
        body = b"".join([table[t] for t in tokens])
    except (IndexError, TypeError):
        body = b"".join(_cbor_int(int(t)) for t in tokens)
    else:
        if min(tokens, default=0) < 0:  # negative indexes would silently wrap
            body = b"".join(_cbor_int(int(t)) for t in tokens)
    return _cbor_head(4, len(tokens)) + body


# Below this many blocks numpy's fixed cost per call outweighs what it saves.
_NUMPY_MIN_BLOCKS = 32


def _cbor_block_bodies(tokens: Sequence[int], bs: int) -> list[bytes] | None:
    """CBOR of ``[tokens of block i]`` followed by null, for every full block, vectorised.

    Each token is laid out as a big-endian u64 holding its minimal CBOR bytes left-aligned
    (header byte, then 0, 1, 2 or 4 value bytes); a gather keeps the first 1/2/3/5 bytes of
    each. Returns None when numpy is missing or a token is not in [0, 2**32).
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with transformers
        return None
    n = len(tokens)
    nb = n // bs
    if array("I").itemsize != 4:  # pragma: no cover - 4 on every platform we run on
        return None
    try:
        a = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError, ValueError):
        return None
    c1 = (a >= 24).view(np.uint8)
    c3 = (a >= 65536).view(np.uint8)
    cls = c1 + (a >= 256).view(np.uint8) + c3  # 0: 1 byte, 1: 2, 2: 3, 3: 5
    arr = _cbor_head(4, bs)
    w = bs + 2  # array header, the tokens, the null extra keys
    u = np.empty((nb, w), dtype=">u8")
    shift = np.array([56, 48, 40, 24], dtype=np.uint64).take(cls)
    hdr = np.array([0, 0x18 << 56, 0x19 << 56, 0x1A << 56], dtype=np.uint64).take(cls)
    u[:, 1:-1] = ((a.astype(np.uint64) << shift) | hdr).reshape(nb, bs)
    u[:, 0] = int.from_bytes(arr.ljust(8, b"\0"), "big")
    u[:, -1] = 0xF6 << 56
    lens = np.empty((nb, w), dtype=np.int32)
    lens[:, 1:-1] = (cls + c3 + 1).reshape(nb, bs)
    lens[:, 0] = len(arr)
    lens[:, -1] = 1
    lens = lens.ravel()
    ends = np.cumsum(lens, dtype=np.int32)
    # Byte k of the output comes from row r at column k - start(r): a repeat + arange gather.
    offset = np.arange(0, 8 * lens.size, 8, dtype=np.int32) - (ends - lens)
    gather = np.repeat(offset, lens)
    gather += np.arange(int(ends[-1]), dtype=np.int32)
    flat = u.view(np.uint8).ravel().take(gather).tobytes()
    cuts = ends[w - 1 :: w].tolist()
    out = []
    start = 0
    for end in cuts:
        out.append(flat[start:end])
        start = end
    return out


def _cbor_extra(extra: tuple | None) -> bytes:
    if extra is None:
        return b"\xf6"
    return cbor2.dumps(extra, canonical=True)


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: sha256 of the canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: sha256 of the pickle (protocol 5) of the object."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


_HASH_FNS = {"sha256_cbor": sha256_cbor, "sha256": sha256_pickle}


def hash_fn(algo: str):
    """The generic hash function of an algorithm name (as vLLM's get_hash_fn_by_name)."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise HashingError(
            f"unsupported hash algorithm {algo!r}; the router reproduces {', '.join(ALGORITHMS)}"
        ) from None


def none_hash(algo: str, seed: str | None) -> bytes:
    """NONE_HASH, the parent of block 0 (vLLM >= 0.29, spec §3.3).

    ``seed`` is PYTHONHASHSEED as the engine saw it; None means it was unset, in which case
    vLLM hashes the fixed string "vllm-none-hash".
    """
    return hash_fn(algo)(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def to_event_hash(digest: bytes) -> int:
    """Fold a full digest to the int that vLLM puts in events: the last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def normalize_event_hash(h: int | bytes) -> int:
    """Any hash an engine may send (u64, signed i64, raw digest bytes) as an unsigned u64."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(h)[-8:], "big")
    return h & U64_MASK


# --------------------------------------------------------------------------------------
# Extra keys


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter as vLLM hashes it: the name always, the path from 0.31 on."""

    name: str
    path: str = ""


def embeds_block_digest(embeds_bytes: bytes) -> bytes:
    """The per-block prompt-embeddings key: sha256 of the block's raw tensor bytes."""
    return hashlib.sha256(embeds_bytes).digest()


def block_extra_keys(
    block_index: int,
    style: ExtraKeyStyle,
    cache_salt: str | None = None,
    lora: LoRA | None = None,
    embeds_digest: bytes | None = None,
) -> tuple | None:
    """The extra-keys tuple vLLM mixes into one block's hash (order: LoRA, salt, embeds)."""
    keys: list[Any] = []
    if lora is not None:
        keys.append(("lora", lora.name, lora.path) if style == "tagged" else lora.name)
    if cache_salt and block_index == 0:
        keys.append(("cache_salt", cache_salt) if style == "tagged" else cache_salt)
    if embeds_digest is not None:
        keys.append(("prompt_embeds", embeds_digest) if style == "tagged" else embeds_digest)
    return tuple(keys) if keys else None


def event_extra_keys(extra: tuple | None) -> list | None:
    """What vLLM >= 0.31 publishes in ``BlockStored.extra_keys`` for one block: tags stripped."""
    if extra is None:
        return None
    out: list[Any] = []
    for k in extra:
        if isinstance(k, tuple) and k and k[0] in ("lora", "cache_salt", "prompt_embeds"):
            out.append(k[1])
        elif isinstance(k, tuple) and k and k[0] == "mm":
            out.append(list(k[1:]))
        else:
            out.append(k)
    return out


# --------------------------------------------------------------------------------------
# The scheme


@dataclass(frozen=True)
class HashScheme:
    """How one engine names its blocks: (algorithm, NONE_HASH seed, block size, key style).

    Frozen and hashable so that the router can keep one per instance and compare candidates.
    """

    algo: str = "sha256_cbor"
    seed: str | None = None
    block_size: int = 16
    extra_key_style: ExtraKeyStyle = "tagged"
    _none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise HashingError(f"block_size must be positive, got {self.block_size}")
        if self.extra_key_style not in ("tagged", "untagged"):
            raise HashingError(
                f"extra_key_style must be tagged or untagged, got {self.extra_key_style!r}"
            )
        object.__setattr__(self, "_none_hash", none_hash(self.algo, self.seed))

    @classmethod
    def from_env(cls, algo: str = "sha256_cbor", block_size: int = 16) -> HashScheme:
        """The scheme a vLLM 0.33 engine started with this process's environment would use."""
        return cls(algo=algo, seed=os.environ.get("PYTHONHASHSEED"), block_size=block_size)

    @property
    def none_hash(self) -> bytes:
        return self._none_hash

    def describe(self) -> str:
        seed = "unset" if self.seed is None else repr(self.seed)
        return f"{self.algo}, PYTHONHASHSEED={seed}, block_size={self.block_size}, extra keys {self.extra_key_style}"

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra: tuple | None = None
    ) -> bytes:
        """The full digest of one block given its parent's digest (None for block 0)."""
        parent = parent or self._none_hash
        if self.algo == "sha256_cbor":
            data = (
                b"\x83"
                + _cbor_head(2, len(parent))
                + parent
                + _cbor_tokens(tokens)
                + _cbor_extra(extra)
            )
            return hashlib.sha256(data).digest()
        if self.algo == "sha256":
            return sha256_pickle((parent, tuple(tokens), extra))
        raise HashingError(f"unsupported hash algorithm {self.algo!r}")

    def block_digests(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: LoRA | None = None,
        embeds_digests: Sequence[bytes] | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Full digests of every full block of ``token_ids`` (a trailing partial block is not hashed).

        ``parent``/``start_block`` continue a chain already computed for the first blocks,
        which is how an engine extends a request's hashes as generated tokens fill blocks.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        out: list[bytes] = []
        plain = cache_salt is None and lora is None and embeds_digests is None
        if plain and self.algo == "sha256_cbor":
            return self._plain_cbor_chain(token_ids, n_full, parent, start_block)
        for i in range(start_block, n_full):
            extra = block_extra_keys(
                i,
                self.extra_key_style,
                cache_salt=cache_salt,
                lora=lora,
                embeds_digest=None if embeds_digests is None else embeds_digests[i],
            )
            parent = self.hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra)
            out.append(parent)
        return out

    def _plain_cbor_chain(
        self, token_ids: Sequence[int], n_full: int, parent: bytes | None, start_block: int
    ) -> list[bytes]:
        """The hot loop: no extra keys, sha256_cbor, digests of 32 bytes.

        Long prompts get their CBOR token bytes from numpy in a few vectorised passes (the
        per-token table lookups cost more than the sha256 calls); short ones, and inputs
        numpy cannot take, use the table.
        """
        bs = self.block_size
        sha = hashlib.sha256
        head = b"\x83\x58\x20"
        digest = parent or self._none_hash
        if len(digest) != 32:
            return self._generic_chain(token_ids, n_full, parent, start_block)
        out: list[bytes] = []
        append = out.append
        if n_full - start_block >= _NUMPY_MIN_BLOCKS:
            bodies = _cbor_block_bodies(token_ids[start_block * bs : n_full * bs], bs)
            if bodies is not None:
                for body in bodies:
                    digest = sha(head + digest + body).digest()
                    append(digest)
                return out
        table = _table()
        arr = _cbor_head(4, bs)
        tail = b"\xf6"
        join = b"".join
        try:
            if token_ids and (min(token_ids) < 0):
                raise IndexError
            # Encode every token once at C speed (map), then hash block by block.
            enc = list(map(table.__getitem__, token_ids[start_block * bs : n_full * bs]))
            for j in range(0, len(enc), bs):
                digest = sha(join((head, digest, arr, *enc[j : j + bs], tail))).digest()
                append(digest)
        except (IndexError, TypeError):
            return self._generic_chain(token_ids, n_full, parent, start_block)
        return out

    def _generic_chain(
        self, token_ids: Sequence[int], n_full: int, parent: bytes | None, start_block: int
    ) -> list[bytes]:
        bs = self.block_size
        out = []
        for i in range(start_block, n_full):
            parent = self.hash_block(parent, [int(t) for t in token_ids[i * bs : (i + 1) * bs]])
            out.append(parent)
        return out

    def block_hashes(self, token_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """Event hashes (u64) of every full block: what the router looks up in the index."""
        fold = int.from_bytes  # to_event_hash, inlined: this runs once per prompt block
        return [fold(d[-8:], "big") for d in self.block_digests(token_ids, **kwargs)]


def prompt_embeds_digests(embeds: Any, block_size: int) -> list[bytes]:
    """Per-block digests of a prompt-embeddings tensor (shape [num_tokens, hidden]).

    vLLM hashes the raw bytes of each full block's slice, so the tensor's dtype and layout
    matter: the slice is made contiguous on the CPU before its bytes are read.
    """
    n_full = int(embeds.shape[0]) // block_size
    out = []
    for i in range(n_full):
        part = embeds[i * block_size : (i + 1) * block_size]
        out.append(embeds_block_digest(_tensor_bytes(part)))
    return out


def _tensor_bytes(t: Any) -> bytes:
    import torch  # optional dependency, only for prompt embeddings

    # Same bytes as vLLM's tensor_data(): flattened, on the CPU, contiguous, viewed as uint8.
    return t.detach().flatten().cpu().contiguous().view(torch.uint8).numpy().tobytes()
