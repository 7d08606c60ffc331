"""Stopping background tasks the same way everywhere.

Every long-lived loop of the router (health checks, DNS discovery, ingest streams, pending
expiry) is stopped on shutdown or when its instance goes away; the loop's own failure was
already logged where it happened, so stopping must neither raise nor hang.
"""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has finished, swallowing its outcome."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
