"""``--backend torch``: SmolLM2-135M computing every scheduled token over a paged KV cache.

The simulated backend only shows timing; this one proves the bookkeeping. Its KV memory is
indexed by the very block ids the shim's block pool hands out, so a prefix hit reads KV that
an earlier request wrote, and a wrong block id changes the text. It runs on the CPU with one
thread by default (``torch.set_num_threads(1)``) so that several shims share a small machine.

Sampling follows vLLM: greedy when the temperature is (near) zero; otherwise softmax
sampling at that temperature. A request with a ``seed`` samples from a generator seeded by
the shim's per-request ``sample_key`` (prompt + seed + engine seed) and the output index, so
its output is reproducible whatever else shares the batch and even across preemption; an
unseeded request draws from one engine-wide generator seeded by the engine's ``--seed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_shim.backend import BackendConfig, ScheduledWork
from engine_shim.model_setup import require_model_dir
from engine_shim.torch_model import LlamaPagedModel, PagedKVCache, SeqInput

GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below this temperature sampling is greedy
DEFAULT_THREADS = 1
# The KV pool is float32: ~0.72 MiB per 16-token block for SmolLM2-135M. torch.empty commits
# pages only when written, but refuse sizes that could never be backed, with a clear message.
DEFAULT_MAX_KV_BYTES = 8 << 30

_MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix(key: int, index: int) -> int:
    """splitmix64 of (key, index): an independent 63-bit seed for each output position."""
    x = (key ^ (index * 0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


class TorchBackend:
    """Implements engine_shim.backend.Backend with a real model (see the module docstring)."""

    name = "torch"
    blocking = True

    def __init__(
        self,
        config: BackendConfig,
        model: LlamaPagedModel | None = None,
        threads: int | None = None,
    ) -> None:
        if config.device not in (None, "cpu"):
            raise ValueError(f"the torch backend runs on the CPU only, not {config.device!r}")
        threads = threads or int(config.extra.get("threads", DEFAULT_THREADS))
        torch.set_num_threads(threads)
        self.config = config
        self.model = model or LlamaPagedModel.from_dir(require_model_dir(config.model_path))
        mcfg = self.model.config
        if config.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"{mcfg.max_position_embeddings} positions"
            )
        per_block = 2 * mcfg.num_layers * mcfg.num_kv_heads * config.block_size * mcfg.head_dim * 4
        limit = int(config.extra.get("max_kv_bytes", DEFAULT_MAX_KV_BYTES))
        if per_block * config.num_gpu_blocks > limit:
            raise ValueError(
                f"{config.num_gpu_blocks} KV blocks need {per_block * config.num_gpu_blocks >> 20}"
                f" MiB (limit {limit >> 20} MiB); lower --num-gpu-blocks for --backend torch"
            )
        self.cache: PagedKVCache | None = self.model.new_cache(
            config.num_gpu_blocks, config.block_size
        )
        self._generator = torch.Generator().manual_seed(config.seed)
        self.steps = 0
        self.tokens_computed = 0

    def execute(self, work: Sequence[ScheduledWork]) -> dict[str, int]:
        """Compute every scheduled token (writing its KV) and sample where the step asks."""
        cache = self.cache
        if cache is None:
            raise RuntimeError("the torch backend is closed")
        if not work:
            return {}
        seqs = [
            SeqInput(
                token_ids=list(w.token_ids),
                start=w.start_position,
                block_table=list(w.block_ids),
                want_logits=w.needs_sample,
            )
            for w in work
        ]
        logits = self.model.forward(seqs, cache)
        self.steps += 1
        self.tokens_computed += sum(len(s.token_ids) for s in seqs)
        return {
            w.request_id: self._sample(w, lg)
            for w, lg in zip(work, logits, strict=True)
            if w.needs_sample and lg is not None
        }

    def _sample(self, w: ScheduledWork, logits: torch.Tensor) -> int:
        if w.temperature < GREEDY_EPS:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / w.temperature, dim=-1)
        if w.seed is None:
            gen = self._generator
        else:
            gen = torch.Generator().manual_seed(_mix(w.sample_key, w.output_index))
        return int(torch.multinomial(probs, 1, generator=gen))

    def step_seconds(self, work: Sequence[ScheduledWork]) -> float:
        return 0.0  # the compute itself took the time

    def release(self, request_id: str) -> None:
        """Nothing to drop: KV lives in pool blocks, and seeded sampling keeps no state."""

    def close(self) -> None:
        """Drop the KV pool. A step still running in the engine's worker thread keeps its
        own reference and finishes; later steps are refused."""
        self.cache = None


def create_backend(config: BackendConfig) -> TorchBackend:
    """Entry point used by ``engine_shim.backend.create_backend('torch', ...)``."""
    return TorchBackend(config)
