"""Client-side routing for the baselines and the upper bound of the fleet benchmark.

The prefix policies run in the real router (``prefix-router serve``); the others choose an
engine here, in the benchmark client, and talk to that engine directly:

* ``round_robin``: engine i, i+1, ... in turn;
* ``least_loaded``: fewest requests in flight (ties: the next in round-robin order);
* ``oracle``: the upper bound. Before each request it reads every engine's *true* prefix
  cache (the shim's GET /debug/kv_cache: the event hashes of every cached block, in use or
  free), adds the blocks of the requests it has routed there that are still in flight (they
  will be cached by the time a follower's prefill runs), and hands the resulting exact hit,
  with the same load figures the router uses (in-flight requests, prompt tokens not yet
  prefilled), to the router's own ``router.policy.Policy`` with its default knobs. So it is
  the router's cost formula with a perfect, zero-lag index: the gap between it and ``prefix``
  is what event lag, pending-entry guesses and the router's hop cost.

``LoadBook`` is the client's account of load per engine; it is the same for every policy so
that "largest share of in-flight work" is measured the same way for all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.instance import InstanceKey
from router.policy import Candidate, Policy

__all__ = [
    "CLIENT_POLICIES",
    "ROUTER_POLICIES",
    "ClientPolicy",
    "LeastLoaded",
    "LoadBook",
    "Oracle",
    "RoundRobin",
    "cached_run",
    "make_client_policy",
]

# policy name -> extra `prefix-router serve` flags
ROUTER_POLICIES: dict[str, list[str]] = {
    "prefix": [],
    "prefix_no_pending": ["--pending-ttl-s", "0"],
}
CLIENT_POLICIES = ("round_robin", "least_loaded", "oracle")


@dataclass
class _Flight:
    engine: int
    queued: int
    hashes: Sequence[int] = ()
    prefilled: bool = False


@dataclass
class LoadBook:
    """In-flight requests and not-yet-prefilled prompt tokens per engine, as the client sees."""

    engines: int
    in_flight: list[int] = field(default_factory=list)
    queued_tokens: list[int] = field(default_factory=list)
    _flights: dict[str, _Flight] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.in_flight = [0] * self.engines
        self.queued_tokens = [0] * self.engines

    def begin(self, rid: str, engine: int, queued: int, hashes: Sequence[int] = ()) -> None:
        self._flights[rid] = _Flight(engine, max(0, queued), hashes)
        self.in_flight[engine] += 1
        self.queued_tokens[engine] += max(0, queued)

    def first_token(self, rid: str) -> None:
        f = self._flights.get(rid)
        if f is not None and not f.prefilled:
            f.prefilled = True
            self.queued_tokens[f.engine] -= f.queued

    def end(self, rid: str) -> None:
        f = self._flights.pop(rid, None)
        if f is None:
            return
        self.first_token(rid)
        self.in_flight[f.engine] -= 1

    def in_flight_hashes(self, engine: int) -> set[int]:
        out: set[int] = set()
        for f in self._flights.values():
            if f.engine == engine:
                out.update(f.hashes)
        return out


class ClientPolicy:
    """Chooses an engine index; ``needs_cache`` asks the runner for the engines' true caches."""

    name = "client"
    needs_cache = False
    needs_hashes = False

    def choose(
        self,
        book: LoadBook,
        prompt_tokens: int = 0,
        hashes: Sequence[int] = (),
        caches: Sequence[set[int]] | None = None,
    ) -> tuple[int, int | None]:
        """(engine index, predicted hit tokens or None when the policy predicts nothing)."""
        raise NotImplementedError


class RoundRobin(ClientPolicy):
    name = "round_robin"

    def __init__(self, engines: int) -> None:
        self._next = itertools.cycle(range(engines))

    def choose(self, book, prompt_tokens=0, hashes=(), caches=None):
        return next(self._next), None


class LeastLoaded(ClientPolicy):
    name = "least_loaded"

    def __init__(self, engines: int) -> None:
        self._n = engines
        self._start = 0

    def choose(self, book, prompt_tokens=0, hashes=(), caches=None):
        order = [(self._start + i) % self._n for i in range(self._n)]
        best = min(order, key=lambda e: book.in_flight[e])
        self._start = (best + 1) % self._n
        return best, None


def cached_run(hashes: Sequence[int], held: set[int], also: set[int] | None = None) -> int:
    """Blocks from block 0 that ``held`` (or ``also``) contains, stopping at the first gap."""
    n = 0
    for h in hashes:
        if h in held or (also is not None and h in also):
            n += 1
        else:
            break
    return n


class Oracle(ClientPolicy):
    """The router's cost formula over the engines' true caches (see the module docstring)."""

    name = "oracle"
    needs_cache = True
    needs_hashes = True

    def __init__(self, engines: int, block_size: int = 16, seed: int = 0, **knobs: float) -> None:
        self._n = engines
        self.block_size = block_size
        self.policy = Policy(seed=seed, **knobs)  # type: ignore[arg-type]
        self._keys = [InstanceKey(f"engine-{i}") for i in range(engines)]

    def choose(self, book, prompt_tokens=0, hashes=(), caches=None):
        caches = caches or [set() for _ in range(self._n)]
        cands = []
        for e in range(self._n):
            true_run = cached_run(hashes, caches[e])
            with_flight = cached_run(hashes, caches[e], book.in_flight_hashes(e))
            cands.append(
                Candidate(
                    self._keys[e],
                    matched_blocks=true_run,
                    pending_blocks=with_flight,
                    tier_blocks=true_run,
                    in_flight=book.in_flight[e],
                    queued_tokens=book.queued_tokens[e],
                )
            )
        d = self.policy.choose(prompt_tokens, self.block_size, cands)
        return self._keys.index(d.chosen), d.predicted_hit_tokens


def make_client_policy(name: str, engines: int, seed: int = 0) -> ClientPolicy:
    if name == "round_robin":
        return RoundRobin(engines)
    if name == "least_loaded":
        return LeastLoaded(engines)
    if name == "oracle":
        return Oracle(engines, seed=seed)
    raise ValueError(f"unknown client policy {name!r}; known: {', '.join(CLIENT_POLICIES)}")
