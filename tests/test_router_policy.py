"""The routing cost (design §3.6): credit, load, cap, ties, temperature, trust."""

from __future__ import annotations

from collections import Counter

import pytest

from router.instance import InstanceKey
from router.policy import Candidate, NoHealthyInstance, Policy

A = InstanceKey("http://a:1")
B = InstanceKey("http://b:1")
C = InstanceKey("http://c:1")


def by_inst(decision):
    return {s["instance"]: s for s in decision.scores}


def test_cost_is_uncached_prefill_plus_weighted_load():
    p = Policy(load_weight=1.0, in_flight_tokens=0, seed=1)
    d = p.choose(
        1000,
        16,
        [Candidate(A, matched_blocks=50), Candidate(B, matched_blocks=0, queued_tokens=0)],
    )
    assert d.chosen == A and d.predicted_hit_tokens == 800
    s = by_inst(d)
    assert s[str(A)]["cost"] == 200 and s[str(B)]["cost"] == 1000
    assert s[str(A)]["why"] == "chosen"
    # Load outweighs the cache once A's queue costs more than the tokens it saves.
    d = p.choose(1000, 16, [Candidate(A, 50, queued_tokens=900), Candidate(B, 0)])
    assert d.chosen == B and d.predicted_hit_tokens == 0
    d = Policy(load_weight=0.5, in_flight_tokens=0).choose(
        1000, 16, [Candidate(A, 50, queued_tokens=900), Candidate(B, 0)]
    )
    assert d.chosen == A  # 200 + 450 < 1000


def test_in_flight_counts_as_decode_tokens():
    p = Policy(load_weight=1.0, in_flight_tokens=100, max_share=1)
    d = p.choose(64, 16, [Candidate(A, 3, in_flight=3), Candidate(B, 0, in_flight=0)])
    # A: 64-48 + 300 = 316; B: 64
    assert d.chosen == B
    assert by_inst(d)[str(A)]["load_tokens"] == 300


def test_hit_never_covers_the_last_token():
    p = Policy()
    d = p.choose(64, 16, [Candidate(A, matched_blocks=4)])
    assert d.predicted_hit_tokens == 48  # 64 tokens, 4 full blocks cached: last block recomputed
    d = p.choose(65, 16, [Candidate(A, matched_blocks=4)])
    assert d.predicted_hit_tokens == 64


def test_pending_and_tier_credit():
    p = Policy(tier_credit=0.5, in_flight_tokens=0)
    d = p.choose(
        321,
        16,
        [
            Candidate(A, matched_blocks=2, pending_blocks=10),
            Candidate(B, matched_blocks=4, tier_blocks=20),
        ],
    )
    s = by_inst(d)
    assert s[str(A)]["hit_tokens"] == 160
    assert s[str(B)]["hit_tokens"] == 4 * 16 + 0.5 * 16 * 16
    assert d.chosen == B and d.predicted_hit_tokens == 192


def test_untrusted_and_no_prefix_credit():
    p = Policy(seed=3, in_flight_tokens=0)
    d = p.choose(512, 16, [Candidate(A, 30, trusted=False), Candidate(B, 2)])
    assert d.chosen == B
    assert "untrusted" in by_inst(d)[str(A)]["why"]
    d = p.choose(512, 16, [Candidate(A, 30), Candidate(B, 2, queued_tokens=5)], prefix_credit=False)
    assert d.chosen == A and d.predicted_hit_tokens == 0  # load only


def test_random_tie_breaks_spread_over_equals():
    p = Policy(seed=42)
    cands = [Candidate(A, 0), Candidate(B, 0), Candidate(C, 0)]
    seen = Counter(p.choose(100, 16, cands).chosen for _ in range(300))
    assert set(seen) == {A, B, C} and min(seen.values()) > 60


def test_temperature_samples_near_the_best():
    cands = [Candidate(A, 10), Candidate(B, 9), Candidate(C, 0)]
    cold = Policy(seed=1)
    assert {cold.choose(400, 16, cands).chosen for _ in range(50)} == {A}
    warm = Policy(temperature=16.0, seed=1)
    seen = Counter(warm.choose(400, 16, cands).chosen for _ in range(400))
    assert seen[A] > seen[B] > 0 and seen[C] < 5  # C is 160 tokens worse: e^-10


def test_max_share_caps_one_instance():
    p = Policy(max_share=0.5, cap_min_in_flight=4, in_flight_tokens=0)
    # A holds the whole prefix but already 6 of 8 in-flight requests: capped.
    d = p.choose(1000, 16, [Candidate(A, 60, in_flight=6), Candidate(B, 0, in_flight=2)])
    assert d.chosen == B
    assert by_inst(d)[str(A)]["why"].startswith("capped")
    # Below the minimum in-flight count the cap does not bite (a burst may land together).
    d = p.choose(1000, 16, [Candidate(A, 60, in_flight=3), Candidate(B, 0, in_flight=0)])
    assert d.chosen == A
    # A single healthy instance is never capped.
    d = p.choose(1000, 16, [Candidate(A, 60, in_flight=50), Candidate(B, 0, healthy=False)])
    assert d.chosen == A
    # max_share=1 disables the cap.
    d = Policy(max_share=1.0, in_flight_tokens=0).choose(
        1000, 16, [Candidate(A, 60, in_flight=60), Candidate(B, 0, in_flight=0)]
    )
    assert d.chosen == A


def test_unhealthy_skipped_and_none_left_raises():
    p = Policy()
    d = p.choose(100, 16, [Candidate(A, 5, healthy=False), Candidate(B, 0)])
    assert d.chosen == B and by_inst(d)[str(A)]["why"] == "unhealthy"
    with pytest.raises(NoHealthyInstance):
        p.choose(100, 16, [Candidate(A, 5, healthy=False)])
    with pytest.raises(NoHealthyInstance):
        p.choose(100, 16, [])


def test_bad_parameters_rejected():
    with pytest.raises(ValueError):
        Policy(load_weight=-1)
    with pytest.raises(ValueError):
        Policy(max_share=0)
