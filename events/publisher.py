"""A KV-event publisher that behaves on the wire exactly like vLLM 0.33's ZmqEventPublisher.

The engine emulator uses it so that the router is tested against the real protocol
(spec §1.2-§2.6): a PUB socket with vLLM's bind-or-connect rule and data-parallel port
offset, three-frame messages [topic, seq, payload] with seq counting from 0, and an optional
ROUTER replay socket serving the last ``buffer_steps`` batches followed by the end marker.

As in vLLM, ``publish`` only enqueues: a background thread encodes, sends, buffers and
answers replay requests, so the caller (a scheduler loop) never waits on the network.
Each publisher owns its ZMQ context unless one is passed in, so several data-parallel ranks
can live in one process and be closed independently.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Literal

import zmq

from events.codec import encode_batch
from events.endpoints import (
    END_SEQ,
    bind_socket,
    encode_seq,
    endpoint_binds,
    offset_endpoint_port,
)
from events.model import KVEventBatch

__all__ = ["ZmqEventPublisher", "endpoint_binds", "offset_endpoint_port"]

log = logging.getLogger(__name__)

ReplayLayout = Literal["v0.26", "v0.24"]
_SENTINEL = object()
# How long the publisher thread waits for a batch before looking at the replay socket again.
# vLLM uses 0.1 s; a shorter wait answers replay requests from an idle engine sooner.
_IDLE_WAIT_S = 0.01


class ZmqEventPublisher:
    """vLLM's ZMQ KV-event publisher (PUB + optional ROUTER replay), one per DP rank."""

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        layout: str = "map",
        context: zmq.Context | None = None,
        replay_layout: ReplayLayout = "v0.26",
    ) -> None:
        if layout not in ("map", "array"):
            raise ValueError(f"layout must be 'map' or 'array', got {layout!r}")
        if replay_layout not in ("v0.26", "v0.24"):
            raise ValueError(f"replay_layout must be 'v0.26' or 'v0.24', got {replay_layout!r}")
        self.data_parallel_rank = data_parallel_rank
        self.topic = topic
        self.layout = layout
        self.replay_layout = replay_layout
        self.buffer_steps = buffer_steps
        # Test hook: when it returns True for a seq, the live send is skipped (the batch is
        # still buffered for replay and the seq is consumed), which forces a gap downstream.
        self.skip_send: Callable[[int], bool] | None = None

        self._topic_bytes = topic.encode("utf-8")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._cond = threading.Condition()
        self._queued = 0  # batches handed to publish()
        self._done = 0  # batches the thread has finished with (sent, skipped or failed)
        self._running = True

        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        ep = offset_endpoint_port(endpoint, data_parallel_rank)
        rep = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert ep is not None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            if endpoint_binds(ep):
                ep = bind_socket(self._pub, ep)
            else:
                self._pub.connect(ep)
            if rep is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay plus its end marker, as vLLM 0.33 sets it.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                rep = bind_socket(self._replay, rep)
        except Exception:
            self._close_sockets()
            raise
        self.endpoint: str = ep
        self.replay_endpoint: str | None = rep

        self._thread = threading.Thread(
            target=self._run, name=f"zmq-publisher-dp{data_parallel_rank}", daemon=True
        )
        self._thread.start()

    # ----------------------------------------------------------------------------------
    # Caller side

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one batch; blocks only when ``max_queue_size`` batches are waiting."""
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        with self._cond:
            self._queued += 1
        self._queue.put(batch)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued before this call has been sent; False on timeout."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout=timeout)

    def close(self) -> None:
        """Send what is queued (up to a second, as vLLM), stop the thread, close sockets."""
        if not self._running:
            return
        self._running = False
        self.flush(timeout=1.0)
        self._queue.put(_SENTINEL)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # ----------------------------------------------------------------------------------
    # Publisher thread

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("replay request failed")
            try:
                item = self._queue.get(timeout=_IDLE_WAIT_S if self._replay else 0.1)
            except queue.Empty:
                continue
            if item is _SENTINEL:
                return
            try:
                self._send(item)  # type: ignore[arg-type]
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def _send(self, batch: KVEventBatch) -> None:
        # The seq is consumed before encoding: a batch that fails to encode or send leaves
        # a hole in the sequence, exactly as in vLLM, and subscribers see a gap.
        seq = next(self._seq)
        try:
            payload = encode_batch(batch, layout=self.layout)  # type: ignore[arg-type]
            skip = self.skip_send is not None and self.skip_send(seq)
            if not skip:
                assert self._pub is not None
                self._pub.send_multipart((self._topic_bytes, encode_seq(seq), payload))
            self._buffer.append((seq, payload))
        except Exception:
            log.exception("publishing batch seq=%d failed", seq)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring replay request with %d frames", len(frames))
            return
        ident, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        send = self._replay.send_multipart
        old = self.replay_layout == "v0.24"
        for seq, payload in list(self._buffer):
            if seq >= start:
                if old:
                    send((ident, b"", encode_seq(seq), payload))
                else:
                    send((ident, b"", self._topic_bytes, encode_seq(seq), payload))
        if old:
            send((ident, b"", END_SEQ, b""))
        else:
            send((ident, b"", b"", END_SEQ, b""))
