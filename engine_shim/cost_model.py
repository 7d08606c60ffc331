"""How long a real GPU would take for one scheduler step, so the shim's timing is believable.

Step time = fixed overhead + prefill tokens x per-token prefill cost + decode sequences x
per-sequence decode cost + context tokens read by decodes x attention cost.

Defaults stand for Llama-3.1-8B in bf16 on one H100-80GB (vLLM, CUDA graphs), from
published vLLM benchmarks and the usual roofline estimates:

* ``step_overhead_s = 6 ms``: a decode step of a small batch is memory bound: 16 GB of
  weights read at ~3 TB/s is ~5.5 ms, plus scheduling;
* ``prefill_token_s = 60 us``: prefill is compute bound at ~2 x 8e9 FLOP per token; at
  ~40 % of ~1 PFLOP/s that is ~16 k tokens/s, i.e. ~60 us per token;
* ``decode_seq_s = 40 us``: each extra sequence in a decode batch adds sampling, small GEMM
  rows and bookkeeping; batches of 64 decode in ~9 ms;
* ``context_token_s = 10 ns``: attention reads 128 KB of KV per token of context (32
  layers x 8 KV heads x 128 dims x 2 x bf16) at ~3 TB/s: ~40 ns, amortised over 4 heads.

A prefix hit skips its tokens' prefill cost entirely, which is what the router buys.
``time_scale`` multiplies every figure: 1.0 = real time, 0.1 = ten times faster, 0 = no
waiting at all (pure shim overhead, for benchmarks of the router).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    step_overhead_s: float = 0.006
    prefill_token_s: float = 60e-6
    decode_seq_s: float = 40e-6
    context_token_s: float = 10e-9
    time_scale: float = 1.0

    def step_seconds(
        self, prefill_tokens: int, decode_seqs: int, decode_context_tokens: int = 0
    ) -> float:
        """Simulated wall time of one step (already multiplied by ``time_scale``)."""
        if self.time_scale <= 0 or (prefill_tokens == 0 and decode_seqs == 0):
            return 0.0
        t = (
            self.step_overhead_s
            + prefill_tokens * self.prefill_token_s
            + decode_seqs * self.decode_seq_s
            + decode_context_tokens * self.context_token_s
        )
        return t * self.time_scale
