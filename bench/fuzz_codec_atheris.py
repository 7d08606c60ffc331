"""Coverage-guided fuzzing of the KV-event codec with atheris (libFuzzer), as a bench target.

Not in the default suite (needs ``pip install atheris``). Every input goes through
``decode_batch`` (the C fast path and the Python checks); the only exception allowed is
``CodecError``, and whatever decodes must re-encode to a batch that decodes the same. The seed
corpus is a few real vLLM-layout payloads (map and array layouts), so libFuzzer starts from
valid batches and mutates into the corners.

    .venv/bin/python -m bench.fuzz_codec_atheris -max_total_time=60
    .venv/bin/python -m bench.fuzz_codec_atheris -runs=200000
"""

from __future__ import annotations

import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from events.codec import CodecError, decode_batch, encode_batch
    from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def seed_corpus(path: str) -> None:
    events = [
        BlockStored(
            block_hashes=[1, 2**64 - 1],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            medium="GPU",
            extra_keys=[None, None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved(block_hashes=[7], medium="CPU"),
        AllBlocksCleared(),
    ]
    for i, layout in enumerate(("map", "array")):
        for j in range(len(events) + 1):
            b = KVEventBatch(ts=1.5 + j, events=events[:j], data_parallel_rank=j % 2 or None)
            with open(os.path.join(path, f"seed-{i}-{j}"), "wb") as f:
                f.write(encode_batch(b, layout=layout))


def test_one_input(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except CodecError:
        return
    once = encode_batch(batch)  # bytes, not batches: a NaN timestamp never equals itself
    twice = encode_batch(decode_batch(once))
    if once != twice:
        raise AssertionError(f"round trip changed the batch: {batch!r}")


def main() -> None:
    argv = list(sys.argv)
    if not any(not a.startswith("-") for a in argv[1:]):
        corpus = tempfile.mkdtemp(prefix="codec-corpus-")
        seed_corpus(corpus)
        argv.append(corpus)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
