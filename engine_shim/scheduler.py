"""A vLLM-v1-style scheduler: one step = a token budget shared by running and waiting requests.

Kept free of asyncio and sockets so the scheduling rules (chunked prefill, max_num_seqs,
preemption by recompute, one KV-event batch per step) are testable by calling ``schedule``
and ``update_from_output`` by hand. Order of a step, as in vLLM:

1. running requests first (decodes and unfinished prefill chunks), in arrival order; when
   blocks run out, the newest running request is preempted (blocks freed, progress reset,
   put back at the front of the waiting queue) until the current one fits;
2. then, only if nothing was preempted, waiting requests in order while budget, seats
   (max_num_seqs) and blocks last; each admission looks its prompt up in the prefix cache;
3. after the model ran, sampled tokens are appended, stops checked, finished requests
   freed, and the step's KV events published as one batch, only if there are any.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_shim.kv_cache_manager import KVCacheManager
from engine_shim.request import Request, RequestStatus
from events.model import KVEventBatch

Publish = Callable[[KVEventBatch], None]


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 8192
    # Cap on one request's prefill chunk (0 = only the step budget limits it).
    long_prefill_token_threshold: int = 0


@dataclass
class SchedulerOutput:
    """What one step computes: for each scheduled request, how many new tokens."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    new_req_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r.request_id: n for r, n in self.scheduled}


@dataclass
class RequestOutput:
    """New tokens (and maybe the end) of one request after a step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        publish: Publish | None = None,
        data_parallel_rank: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kv = kv_cache_manager
        self.config = config or SchedulerConfig()
        self.publish = publish
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_published_batches = 0

    # -- queue management -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside the step (abort); frees its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def preempt_all(self) -> list[str]:
        """Preempt every running request, newest first (reset_running_requests=true)."""
        ids = []
        while self.running:
            req = self.running.pop()
            self._preempt(req)
            ids.append(req.request_id)
        return ids

    def reset_prefix_cache(self) -> bool:
        """vLLM's default (reset_running_requests=false): refused while any block is held."""
        return self.kv.reset_prefix_cache()

    # -- one step -------------------------------------------------------------------------

    def _chunk(self, request: Request, num_new: int, budget: int) -> int:
        thr = self.config.long_prefill_token_threshold
        if 0 < thr < num_new:
            num_new = thr
        num_new = min(num_new, budget)
        # The position of the token sampled after this chunk must stay within max_model_len.
        return min(num_new, self.config.max_model_len - request.num_computed_tokens - 1)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, num_new) is not None:
                    break
                victim = self.running.pop()
                if victim.request_id in scheduled:  # cannot happen: victims come after i
                    budget += scheduled.pop(victim.request_id)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # it preempted itself: nothing after it can run either
            scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        if not out.preempted_req_ids:
            while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hit_blocks, num_hit = [], 0
                if req.num_computed_tokens == 0:
                    hit_blocks, num_hit = self.kv.get_computed_blocks(req)
                num_new = self._chunk(req, req.num_tokens - num_hit, budget)
                if num_new <= 0:
                    break
                if self.kv.allocate_slots(req, num_new, num_hit, hit_blocks) is None:
                    break
                self.kv.record_prefix_cache_stats(req, num_hit)
                self.waiting.popleft()
                if req.status == RequestStatus.WAITING:
                    out.new_req_ids.append(req.request_id)
                    req.num_cached_tokens = num_hit
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = num_hit
                self.running.append(req)
                scheduled[req.request_id] = num_new
                budget -= num_new

        by_id = {r.request_id: r for r in self.running}
        out.scheduled = [(by_id[rid], n) for rid, n in scheduled.items()]
        return out

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[RequestOutput]:
        """Advance progress, append sampled tokens, finish requests, publish the step's events.

        ``sampled`` holds one token for each request whose scheduled tokens reached the end
        of its known tokens (partial prefill chunks sample nothing).
        """
        outputs: list[RequestOutput] = []
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            tok = sampled.get(req.request_id)
            if tok is None or req.num_computed_tokens < req.num_tokens:
                continue
            req.append_output_token_ids(tok)
            reason = self._stop_reason(req, tok)
            ro = RequestOutput(
                req.request_id,
                [tok],
                num_cached_tokens=max(req.num_cached_tokens, 0),
                num_prompt_tokens=req.num_prompt_tokens,
            )
            if reason is not None:
                ro.finished, ro.finish_reason = True, reason
                self.running.remove(req)
                self.requests.pop(req.request_id, None)
                req.status = (
                    RequestStatus.FINISHED_STOPPED
                    if reason == "stop"
                    else RequestStatus.FINISHED_LENGTH
                )
                self.kv.free(req)
            outputs.append(ro)
        self.flush_events()
        return outputs

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        if not req.ignore_eos and req.eos_token_id is not None and tok == req.eos_token_id:
            return "stop"
        if req.num_output_tokens >= req.max_tokens:
            return "length"
        if req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def flush_events(self) -> int:
        """Publish the manager's pending events as one batch; nothing when there are none."""
        events = self.kv.take_events()
        if not events:
            return 0
        if self.publish is not None:
            self.publish(
                KVEventBatch(
                    ts=self.clock(), events=events, data_parallel_rank=self.data_parallel_rank
                )
            )
        self.num_published_batches += 1
        return len(events)
