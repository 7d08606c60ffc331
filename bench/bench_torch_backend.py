"""Prefill time of the torch backend against the prefix-hit fraction of a ~512-token prompt.

A hit means the prompt's first k blocks are already in the paged KV cache (written by an
earlier request), so the step computes only the remaining tokens and attends over the hit
blocks gathered by block id. For each hit fraction this writes the hit blocks once, then
times ``TorchBackend.execute`` on the rest (median of several runs), and checks that the
sampled token and the last-token logits equal the uncached prefill's, so the speed-up is
not bought with wrong answers. The floor is the uncached prefill measured in the same run.

    .venv/bin/python -m bench.bench_torch_backend [--prompt-tokens 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine_shim.backend import BackendConfig, ScheduledWork
from engine_shim.model_setup import convert_gguf_model
from engine_shim.torch_backend import TorchBackend
from engine_shim.torch_model import LlamaPagedModel, SeqInput

BS = 16
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def make_prompt(n: int) -> list[int]:
    """A real chat prompt of exactly n tokens (a long system prompt, cut to size)."""
    from events.tokenizer import encode_chat, load_tokenizer

    tok = load_tokenizer()
    para = (
        "The warehouse opens at six. Parcels over twenty kilograms go to dock four, fragile "
        "items to dock two, and returns are logged before noon. Drivers check tyre pressure "
        "every Monday and report delays to the dispatcher by radio. "
    )
    msgs = [
        {"role": "system", "content": para * (n // 40 + 2)},
        {"role": "user", "content": "Which dock takes fragile items?"},
    ]
    ids = encode_chat(tok, msgs)
    return ids[:n]


def hit_tokens(n: int, frac: float) -> int:
    """Whole blocks only, and never the last token (vLLM's cap): 'all' is all but a block."""
    return min(int(n * frac) // BS * BS, (n - 1) // BS * BS)


def run_tail(backend: TorchBackend, prompt: list[int], hit: int) -> tuple[float, int]:
    """One timed prefill of prompt[hit:] over hit blocks already in the cache."""
    n = len(prompt)
    table = list(range(1, -(-n // BS) + 1))
    work = ScheduledWork(
        "bench", prompt[hit:], hit, table, hit, n, needs_sample=True, temperature=0.0
    )
    t0 = time.perf_counter()
    tok = backend.execute([work])["bench"]
    return time.perf_counter() - t0, tok


def last_logits(backend: TorchBackend, prompt: list[int], hit: int) -> torch.Tensor:
    table = list(range(1, -(-len(prompt) // BS) + 1))
    return backend.model.forward([SeqInput(prompt[hit:], hit, table)], backend.cache)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_torch_backend", description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = ap.parse_args(argv)

    model = LlamaPagedModel.from_dir(convert_gguf_model())
    n = args.prompt_tokens
    cfg = BackendConfig(num_gpu_blocks=-(-n // BS) + 2, block_size=BS, max_model_len=n + 64)
    backend = TorchBackend(cfg, model=model, threads=args.threads)
    prompt = make_prompt(n)
    n = len(prompt)
    hits = [hit_tokens(n, f) for f in FRACTIONS]
    # The first (untimed) full prefill leaves every block of the prompt in the cache; a run
    # with hit h then recomputes positions >= h only, rewriting the same values in place.
    # Fractions are interleaved within each round so that noise from other processes on a
    # shared machine falls on all of them alike; min and median are both reported.
    run_tail(backend, prompt, 0)
    times: dict[int, list[float]] = {h: [] for h in hits}
    tokens: dict[int, int] = {}
    for _ in range(args.repeats):
        for h in hits:
            t, tokens[h] = run_tail(backend, prompt, h)
            times[h].append(t)
    base_logits = last_logits(backend, prompt, 0)
    base_min, base_med = min(times[0]), statistics.median(times[0])
    rows = []
    for h in hits:
        lg = last_logits(backend, prompt, h)
        rows.append(
            {
                "hit_fraction": round(h / n, 4),
                "hit_tokens": h,
                "computed_tokens": n - h,
                "prefill_ms_min": round(min(times[h]) * 1e3, 2),
                "prefill_ms_median": round(statistics.median(times[h]) * 1e3, 2),
                "speedup_vs_uncached": round(base_min / min(times[h]), 2),
                "speedup_median": round(base_med / statistics.median(times[h]), 2),
                "ideal_speedup": round(n / (n - h), 2),
                "same_token": tokens[h] == tokens[0],
                "max_logit_diff": float((lg - base_logits).abs().max()),
            }
        )
    result = {
        "prompt_tokens": n,
        "block_size": BS,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"torch backend prefill, SmolLM2-135M fp32, {n}-token prompt, "
            f"{args.threads} thread(s), {args.repeats} rounds (speed-up from the min times)"
        )
        print(
            f"{'hit %':>6} {'hit tok':>8} {'computed':>9} {'min ms':>8} {'median ms':>10} "
            f"{'speed-up':>9} {'ideal':>6} {'same tok':>9} {'max |dlogit|':>13}"
        )
        for r in rows:
            print(
                f"{100 * r['hit_fraction']:6.1f} {r['hit_tokens']:8d} {r['computed_tokens']:9d} "
                f"{r['prefill_ms_min']:8.1f} {r['prefill_ms_median']:10.1f} "
                f"{r['speedup_vs_uncached']:8.2f}x "
                f"{r['ideal_speedup']:5.1f}x {r['same_token']!s:>9} {r['max_logit_diff']:13.2e}"
            )
    return 0 if all(r["same_token"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
