"""Fleet benchmark smoke test: quick mode, chat workload, router vs round robin (real fleet).

Runs ``python -m bench.fleet`` as a user would (engine shims and router as subprocesses on
loopback ports) and checks the claim the benchmark exists for: on a chat workload the
router's engine-reported hit rate beats round robin's. Also checks that Ctrl-C stops every
process the benchmark started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not installed

from bench import report

ROOT = Path(__file__).resolve().parents[1]


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.timeout(150)
def test_quick_chat_router_beats_round_robin(tmp_path):
    cmd = [
        sys.executable, "-m", "bench.fleet", "--quick", "--workload", "chat",
        "--policy", "prefix,round_robin", "--out", str(tmp_path), "--no-progress",
        "--report", str(tmp_path / "report.md"),
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    runs = {r["policy"]: r for r in doc["workloads"][0]["runs"]}
    prefix = report.summarize(runs["prefix"], 4)
    rr = report.summarize(runs["round_robin"], 4)
    assert prefix["errors"] == 0 and rr["errors"] == 0
    assert prefix["hit_rate"] > rr["hit_rate"] + 0.1, (prefix["hit_rate"], rr["hit_rate"])
    # the router's prediction is checked against what the engines report
    assert prefix["pred_mae"] is not None
    assert "| prefix (router) |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "img" / "fleet-chat-ttft.png").exists()


@pytest.mark.timeout(60)
def test_ctrl_c_stops_everything_it_started(tmp_path):
    cmd = [
        sys.executable, "-m", "bench.fleet", "--quick", "--workload", "chat",
        "--policy", "round_robin", "--out", str(tmp_path), "--no-progress",
    ]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = ""
        deadline = time.monotonic() + 40
        while "workload chat" not in line and time.monotonic() < deadline:
            line = p.stderr.readline()
            assert line, "bench.fleet exited early"
        kids = _children(p.pid)
        assert len(kids) >= 4  # the engine shims
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 130
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(k) for k in kids)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
