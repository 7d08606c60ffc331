"""`kv-events` as a user runs it: a subprocess, real sockets, bounded by timeouts."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port, load_vector

from events.model import BlockStored, KVEventBatch
from events.publisher import ZmqEventPublisher

SCRIPT = Path(sys.executable).parent / "kv-events"
CMD = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "events.cli"]
DEADLINE_S = 15.0


def run(*args: str, stdin: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CMD, *args], input=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


class Proc:
    """A running kv-events whose stdout lines can be awaited with a deadline."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [*CMD, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: queue.Queue[str | None] = queue.Queue()
        for stream, q in ((self.p.stdout, self.lines), (self.p.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, q), daemon=True).start()

    @staticmethod
    def _pump(stream, q) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    def line(self, q: queue.Queue | None = None, timeout: float = DEADLINE_S) -> str | None:
        try:
            return (q or self.lines).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no output in time") from None

    def rest(self, q: queue.Queue) -> list[str]:
        out = []
        while (line := self.line(q)) is not None:
            out.append(line)
        return out

    def finish(self, timeout: float = DEADLINE_S) -> int:
        return self.p.wait(timeout=timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=5)


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(
        ts=1.0 + i,
        events=[BlockStored([100 + i, 200 + i], 99 + i, list(range(32)), 16, medium="GPU")],
    )


# --------------------------------------------------------------------------------------
# hash


def _vector(algo="sha256_cbor", seed=None, extra="none", n=64):
    v = load_vector("block_hashes.json")
    (case,) = [
        c
        for c in v["cases"]
        if (c["algo"], c["PYTHONHASHSEED"], c["extra"], c["num_tokens"]) == (algo, seed, extra, n)
    ]
    return v, case


def test_hash_argument_and_stdin():
    v, case = _vector()
    tokens = json.dumps(v["tokens"]["64"])
    r = run("hash", tokens)
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == case["block_hashes_u64"]
    r2 = run("hash", "--hex", stdin=tokens)
    assert r2.stdout.split() == case["block_hashes_hex"]


def test_hash_options_match_vectors():
    v, case = _vector("sha256", "0", "lora+cache_salt")
    lr = v["lora_request"]
    r = run(
        "hash",
        json.dumps(v["tokens"]["64"]),
        "--algo",
        "sha256",
        "--seed",
        "0",
        "--cache-salt",
        v["cache_salt"],
        "--lora",
        f"{lr['lora_name']}:{lr['lora_path']}",
    )
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()] == case["block_hashes_u64"]
    # 0.29-style untagged keys and another block size give other chains.
    r = run(
        "hash", "[1,2,3,4]", "--block-size", "2", "--cache-salt", "s1", "--extra-keys", "untagged"
    )
    assert r.returncode == 0 and len(r.stdout.split()) == 2


@pytest.mark.parametrize(
    ("arg", "msg"),
    [("[1, 2", "not valid JSON"), ('{"a": 1}', "JSON list"), ("[1, -2]", "non-negative")],
)
def test_hash_bad_input_is_one_line_exit_2(arg, msg):
    r = run("hash", arg)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr


# --------------------------------------------------------------------------------------
# tail


def _wait_tail_connected(p: Proc, pub: ZmqEventPublisher, published: list[int]) -> list[str]:
    """Publish probes until tail prints a line (ZMQ slow joiner); return the lines so far."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        pub.publish(batch(published[0]))
        published[0] += 1
        assert pub.flush()
        try:
            first = p.lines.get(timeout=0.1)
        except queue.Empty:
            continue
        return [first]
    raise AssertionError("tail never printed a batch")


def test_tail_json_with_gap_recovered_through_replay():
    pub = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0")
    p = None
    try:
        published = [0]
        p = Proc(
            "tail",
            pub.endpoint,
            "--replay",
            pub.replay_endpoint,
            "--json",
            "--timeout",
            "20",
            "--count",
            "1000",
        )
        lines = _wait_tail_connected(p, pub, published)
        first = json.loads(lines[0])
        # Drain the probes, then force a gap of two.
        while json.loads(lines[-1])["seq"] != published[0] - 1:
            lines.append(p.line())
        k = published[0]
        pub.skip_send = lambda s: s in (k, k + 1)
        for _ in range(3):
            pub.publish(batch(published[0]))
            published[0] += 1
        assert pub.flush()
        got = [json.loads(p.line()) for _ in range(3)]
        assert [(g["kind"], g["seq"], g["replayed"]) for g in got] == [
            ("batch", k, True),
            ("batch", k + 1, True),
            ("batch", k + 2, False),
        ]
        ev = got[0]["events"][0]
        assert got[0]["data_parallel_rank"] == 0 and got[0]["ts"] == batch(k).ts
        assert ev["type"] == "BlockStored" and ev["block_hashes"] == [100 + k, 200 + k]
        assert ev["parent_block_hash"] == 99 + k and ev["medium"] == "GPU" and ev["lora_id"] is None
        assert first["kind"] == "batch"
        p.p.send_signal(signal.SIGINT)
        assert p.finish() == 0
        summary = p.rest(p.err)
        assert any("summary (interrupted" in s and "gaps=1 (filled=1" in s for s in summary)
    finally:
        if p is not None:
            p.kill()
        pub.close()


def test_tail_demo_publish_with_dropped_batches():
    port, rport = free_port(), free_port()
    demo = Proc(
        "demo-publish",
        "--endpoint",
        f"tcp://*:{port}",
        "--replay",
        f"tcp://*:{rport}",
        "--rate",
        "100",
        "--drop-every",
        "4",
        "--seed",
        "3",
    )
    try:
        assert "publishing on" in demo.line(demo.err)
        r = run(
            "tail",
            f"tcp://127.0.0.1:{port}",
            "--replay",
            f"tcp://127.0.0.1:{rport}",
            "--from",
            "0",
            "--count",
            "30",
            "--timeout",
            "20",
            "--stats",
        )
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == 30
        assert [int(line.split()[0].removeprefix("seq=")) for line in lines] == list(range(30))
        assert all(" dp=0 " in line for line in lines)
        assert (
            "BlockStored(blocks=" in lines[0] and "first=" in lines[0] and "medium=GPU" in lines[0]
        )
        # Live sends of every 4th batch were skipped; replay filled them (or the catch-up did).
        assert any("replayed" in line for line in lines)
        assert not any(line.startswith(("GAP", "RESTART")) for line in lines)
        assert "summary (30 batches received" in r.stderr and "unfilled=0" in r.stderr
    finally:
        demo.p.send_signal(signal.SIGINT)
        try:
            assert demo.finish() == 0
        finally:
            demo.kill()


def test_tail_unreachable_and_invalid_endpoints():
    port = free_port()
    for args, msg in [
        (("tail", f"tcp://127.0.0.1:{port}"), "cannot reach"),
        (("tail", "localhost:5557"), "invalid endpoint"),
        (("tail", "tcp://127.0.0.1:notaport"), "not a number"),
        (("tail", "tcp://no-such-host.invalid:5557"), "unknown host"),
        (("replay", f"tcp://127.0.0.1:{port}"), "cannot reach"),
    ]:
        r = run(*args, timeout=20)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_tail_from_needs_replay():
    r = run("tail", "tcp://127.0.0.1:1", "--from", "0")
    assert r.returncode == 2 and "--from needs --replay" in r.stderr


def test_tail_timeout_stops_and_summarises():
    pub = ZmqEventPublisher("tcp://*:0")
    try:
        r = run("tail", pub.endpoint, "--timeout", "0.3")
        assert r.returncode == 0
        assert r.stdout == "" and "summary (--timeout 0.3s reached" in r.stderr
    finally:
        pub.close()


# --------------------------------------------------------------------------------------
# replay and help


def test_replay_command():
    pub = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        for i in range(5):
            pub.publish(batch(i))
        assert pub.flush()
        r = run("replay", pub.replay_endpoint, "--from", "2")
        assert r.returncode == 0, r.stderr
        assert [line.split()[0] for line in r.stdout.splitlines()] == ["seq=2", "seq=3", "seq=4"]
        assert "replayed" in r.stdout and "end of replay: 3 batches" in r.stderr
        rj = run("replay", pub.replay_endpoint, "--json")
        assert [json.loads(x)["seq"] for x in rj.stdout.splitlines()] == [0, 1, 2, 3, 4]
    finally:
        pub.close()


@pytest.mark.parametrize("sub", ["tail", "hash", "demo-publish", "replay"])
def test_help(sub):
    r = run(sub, "--help")
    assert r.returncode == 0 and "usage: kv-events " + sub in r.stdout


def test_entry_point_module_runs():
    r = subprocess.run(
        [sys.executable, "-m", "events.cli", "hash", "[]"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env={**os.environ},
    )
    assert r.returncode == 0 and "no full block" in r.stderr
