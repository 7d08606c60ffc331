"""Report figures and the scale simulation, on small synthetic inputs."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# bench/ is not an installed package: import it from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, simulate


def rec(i, engine, t0, t1, prompt=100, cached=50, predicted=None, ttft=0.02, status=200):
    return {
        "id": str(i),
        "policy": "p",
        "engine": engine,
        "t_send": t0,
        "t_end": t1,
        "ttft": ttft,
        "e2e": t1 - t0,
        "status": status,
        "error": None if status == 200 else "boom",
        "prompt_tokens": prompt,
        "cached": cached,
        "predicted": predicted,
    }


def test_summarize_counts_hits_shares_and_prediction_error():
    recs = [
        rec(0, 0, 0.0, 1.0, predicted=50),
        rec(1, 0, 0.0, 1.0, predicted=80),
        rec(2, 1, 0.5, 1.5, cached=0, predicted=0),
        rec(3, 1, 0.5, 1.5, status=500),
    ]
    s = report.summarize({"policy": "prefix", "records": recs}, engines=2)
    assert s["ok"] == 3 and s["errors"] == 1
    assert s["hit_rate"] == pytest.approx(100 / 300)
    assert s["max_share"] == pytest.approx(2 / 3)
    assert s["pred_mae"] == pytest.approx(10)
    assert s["pred_over"] == pytest.approx(1 / 3)
    assert s["throughput_rps"] == pytest.approx(3 / 1.5)
    assert s["request_share"] == pytest.approx([2 / 3, 1 / 3])


def test_load_share_series_sums_to_one_where_busy():
    recs = [rec(0, 0, 0.0, 2.0), rec(1, 1, 1.0, 2.0)]
    xs, shares = report.load_share_series(recs, 2, bins=4)
    assert len(xs) == 4
    assert shares[0][:2] == [1.0, 1.0]
    assert shares[0][3] == pytest.approx(0.5) and shares[1][3] == pytest.approx(0.5)


def test_write_section_replaces_only_its_own_part(tmp_path):
    p = tmp_path / "r.md"
    p.write_text("# Title\n\nhand-written intro\n")
    report.write_section(p, "fleet", "one", title="Fleet")
    report.write_section(p, "simulate", "two")
    report.write_section(p, "fleet", "three")
    text = p.read_text()
    assert "hand-written intro" in text and "three" in text and "two" in text
    assert "one" not in text and text.count("## Fleet") == 1


def test_fleet_report_writes_markdown_and_small_pngs(tmp_path):
    runs = [
        {"policy": "prefix", "records": [rec(i, i % 2, i * 0.1, i * 0.1 + 0.5) for i in range(20)]},
        {
            "policy": "round_robin",
            "records": [rec(i, i % 2, i * 0.1, i * 0.1 + 0.6, cached=10) for i in range(20)],
        },
    ]
    results = [{"workload": "chat", "requests": 20, "sessions": 4, "rate": 10.0, "runs": runs}]
    args = SimpleNamespace(
        engines=2, gpu_blocks=100, time_scale=1.0, max_tokens=8, closed_loop=None
    )
    out = tmp_path / "docs" / "bench.md"
    report.write_fleet_report(out, results, args, tmp_path / "docs" / "img", 3.0, command="x")
    text = out.read_text()
    assert "| prefix (router) | 20/20 | 50.0 %" in text
    assert "hit rate 50.0 % vs 10.0 % for round robin" in text
    assert "](img/fleet-chat-ttft.png)" in text
    for kind in ("ttft", "hit", "load"):
        png = tmp_path / "docs" / "img" / f"fleet-chat-{kind}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 100_000


def test_lru_pool_evicts_least_recently_used():
    pool = simulate.LruPool(3)
    assert pool.serve([1, 2, 3]) == (0, [1, 2, 3], [])
    assert pool.serve([1, 4]) == (1, [4], [2])
    assert pool.run([1, 2]) == 1 and pool.run([3, 1]) == 2


def test_simulation_prefix_beats_round_robin_and_index_is_exact():
    r = simulate.simulate(engines=8, blocks_per_engine=256, requests=300, seed=1)
    assert r["index_entries"] == 8 * 256  # pools stay full; the index mirrors them exactly
    assert r["pred_error_tokens"] == 0
    assert r["hit_rate"] > r["rr_hit_rate"] + 0.1
