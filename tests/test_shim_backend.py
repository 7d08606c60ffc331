"""The backend contract: what a backend is asked to compute, and the simulated cost of it."""

from __future__ import annotations

import pytest

from engine_shim.backend import (
    BackendConfig,
    BackendUnavailable,
    ScheduledWork,
    SimBackend,
    create_backend,
)
from engine_shim.engine import EngineConfig, EngineCore
from engine_shim.request import Request
from engine_shim.testing import wait_until


class RecordingBackend(SimBackend):
    """The simulated backend, keeping every step's work for inspection."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.steps: list[list[ScheduledWork]] = []

    def execute(self, work):
        self.steps.append(list(work))
        return super().execute(work)


async def test_work_items_carry_positions_and_block_tables():
    cfg = EngineConfig(num_gpu_blocks=32, max_model_len=256, time_scale=0.0)
    backend = RecordingBackend(BackendConfig(32, 16, 256, time_scale=0.0))
    engine = EngineCore(cfg, backend=backend)
    await engine.start()
    try:
        q = engine.add_request(Request("a", list(range(1, 41)), max_tokens=2))
        while not (await q.get()).finished:
            pass
        q = engine.add_request(Request("b", list(range(1, 41)), max_tokens=1))
        await q.get()
        await wait_until(lambda: engine.load == 0)
    finally:
        await engine.stop()
    a0, a1 = backend.steps[0][0], backend.steps[1][0]
    assert (a0.start_position, len(a0.token_ids), a0.needs_sample, a0.output_index) == (
        0,
        40,
        True,
        0,
    )
    assert a0.block_ids == [1, 2, 3] and a0.is_prefill
    assert (a1.start_position, a1.token_ids, a1.num_tokens, a1.output_index) == (
        40,
        a1.token_ids,
        41,
        1,
    )
    assert len(a1.token_ids) == 1 and not a1.is_prefill
    b0 = backend.steps[2][0]
    # b hit a's two full blocks: only the last 8 prompt tokens are computed, into a fresh
    # block: a's unhashed tail block 3, which a's free put at the front of the queue.
    assert (b0.start_position, b0.token_ids) == (32, list(range(33, 41)))
    assert b0.block_ids == [1, 2, 3]


def test_sim_cost_model_charges_only_computed_tokens():
    be = SimBackend(BackendConfig(32, 16, 256, time_scale=1.0))
    cold = ScheduledWork("r", list(range(640)), 0, list(range(1, 41)), 0, 640, True)
    warm = ScheduledWork("r", list(range(128)), 512, list(range(1, 41)), 512, 640, True)
    assert be.step_seconds([warm]) < be.step_seconds([cold]) / 3
    assert SimBackend(BackendConfig(32, 16, 256, time_scale=0.0)).step_seconds([cold]) == 0.0
    assert be.execute([cold]) == be.execute([cold])  # deterministic


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="unknown backend"):
        create_backend("tpu", BackendConfig(32, 16, 256))
