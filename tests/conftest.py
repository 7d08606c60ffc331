"""Fixtures shared by every test module: free loopback ports, reference vectors, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.endpoints import free_tcp_port as free_port

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
DATA = Path(__file__).resolve().parent / "data"


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
