"""Fixtures shared by every test module: free loopback ports, reference vectors, tokenizer."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DATA = Path(__file__).resolve().parent / "data"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_vector(name: str) -> dict:
    """Reference data made by vLLM's own code: ../shared/vectors, else the copy in tests/data."""
    for base in (SHARED / "vectors", DATA):
        p = base / name
        if p.exists():
            return json.loads(p.read_text())
    raise FileNotFoundError(name)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def tokenizer():
    from events.tokenizer import load_tokenizer

    return load_tokenizer()
