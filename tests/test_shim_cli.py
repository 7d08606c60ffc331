"""``engine-shim`` started as a subprocess: ready line, HTTP, events, PYTHONHASHSEED, shutdown."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from conftest import free_port

from events.hashing import HashScheme
from events.subscriber import EventSubscriber

BIN = Path(sys.executable).with_name("engine-shim")


def read_lines(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def wait_ready(q: queue.Queue, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            raise AssertionError("engine-shim exited before it was ready")
        if line.startswith("engine-shim ready on "):
            return line
    raise AssertionError("engine-shim did not print its ready line in time")


def http(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read()


def test_cli_serves_and_publishes():
    port, ev = free_port(), free_port()
    kv = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ev}", "topic": "kv@a@m"}
    cmd = [
        str(BIN), "--port", str(port), "--kv-events-config", json.dumps(kv),
        "--num-gpu-blocks", "256", "--max-model-len", "2048", "--time-scale", "0",
        "--prefix-caching-hash-algo", "sha256_cbor", "--served-model-name", "m",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        line = wait_ready(read_lines(proc))
        url = f"http://127.0.0.1:{port}"
        assert url in line and f"tcp://*:{ev}" in line
        assert http(url + "/health") == (200, b"")
        sub = EventSubscriber(f"tcp://127.0.0.1:{ev}", topic="kv@a@m")
        try:
            ids = list(range(1, 41))
            deadline = time.monotonic() + 10
            item = None
            while item is None and time.monotonic() < deadline:
                # PUB/SUB joins asynchronously: repeat with new content until a batch arrives.
                ids = [i + 100 for i in ids]
                status, body = http(
                    url + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 1}
                )
                assert status == 200 and json.loads(body)["model"] == "m"
                item = sub.recv(0.5)
            assert item is not None and item.kind == "batch"
            # PYTHONHASHSEED=0 changed NONE_HASH, as in vLLM.
            assert item.batch.events[0].block_hashes == HashScheme("sha256_cbor", "0").block_hashes(
                ids
            )
        finally:
            sub.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def test_cli_rejects_bad_configuration(capsys):
    from engine_shim.cli import main

    for args in (
        ["--kv-events-config", "{not json"],
        ["--kv-events-config", '{"enable_kv_cache_events": true, "nope": 1}'],
        ["--num-gpu-blocks", "8", "--max-model-len", "8192"],
        ["--data-parallel-size", "0"],
    ):
        assert main(args) == 2
        assert "engine-shim: error:" in capsys.readouterr().err
