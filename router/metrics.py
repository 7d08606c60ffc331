"""Prometheus metrics of one router process, on a registry of its own.

A private registry keeps tests (several routers in one process) and embedding applications
from colliding on the global default registry. Gauges that mirror state owned elsewhere
(index size, parity, health) are refreshed by callbacks right before each scrape instead of
being pushed on every change, which keeps the request and event paths free of bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from router.parity import STATES as _PARITY_STATES

DECISION_BUCKETS = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
# Predicted minus actual hit tokens: negative = the router under-predicted.
ERROR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096)
PARITY_STATES = _PARITY_STATES

CONTENT_TYPE = CONTENT_TYPE_LATEST
DECISION_STAGES = ("tokenize", "hash", "match", "choose", "total")


class InstanceSeries:
    """One instance's request-path series, looked up once instead of per request.

    ``Metric.labels()`` validates and joins its label values under a lock on every call,
    which costs several microseconds; the request path touches five of these series per
    request. Only counters and histograms are held here: they are never removed, so a held
    child cannot go stale (gauges are, by ``forget_instance``, and are not cached).
    """

    __slots__ = ("_outcomes", "_requests", "actual", "error", "predicted", "prompt_tokens")

    def __init__(self, m: RouterMetrics, instance: str) -> None:
        self.predicted = m.predicted_hit_tokens.labels(instance)
        self.actual = m.actual_hit_tokens.labels(instance)
        self.prompt_tokens = m.prompt_tokens.labels(instance)
        self.error = m.prediction_error.labels(instance)
        self._requests = (m.requests, instance)
        self._outcomes: dict[str, Any] = {}

    def outcome(self, outcome: str) -> Any:
        """The ``router_requests`` child for this instance and ``outcome``."""
        c = self._outcomes.get(outcome)
        if c is None:
            metric, instance = self._requests
            c = self._outcomes[outcome] = metric.labels(instance, outcome)
        return c


class RouterMetrics:
    """Every series the router exports; label ``instance`` is ``str(InstanceKey)``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._refreshers: list[Callable[[], None]] = []
        self.requests = Counter(
            "router_requests",
            "Proxied requests by instance and outcome",
            ["instance", "outcome"],
            registry=r,
        )
        self.rejected = Counter(
            "router_rejected_requests",
            "Requests refused by the router itself, by HTTP status",
            ["status"],
            registry=r,
        )
        self.retries = Counter(
            "router_retries",
            "Requests retried on another instance before their first byte",
            ["instance"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "router_decision_seconds",
            "Routing decision time by stage (tokenize, hash, match, choose, total)",
            ["stage"],
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "router_predicted_hit_tokens",
            "Prefix-cache hit tokens the router predicted",
            ["instance"],
            registry=r,
        )
        self.actual_hit_tokens = Counter(
            "router_actual_hit_tokens",
            "Hit tokens the engine reported (usage.prompt_tokens_details.cached_tokens)",
            ["instance"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "router_prompt_tokens",
            "Prompt tokens of requests whose usage was read",
            ["instance"],
            registry=r,
        )
        self.prediction_error = Histogram(
            "router_prediction_error_tokens",
            "Predicted minus actual hit tokens, per request",
            ["instance"],
            buckets=ERROR_BUCKETS,
            registry=r,
        )
        self.events_applied = Counter(
            "router_kv_events_applied", "KV events applied to the index", ["instance"], registry=r
        )
        self.batches_applied = Counter(
            "router_kv_batches_applied",
            "KV event batches applied to the index",
            ["instance"],
            registry=r,
        )
        self.gaps = Counter(
            "router_kv_gaps", "Sequence gaps replay could not fill", ["instance"], registry=r
        )
        self.replays = Counter(
            "router_kv_replayed_batches", "Batches recovered by replay", ["instance"], registry=r
        )
        self.restarts = Counter(
            "router_kv_publisher_restarts",
            "Event publisher restarts (seq went backwards)",
            ["instance"],
            registry=r,
        )
        self.bad_frames = Counter(
            "router_kv_bad_frames",
            "Event frames that could not be decoded",
            ["instance"],
            registry=r,
        )
        self.parity_state = Gauge(
            "router_hash_parity_state",
            "1 for the instance's current hash-parity state",
            ["instance", "state"],
            registry=r,
        )
        self.parity_checks = Gauge(
            "router_hash_parity_checks",
            "Block-0 hashes checked, by result",
            ["instance", "result"],
            registry=r,
        )
        self.index_entries = Gauge(
            "router_index_entries", "(instance, block) entries in the index", registry=r
        )
        self.index_bytes = Gauge("router_index_bytes", "Estimated memory of the index", registry=r)
        self.index_blocks = Gauge(
            "router_index_instance_blocks", "Indexed blocks per instance", ["instance"], registry=r
        )
        self.pending_entries = Gauge(
            "router_pending_entries", "Pending (unconfirmed) prompt blocks", registry=r
        )
        self.healthy = Gauge(
            "router_instance_healthy",
            "1 when the instance passes health checks",
            ["instance"],
            registry=r,
        )
        self.stale = Gauge(
            "router_instance_stale",
            "1 while the instance's index is incomplete (restart or gap)",
            ["instance"],
            registry=r,
        )
        self.in_flight = Gauge(
            "router_instance_in_flight", "Requests in flight per instance", ["instance"], registry=r
        )
        self.queued_tokens = Gauge(
            "router_instance_queued_tokens",
            "Uncached prompt tokens not yet prefilled",
            ["instance"],
            registry=r,
        )
        # Shared state (--index redis://): all zero / absent with the memory index.
        self.redis_degraded = Gauge(
            "router_redis_degraded",
            "1 while Redis cannot be reached: this replica routes on its local view",
            registry=r,
        )
        self.redis_failures = Counter(
            "router_redis_failures", "Redis operations that failed", registry=r
        )
        self.redis_recoveries = Counter(
            "router_redis_recoveries",
            "Times Redis answered again and the shared state was rebuilt",
            registry=r,
        )
        self.ingest_lease = Gauge(
            "router_ingest_lease",
            "1 for each instance whose event stream this replica ingests (holds its lease)",
            ["instance"],
            registry=r,
        )
        self.lease_changes = Counter(
            "router_ingest_lease_changes",
            "Ingest lease changes on this replica: acquired, lost, fenced",
            ["instance", "change"],
            registry=r,
        )
        self._seen: dict[tuple, float] = {}
        self.stage_seconds = {st: self.decision_seconds.labels(st) for st in DECISION_STAGES}
        self._instances: dict[str, InstanceSeries] = {}

    def instance(self, instance: str) -> InstanceSeries:
        """The cached request-path series of one instance (label ``str(InstanceKey)``)."""
        s = self._instances.get(instance)
        if s is None:
            s = self._instances[instance] = InstanceSeries(self, instance)
        return s

    def observe_stage(self, stage: str, seconds: float) -> None:
        child = self.stage_seconds.get(stage)
        if child is None:
            child = self.stage_seconds[stage] = self.decision_seconds.labels(stage)
        child.observe(seconds)

    def on_scrape(self, fn: Callable[[], None]) -> None:
        self._refreshers.append(fn)

    def forget_instance(self, instance: str) -> None:
        """Drop an instance's gauge series when discovery removes it (counters stay)."""
        for g in (
            self.index_blocks,
            self.healthy,
            self.stale,
            self.in_flight,
            self.queued_tokens,
            self.ingest_lease,
        ):
            try:
                g.remove(instance)
            except KeyError:
                pass
        for st in PARITY_STATES:
            try:
                self.parity_state.remove(instance, st)
            except KeyError:
                pass

    def sync_counter(self, counter: Counter, total: float, *labels: str) -> None:
        """Advance a counter to a running total kept elsewhere (the Redis components)."""
        key = (counter._name, labels)
        delta = total - self._seen.get(key, 0.0)
        if delta > 0:
            (counter.labels(*labels) if labels else counter).inc(delta)
            self._seen[key] = total

    def set_shared(
        self, figures: dict[str, float], held: dict[str, bool], changes: dict[tuple, int]
    ) -> None:
        """Shared-state series from RedisState.metrics() and the lease bookkeeping."""
        self.redis_degraded.set(figures.get("redis_degraded", 0.0))
        self.sync_counter(self.redis_failures, figures.get("redis_failures_total", 0.0))
        self.sync_counter(self.redis_recoveries, figures.get("redis_recoveries_total", 0.0))
        for instance, on in held.items():
            self.ingest_lease.labels(instance).set(1.0 if on else 0.0)
        for (instance, change), n in changes.items():
            self.sync_counter(self.lease_changes, float(n), instance, change)

    def set_parity(self, instance: str, state: str) -> None:
        for st in PARITY_STATES:
            self.parity_state.labels(instance, st).set(1.0 if st == state else 0.0)

    def render(self) -> bytes:
        for fn in self._refreshers:
            fn()
        return generate_latest(self.registry)
