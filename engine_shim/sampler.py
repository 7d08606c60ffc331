"""Deterministic output tokens for the simulated backend.

The same prompt (and seed) always yields the same continuation, like greedy decoding on a
real model: multi-turn conversations replayed by tests and benchmarks then send the same
tokens, so prefix hits are reproducible. Tokens come from a pool of ordinary word pieces
(no special or control tokens), so the detokenized text is plain words.

EOS: the simulated model never emits EOS by itself, so outputs run to ``max_tokens``
(deterministic lengths for benchmarks). A request can ask for a natural stop with
``vllm_xargs: {"eos_after": N}``: token N (0-based) is then the EOS id, which ends the
request with finish_reason "stop" unless ``ignore_eos`` is true.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Any

_WORD = re.compile(r"^Ġ[a-z]{2,10}$")
FALLBACK_POOL = tuple(range(1000, 2000))


def word_token_pool(tokenizer: Any | None, limit: int = 4096) -> tuple[int, ...]:
    """Ids of whole lowercase words with a leading space (Ġword), so the text reads as words."""
    if tokenizer is None:
        return FALLBACK_POOL
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = []
    vocab = tokenizer.get_vocab()
    for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
        if tid in special or not _WORD.match(piece):
            continue
        pool.append(tid)
        if len(pool) >= limit:
            break
    return tuple(pool) or FALLBACK_POOL


def sample_key(prompt_token_ids: Sequence[int], seed: int | None, engine_seed: int) -> int:
    """A 64-bit key for one request's continuation: prompt content plus seeds."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qq", engine_seed, -1 if seed is None else seed))
    h.update(struct.pack(f"<{len(prompt_token_ids)}I", *(t & 0xFFFFFFFF for t in prompt_token_ids)))
    return int.from_bytes(h.digest(), "little")


class DeterministicSampler:
    def __init__(
        self, pool: Sequence[int] = FALLBACK_POOL, eos_token_id: int | None = None
    ) -> None:
        if not pool:
            raise ValueError("empty token pool")
        self.pool = tuple(pool)
        self.eos_token_id = eos_token_id

    def sample(self, key: int, output_index: int, eos_after: int | None = None) -> int:
        if eos_after is not None and output_index >= eos_after and self.eos_token_id is not None:
            return self.eos_token_id
        x = (key ^ (output_index * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
        # splitmix64 finaliser: cheap and well mixed.
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
        return self.pool[x % len(self.pool)]
