"""Prometheus metrics under vLLM's names and labels, so router code that scrapes a real vLLM
(prefix-cache hit rate, queue depth, KV usage, TTFT) works unchanged against the shim.

Labels are ``model_name`` and ``engine`` (the data-parallel rank as a string), as vLLM's.
Each shim owns a private registry: several shims in one test process must not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ShimMetrics:
    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]
        r = self.registry
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.num_preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            registry=r,
        )
        self.num_requests_running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=r,
        )
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=r,
        )
        self.kv_cache_usage_perc = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # Children resolved once per engine: labels() is a dict lookup plus a lock per call.
        self.engines = [self._children(str(i)) for i in range(num_engines)]

    def _children(self, engine: str) -> EngineMetrics:
        lv = (self.model_name, engine)
        return EngineMetrics(
            queries=self.prefix_cache_queries.labels(*lv),
            hits=self.prefix_cache_hits.labels(*lv),
            prompt_tokens=self.prompt_tokens.labels(*lv),
            generation_tokens=self.generation_tokens.labels(*lv),
            preemptions=self.num_preemptions.labels(*lv),
            running=self.num_requests_running.labels(*lv),
            waiting=self.num_requests_waiting.labels(*lv),
            usage=self.kv_cache_usage_perc.labels(*lv),
            ttft=self.ttft.labels(*lv),
            success={
                reason: self.request_success.labels(*lv, reason)
                for reason in ("stop", "length", "abort")
            },
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineMetrics:
    """The metric children of one engine (one DP rank)."""

    def __init__(self, **children) -> None:
        self.__dict__.update(children)
