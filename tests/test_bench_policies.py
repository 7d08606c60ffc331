"""Client-side baselines and the upper bound of the fleet benchmark (pure logic)."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ is not an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policies import LeastLoaded, LoadBook, Oracle, RoundRobin, cached_run


def test_round_robin_cycles():
    rr = RoundRobin(3)
    book = LoadBook(3)
    assert [rr.choose(book)[0] for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_fewest_in_flight_and_rotates_ties():
    ll = LeastLoaded(3)
    book = LoadBook(3)
    book.begin("a", 0, 100)
    book.begin("b", 0, 100)
    book.begin("c", 1, 100)
    assert ll.choose(book)[0] == 2
    book.begin("d", 2, 10)
    book.end("a")
    book.end("b")
    # engines 0 and 2 now tie at... 0 has 0, 1 has 1, 2 has 1
    assert ll.choose(book)[0] == 0


def test_load_book_counts_queued_tokens_until_first_token():
    book = LoadBook(2)
    book.begin("a", 1, 300, hashes=[1, 2, 3])
    assert book.in_flight == [0, 1] and book.queued_tokens == [0, 300]
    book.first_token("a")
    book.first_token("a")
    assert book.queued_tokens == [0, 0] and book.in_flight == [0, 1]
    assert book.in_flight_hashes(1) == {1, 2, 3}
    book.end("a")
    book.end("a")
    assert book.in_flight == [0, 0] and book.in_flight_hashes(1) == set()


def test_cached_run_stops_at_first_gap():
    assert cached_run([1, 2, 3, 4], {1, 2, 4}) == 2
    assert cached_run([1, 2, 3, 4], {1, 2, 4}, also={3}) == 4
    assert cached_run([5], set()) == 0


def test_oracle_follows_the_true_cache_and_in_flight_prompts():
    o = Oracle(3, seed=0)
    book = LoadBook(3)
    hashes = list(range(100, 130))
    caches = [set(), set(hashes[:8]), set(hashes[:3])]
    engine, predicted = o.choose(book, 30 * 16, hashes, caches)
    assert engine == 1 and predicted == 8 * 16
    # a prompt in flight on engine 2 (already prefilling) counts as its future cache
    book.begin("x", 2, 0, hashes=hashes)
    engine, predicted = o.choose(book, 30 * 16 + 1, hashes, caches)
    assert engine == 2 and predicted == 30 * 16


def test_oracle_weighs_load_like_the_router():
    o = Oracle(2, seed=0)
    book = LoadBook(2)
    for i in range(6):
        book.begin(f"r{i}", 0, 2000)
    hashes = list(range(4))
    engine, _ = o.choose(book, 64, hashes, [set(hashes), set()])
    assert engine == 1  # 48 cached tokens do not beat 12 000 queued ones
