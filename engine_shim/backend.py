"""The model step behind the scheduler, pluggable: simulated (default) or a real model.

The scheduler decides *what* to compute; a backend computes it and samples. The contract:

``ScheduledWork`` (one per scheduled request per step, in scheduling order):

* ``request_id``: stable for the request's life (also across preemptions);
* ``token_ids``: the tokens to compute this step, i.e. ``all_token_ids[start:start+n]``;
* ``start_position``: position of ``token_ids[0]``; equals ``num_computed_tokens``. Positions
  below it are already in the KV cache (earlier chunks, or prefix-cache hits written by
  *other* requests into shared blocks);
* ``block_ids``: the request's whole block table after this step's allocation; token at
  position p lives in block ``block_ids[p // block_size]``, slot ``p % block_size``. Block 0
  is the null block and never appears. Blocks may be shared (read-only) with other requests
  for positions below ``start_position``; positions >= ``start_position`` are always in blocks
  the request owns alone;
* ``num_computed_tokens``: same as ``start_position`` (vLLM's name);
* ``num_tokens``: the request's known tokens (prompt + output so far);
* ``needs_sample``: ``start_position + len(token_ids) == num_tokens``: the step reaches the
  last known token, so the backend must return the next token for this request;
* ``output_index``: how many output tokens the request has (the index of the token to sample);
* ``temperature``, ``seed``, ``sample_key`` (deterministic 64-bit key from prompt + seeds),
  ``eos_token_id``, ``eos_after`` (sim only, see sampler.py).

``Backend.execute(work) -> dict[str, int]``: the next token id for every work item with
``needs_sample``; items without it must be computed (their KV written) but return nothing.
``Backend.blocking``: True when execute does real compute; the engine then runs it in a
worker thread so the HTTP loop stays responsive. ``Backend.step_seconds(work)``: how long the
engine should wait after execute to emulate device time (the simulated backend's cost
model; real backends return 0.0). ``Backend.release(request_id)``: optional hook, called
when a request finishes, aborts or is preempted (its blocks go back to the pool; a real
backend must not keep reading them). ``Backend.close()``: optional.

A real backend module (``engine_shim.torch_backend``) exposes
``create_backend(config: BackendConfig) -> Backend``; ``--backend torch`` imports it lazily.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine_shim.cost_model import CostModel
from engine_shim.sampler import DeterministicSampler, word_token_pool


@dataclass(frozen=True, slots=True)
class ScheduledWork:
    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    num_computed_tokens: int
    num_tokens: int
    needs_sample: bool
    output_index: int = 0
    temperature: float = 1.0
    seed: int | None = None
    sample_key: int = 0
    eos_token_id: int | None = None
    eos_after: int | None = None

    @property
    def is_prefill(self) -> bool:
        """More than one token to compute: a prompt chunk or a recompute after preemption."""
        return len(self.token_ids) > 1


@dataclass
class BackendConfig:
    """Everything a backend may need to size itself; one per data-parallel rank."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    seed: int = 0
    time_scale: float = 1.0
    data_parallel_rank: int = 0
    tokenizer: Any = None
    eos_token_id: int | None = None
    model_path: str | None = None
    device: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    name: str
    blocking: bool

    def execute(self, work: Sequence[ScheduledWork]) -> dict[str, int]: ...

    def step_seconds(self, work: Sequence[ScheduledWork]) -> float: ...


class SimBackend:
    """No model: a cost model for time and a deterministic sampler for tokens."""

    name = "sim"
    blocking = False

    def __init__(self, config: BackendConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost or CostModel(time_scale=config.time_scale)
        self.sampler = DeterministicSampler(
            word_token_pool(config.tokenizer), eos_token_id=config.eos_token_id
        )

    def execute(self, work: Sequence[ScheduledWork]) -> dict[str, int]:
        return {
            w.request_id: self.sampler.sample(w.sample_key, w.output_index, w.eos_after)
            for w in work
            if w.needs_sample
        }

    def step_seconds(self, work: Sequence[ScheduledWork]) -> float:
        prefill = decode = context = 0
        for w in work:
            if w.is_prefill:
                prefill += len(w.token_ids)
            else:
                decode += 1
                context += w.start_position
        return self.cost.step_seconds(prefill, decode, context)

    def release(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class BackendUnavailable(RuntimeError):
    """The requested backend cannot be loaded (module missing, dependency missing)."""


BACKENDS = ("sim", "torch")


def create_backend(name: str, config: BackendConfig) -> Backend:
    if name == "sim":
        return SimBackend(config)
    if name == "torch":
        try:
            mod = importlib.import_module("engine_shim.torch_backend")
        except ModuleNotFoundError as e:
            raise BackendUnavailable(
                f"--backend torch needs engine_shim.torch_backend (and torch): {e}"
            ) from None
        factory = getattr(mod, "create_backend", None)
        if factory is None:
            raise BackendUnavailable("engine_shim.torch_backend has no create_backend(config)")
        return factory(config)
    raise BackendUnavailable(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
