"""The engine loop of one data-parallel rank: scheduler steps driven by asyncio.

Each rank owns a KV-cache manager, a scheduler, a backend and (optionally) a KV-event
publisher, like one vLLM EngineCore. The loop sleeps while idle and wakes on a new request,
an abort or a cache reset. HTTP handlers talk to it through ``add_request`` (which returns
an asyncio queue of RequestOutput) and ``abort``.

Deviation from vLLM, on purpose: after a successful ``reset_prefix_cache`` the loop runs
an empty step at once, so AllBlocksCleared is published even on an idle engine (vLLM
publishes it with the next real step; router tests would otherwise wait forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine_shim.backend import Backend, BackendConfig, ScheduledWork, create_backend
from engine_shim.kv_cache_manager import KVCacheManager, cdiv
from engine_shim.metrics import EngineMetrics
from engine_shim.request import Request, RequestStatus
from engine_shim.sampler import sample_key
from engine_shim.scheduler import RequestOutput, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    num_gpu_blocks: int = 2048
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None  # PYTHONHASHSEED as the engine sees it; None = unset
    enable_prefix_caching: bool = True
    enable_kv_cache_events: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    seed: int = 0
    time_scale: float = 1.0
    backend: str = "sim"
    model_path: str | None = None  # weights directory for a real backend (None: its default)

    def validate(self) -> None:
        if self.block_size <= 0 or self.num_gpu_blocks < 2:
            raise ValueError("need block_size > 0 and num_gpu_blocks >= 2")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        capacity = (self.num_gpu_blocks - 1) * self.block_size
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the KV cache can hold "
                f"({capacity} tokens in {self.num_gpu_blocks - 1} blocks); lower --max-model-len "
                "or raise --num-gpu-blocks"
            )
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")


class EngineError(Exception):
    """A request the engine cannot serve (too long, engine stopped)."""


class AbortedError(Exception):
    """The request was aborted (client gone, engine stopping)."""


_ABORTED = object()


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        publisher: Any = None,
        backend: Backend | None = None,
        tokenizer: Any = None,
        eos_token_id: int | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.rank = rank
        self.publisher = publisher
        self.metrics = metrics
        self.eos_token_id = eos_token_id
        self.kv = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            enable_caching=config.enable_prefix_caching,
            enable_kv_cache_events=config.enable_kv_cache_events,
            max_model_len=config.max_model_len,
        )
        self.scheduler = Scheduler(
            self.kv,
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
            ),
            publish=publisher.publish if publisher is not None else None,
            data_parallel_rank=rank,
        )
        self.backend = backend or create_backend(
            config.backend,
            BackendConfig(
                num_gpu_blocks=config.num_gpu_blocks,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
                seed=config.seed,
                time_scale=config.time_scale,
                data_parallel_rank=rank,
                tokenizer=tokenizer,
                eos_token_id=eos_token_id,
                model_path=config.model_path,
            ),
        )
        self._streams: dict[str, asyncio.Queue] = {}
        self._first_token_pending: dict[str, float] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._flush_requested = False
        self._stopping = False
        self.num_steps = 0

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name=f"engine-dp{self.rank}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for rid in list(self._streams):
            self.abort(rid)
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- requests -------------------------------------------------------------------------

    @property
    def load(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    def add_request(self, request: Request) -> asyncio.Queue:
        """Queue a request; its outputs (RequestOutput, then the end) arrive on the queue."""
        if self._stopping:
            raise EngineError("engine is stopping")
        cfg = self.config
        if request.num_prompt_tokens == 0:
            raise EngineError("the prompt is empty")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise EngineError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your request has {request.num_prompt_tokens} input tokens. Please reduce the "
                "length of the input messages."
            )
        assert cdiv(cfg.max_model_len, cfg.block_size) <= cfg.num_gpu_blocks - 1
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        request.sample_key = sample_key(request.prompt_token_ids, request.seed, cfg.seed)
        q: asyncio.Queue = asyncio.Queue()
        self.scheduler.add_request(request)
        self._streams[request.request_id] = q
        self._first_token_pending[request.request_id] = time.monotonic()
        self._poke()
        return q

    def abort(self, request_id: str) -> bool:
        """End a request now (client gone): its blocks go back to the pool at once."""
        q = self._streams.pop(request_id, None)
        self._first_token_pending.pop(request_id, None)
        req = self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if req is not None:
            self._release(request_id)
            if self.metrics is not None:
                self.metrics.success["abort"].inc()
        if q is not None:
            q.put_nowait(_ABORTED)
        self._poke()
        return req is not None

    def preempt_all(self) -> None:
        for rid in self.scheduler.preempt_all():
            self._release(rid)
        self._poke()

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        if ok:
            self._flush_requested = True
            self._poke()
        return ok

    def _release(self, request_id: str) -> None:
        release = getattr(self.backend, "release", None)
        if release is not None:
            release(request_id)

    # -- the loop -------------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if self._flush_requested:
                self._flush_requested = False
                self.scheduler.flush_events()
            if not self.scheduler.has_unfinished_requests():
                self._update_gauges()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                progressed = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("engine step failed on rank %d; aborting its requests", self.rank)
                for rid in list(self._streams):
                    self.abort(rid)
                continue
            if not progressed:
                # Nothing fits right now (blocks held by requests that wait on nothing):
                # wait for an abort or a new request to change the picture.
                self._wake.clear()
                await self._wake.wait()

    def _build_work(self, so) -> list[ScheduledWork]:
        work = []
        for req, n in so.scheduled:
            start = req.num_computed_tokens
            work.append(
                ScheduledWork(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids[start : start + n],
                    start_position=start,
                    block_ids=self.kv.get_block_ids(req.request_id),
                    num_computed_tokens=start,
                    num_tokens=req.num_tokens,
                    needs_sample=start + n == req.num_tokens,
                    output_index=req.num_output_tokens,
                    temperature=req.temperature,
                    seed=req.seed,
                    sample_key=req.sample_key,
                    eos_token_id=req.eos_token_id,
                    eos_after=req.eos_after,
                )
            )
        return work

    async def step(self) -> bool:
        """One scheduler step; False when nothing could be scheduled."""
        so = self.scheduler.schedule()
        self._record_admissions()
        for rid in so.preempted_req_ids:
            self._release(rid)
        if self.metrics is not None and so.preempted_req_ids:
            self.metrics.preemptions.inc(len(so.preempted_req_ids))
        if not so.scheduled:
            self.scheduler.flush_events()
            return False
        work = self._build_work(so)
        if self.backend.blocking:
            sampled = await asyncio.to_thread(self.backend.execute, work)
        else:
            sampled = self.backend.execute(work)
        delay = self.backend.step_seconds(work)
        # Always yield once: at time_scale 0 the HTTP side must still get to run.
        await asyncio.sleep(delay)
        outputs = self.scheduler.update_from_output(so, sampled)
        self.num_steps += 1
        self._dispatch(outputs)
        self._update_gauges()
        return True

    def _record_admissions(self) -> None:
        stats = self.kv.make_prefix_cache_stats()
        if self.metrics is not None and stats.requests:
            self.metrics.queries.inc(stats.queries)
            self.metrics.hits.inc(stats.hits)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        m = self.metrics
        now = time.monotonic()
        for out in outputs:
            t0 = self._first_token_pending.pop(out.request_id, None)
            if t0 is not None and m is not None:
                m.ttft.observe(now - t0)
                m.prompt_tokens.inc(out.num_prompt_tokens)
            if m is not None:
                m.generation_tokens.inc(len(out.new_token_ids))
            q = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._release(out.request_id)
                if m is not None and out.finish_reason in m.success:
                    m.success[out.finish_reason].inc()
            if q is not None:
                q.put_nowait(out)

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        m.running.set(self.scheduler.num_running)
        m.waiting.set(self.scheduler.num_waiting)
        m.usage.set(self.kv.usage)


def is_aborted(item: object) -> bool:
    return item is _ABORTED
