"""The routing decision: one cost in tokens per instance, lowest wins (design §3.6).

    cost = uncached_prefill_tokens + load_weight * (queued_tokens + in_flight_tokens * in_flight)

In one sentence: *an instance costs the prompt tokens it would still have to prefill plus,
weighted, the tokens of work already waiting on it, where each in-flight request also counts
as ``in_flight_tokens`` tokens of decode work.* Both terms are in tokens, so the trade-off
between cache affinity and load has one knob (``load_weight``) and no threshold cliffs.

The default ``load_weight`` is 0.5: a request waiting behind a queued prefill of the same
prefix on one engine starts about as early as one prefilling the whole prefix on an idle
engine (weight 1 makes the two tie), but it keeps one copy of the prefix in the fleet's
caches instead of two, so the tie is broken in favour of affinity: a burst with one prefix
lands together (up to ``max_share``) instead of spreading.

* The hit is counted in whole blocks, as vLLM does, and never covers the last prompt token
  (vLLM always computes at least one token, so a fully cached prompt still prefills its last
  block).
* Lower tiers (CPU / storage offload) give ``tier_credit`` of a GPU block.
* Pending blocks (predicted, not yet confirmed by events) count like index blocks.
* Untrusted instances (hash parity failed, spec §3.3), and every instance when the request
  cannot use the prefix cache (``prefix_credit=False``, e.g. prompt logprobs), get no credit.
* Ties break at random; ``temperature`` > 0 (in tokens) samples from a softmax over -cost.
* ``max_share`` caps one instance's share of in-flight work when more than one is healthy:
  an instance already holding ``cap_min_in_flight`` or more requests is skipped if taking this
  one would put it over ``max_share`` of all in-flight requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .instance import InstanceKey


class NoHealthyInstance(RuntimeError):
    """Nothing to route to: every instance is down or none is configured."""


@dataclass(slots=True)
class Candidate:
    """What the policy knows about one instance for one request."""

    inst: InstanceKey
    matched_blocks: int  # GPU run from block 0 in the index
    pending_blocks: int = 0  # run from block 0 counting predicted blocks
    tier_blocks: int = 0  # run from block 0 counting lower tiers (>= matched_blocks)
    in_flight: int = 0  # requests routed there and not finished
    queued_tokens: int = 0  # prompt tokens of requests routed there still awaiting prefill
    healthy: bool = True
    trusted: bool = True


@dataclass(slots=True)
class Decision:
    """The choice, and (built only when asked, e.g. by /debug/route) why.

    Explaining every instance on every request costs more than choosing at fleet sizes in
    the hundreds, so the per-instance records are made on first access of ``scores``.
    """

    chosen: InstanceKey
    predicted_hit_tokens: int
    _explain: Callable[[], list[dict]] | None = field(default=None, repr=False)
    _scores: list[dict] | None = field(default=None, repr=False)

    @property
    def scores(self) -> list[dict]:
        if self._scores is None:
            self._scores = self._explain() if self._explain is not None else []
        return self._scores


class Policy:
    """Stateless apart from its random source; one per router."""

    def __init__(
        self,
        load_weight: float = 0.5,
        temperature: float = 0.0,
        max_share: float = 0.5,
        tier_credit: float = 0.5,
        seed: int | None = None,
        in_flight_tokens: float = 32.0,
        cap_min_in_flight: int = 4,
    ) -> None:
        if load_weight < 0 or temperature < 0 or not 0 <= tier_credit <= 1:
            raise ValueError("load_weight and temperature must be >= 0, tier_credit in [0, 1]")
        if max_share <= 0:
            raise ValueError("max_share must be > 0 (use 1 to disable the cap)")
        self.load_weight = load_weight
        self.temperature = temperature
        self.max_share = max_share
        self.tier_credit = tier_credit
        self.in_flight_tokens = in_flight_tokens
        self.cap_min_in_flight = cap_min_in_flight
        self._rng = random.Random(seed)

    def hit_tokens(self, c: Candidate, prompt_tokens: int, block_size: int, credit: bool) -> float:
        """Tokens the instance would not prefill (tier blocks weighted by tier_credit)."""
        if not credit or not c.trusted or prompt_tokens <= 0:
            return 0.0
        cap = (prompt_tokens - 1) // block_size  # vLLM always computes the last token
        gpu = min(max(c.matched_blocks, c.pending_blocks), cap)
        tier = max(min(c.tier_blocks, cap) - gpu, 0)
        return (gpu + self.tier_credit * tier) * block_size

    def choose(
        self,
        prompt_tokens: int,
        block_size: int,
        candidates: list[Candidate],
        prefix_credit: bool = True,
    ) -> Decision:
        healthy = [c for c in candidates if c.healthy]
        if not healthy:
            raise NoHealthyInstance(
                "no healthy instance to route to"
                + (f" ({len(candidates)} configured, all down)" if candidates else "")
            )
        total = sum(c.in_flight for c in healthy)
        capped: set[InstanceKey] = set()
        if len(healthy) > 1 and self.max_share < 1:
            limit = self.max_share * (total + 1)
            capped = {
                c.inst
                for c in healthy
                if c.in_flight >= self.cap_min_in_flight and c.in_flight + 1 > limit
            }
            if len(capped) == len(healthy):
                capped = set()
        costs: list[tuple[float, Candidate, float]] = []
        rows: list[tuple[Candidate, float, float, float]] = []
        lw = self.load_weight
        ift = self.in_flight_tokens
        for c in candidates:
            hit = self.hit_tokens(c, prompt_tokens, block_size, prefix_credit)
            load = c.queued_tokens + ift * c.in_flight
            cost = (prompt_tokens - hit) + lw * load
            rows.append((c, hit, load, cost))
            if c.healthy and c.inst not in capped:
                costs.append((cost, c, hit))
        _chosen_cost, chosen, hit = self._pick(costs)
        return Decision(
            chosen=chosen.inst,
            predicted_hit_tokens=int(hit),
            _explain=lambda: self._explain(rows, capped, prefix_credit, chosen.inst),
        )

    def _explain(
        self,
        rows: list[tuple[Candidate, float, float, float]],
        capped: set[InstanceKey],
        prefix_credit: bool,
        chosen: InstanceKey,
    ) -> list[dict]:
        scores: list[dict] = []
        for c, hit, load, cost in rows:
            if not c.healthy:
                why = "unhealthy"
            elif c.inst in capped:
                why = f"capped: over {self.max_share:.0%} of in-flight work"
            elif not c.trusted and c.matched_blocks:
                why = "untrusted hashes: no prefix credit"
            elif not prefix_credit:
                why = "request cannot use the prefix cache: no prefix credit"
            else:
                why = "candidate"
            if c.inst == chosen:
                why = "chosen" + ("" if why == "candidate" else f" ({why})")
            scores.append(
                {
                    "instance": str(c.inst),
                    "matched_blocks": c.matched_blocks,
                    "pending_blocks": c.pending_blocks,
                    "tier_blocks": c.tier_blocks,
                    "hit_tokens": hit,
                    "in_flight": c.in_flight,
                    "queued_tokens": c.queued_tokens,
                    "load_tokens": load,
                    "cost": cost,
                    "trusted": c.trusted,
                    "healthy": c.healthy,
                    "why": why,
                }
            )
        return scores

    def _pick(self, costs: list[tuple[float, Candidate, float]]) -> tuple[float, Candidate, float]:
        best = min(c for c, _, _ in costs)
        if self.temperature > 0 and len(costs) > 1:
            weights = [math.exp(-(c - best) / self.temperature) for c, _, _ in costs]
            return self._rng.choices(costs, weights=weights, k=1)[0]
        ties = [x for x in costs if x[0] - best <= 1e-9]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)
