"""A KV-event subscriber that repairs gaps through vLLM's replay socket and says what it could not.

The router's index is only as good as the event stream it is fed: a lost BlockStored means a
prefix the router never routes to, a lost BlockRemoved means routing to a block that is gone.
So this subscriber never silently drops, duplicates or reorders a batch:

* a seq above the next expected one is a gap: the missing batches are fetched from the
  replay endpoint (a DEALER, because the ROUTER sends one message per batch, spec §2.3) and
  delivered in order before the live batch; what replay cannot provide becomes a "gap" item;
* a seq below the next expected one is a publisher restart (vLLM counts from 0 again, with
  no epoch id) unless it is a live copy of a batch already delivered by the initial replay:
  the seq alone cannot tell (a restarted publisher reuses the same seqs), so the digest of
  each replayed payload is kept until the live stream moves past the replay window, and a
  live batch inside it is a duplicate only when its payload is the same;
* frames that do not parse become "bad_frame" items, counted, never exceptions.

The sequencing rules live in ``Sequencer``, free of sockets: its methods are generators that
yield replay requests, so the blocking and the asyncio subscribers share one implementation
and differ only in how they wait.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from typing import Literal

import zmq
import zmq.asyncio

from events.codec import CodecError, decode_batch
from events.endpoints import (
    END_SEQ,
    SEQ_BYTES,
    EndpointError,
    bind_socket,
    check_endpoint_syntax,
    decode_seq,
    encode_seq,
)
from events.model import KVEventBatch

ItemKind = Literal["batch", "gap", "restart", "bad_frame"]
_RCV_HWM = 100_000  # as vLLM's PUB: a burst of an engine step must not overflow the SUB


@dataclass
class StreamItem:
    """One thing that happened on the stream, in stream order."""

    kind: ItemKind
    seq: int | None = None
    batch: KVEventBatch | None = None
    replayed: bool = False
    missing: tuple[int, int] | None = None  # "gap": first and last seq not recovered
    detail: str = ""


@dataclass
class SubscriberStats:
    batches: int = 0  # batches delivered, live and replayed
    replayed: int = 0  # of which delivered through replay
    gaps: int = 0  # gaps detected (seq jumped, or an initial replay started late)
    gaps_filled: int = 0  # gaps replay filled completely
    gaps_unfilled: int = 0  # gaps reported with at least one "gap" item
    restarts: int = 0
    bad_frames: int = 0
    last_seq: int | None = None


class ReplayError(Exception):
    """A replay request that got no complete answer (no endpoint, timeout, socket error)."""


@dataclass(frozen=True)
class ReplayRequest:
    start_seq: int


# What a driver sends back into a Sequencer generator: the replayed messages
# (topic or None for the old 2-frame layout, seq, payload), or why there are none.
ReplayResult = list[tuple[bytes | None, int, bytes]] | str
Steps = Generator[ReplayRequest, ReplayResult, list[StreamItem]]


def parse_replay_reply(frames: list[bytes]) -> tuple[bytes | None, int, bytes] | bool | None:
    """One message from the replay socket as seen by a DEALER.

    Returns True for the end marker, (topic, seq, payload) for a batch (topic None in the
    0.24 layout), None for something unrecognisable. Both layouts (spec §2.2):
    ``["", topic, seq, payload]`` / ``["", "", END, ""]`` (0.26+) and
    ``["", seq, payload]`` / ``["", END, ""]`` (0.24 and older).
    """
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        topic, seq_b, payload = frames
    elif len(frames) == 2:
        topic = None
        seq_b, payload = frames
    else:
        return None
    if len(seq_b) != SEQ_BYTES:
        return None
    if seq_b == END_SEQ or (payload == b"" and topic in (None, b"")):
        return True
    return topic, decode_seq(seq_b), payload


class Sequencer:
    """The stream-order rules, independent of sockets; see the module docstring."""

    def __init__(self, topic: bytes = b"", stats: SubscriberStats | None = None) -> None:
        self.topic = topic
        self.stats = stats or SubscriberStats()
        self.expect: int | None = None  # next seq in order; None until the first message
        # Seqs delivered by the initial replay whose live copies may still be queued in the
        # SUB socket: dropped silently, but only until the live stream has moved past them,
        # and only when the payload is the one replayed (same seq, other payload = restart).
        self._dedup: tuple[int, int] | None = None
        self._dedup_digests: dict[int, bytes] = {}

    # -- entry points (generators yielding ReplayRequest) ---------------------------------

    def start(self, from_seq: int) -> Steps:
        """Catch up from ``from_seq`` through replay before reading live (late join)."""
        result = yield ReplayRequest(from_seq)
        self.expect = from_seq
        if isinstance(result, str):
            # Nothing replayed: the first live batch will show the gap and try again.
            return []
        got = self._select(result, from_seq, None)
        if not got:
            return []
        self.stats.gaps += int(min(got) > from_seq)
        items = self._merge(got, from_seq, max(got), "not in the publisher's replay buffer")
        if min(got) > from_seq:
            self.stats.gaps_unfilled += 1
        self._dedup = (from_seq, max(got))
        self._dedup_digests = {s: _digest(p) for s, p in got.items()}
        self.expect = max(got) + 1
        return items

    def on_live(self, frames: list[bytes]) -> Steps:
        """Everything one live message means, in order (may ask for a replay first)."""
        if len(frames) != 3:
            return [self._bad(None, f"expected 3 frames [topic, seq, payload], got {len(frames)}")]
        _topic, seq_b, payload = frames
        if len(seq_b) != SEQ_BYTES:
            return [self._bad(None, f"seq frame is {len(seq_b)} bytes, expected {SEQ_BYTES}")]
        seq = decode_seq(seq_b)
        items: list[StreamItem] = []
        exp = self.expect
        if exp is not None and seq > exp:
            items += yield from self._repair(exp, seq - 1)
        elif exp is not None and seq < exp:
            if self._is_replayed_copy(seq, payload):
                return []  # already delivered by replay
            self.stats.restarts += 1
            self._end_dedup()
            items.append(
                StreamItem(
                    "restart",
                    seq=seq,
                    detail=f"seq went back from {exp - 1} to {seq}: publisher restarted",
                )
            )
            if seq > 0:  # a restarted publisher counts from 0: fetch what we missed of it
                items += yield from self._repair(0, seq - 1)
        if self._dedup is not None and seq > self._dedup[1]:
            self._end_dedup()
        items.append(self._item(seq, payload, replayed=False))
        self.expect = seq + 1
        return items

    # -- internals -----------------------------------------------------------------------

    def _is_replayed_copy(self, seq: int, payload: bytes) -> bool:
        """A live batch the initial replay already delivered (same seq and same payload)."""
        if self._dedup is None or not self._dedup[0] <= seq <= self._dedup[1]:
            return False
        # A seq the replay did not have was published before we connected: its live copy
        # cannot still be queued, so seeing it now means the publisher started over.
        return self._dedup_digests.get(seq) == _digest(payload)

    def _end_dedup(self) -> None:
        self._dedup = None
        self._dedup_digests = {}

    def _repair(self, lo: int, hi: int) -> Steps:
        self.stats.gaps += 1
        result = yield ReplayRequest(lo)
        if isinstance(result, str):
            self.stats.gaps_unfilled += 1
            return [self._gap(lo, hi, result)]
        got = self._select(result, lo, hi)
        items = self._merge(got, lo, hi, "not in the publisher's replay buffer")
        if any(i.kind == "gap" for i in items):
            self.stats.gaps_unfilled += 1
        else:
            self.stats.gaps_filled += 1
        return items

    def _select(
        self, result: list[tuple[bytes | None, int, bytes]], lo: int, hi: int | None
    ) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        for topic, seq, payload in result:
            if topic is not None and not topic.startswith(self.topic):
                continue
            if seq >= lo and (hi is None or seq <= hi):
                got.setdefault(seq, payload)
        return got

    def _merge(self, got: dict[int, bytes], lo: int, hi: int, why: str) -> list[StreamItem]:
        """Replayed batches in seq order, with a "gap" item for every hole in [lo, hi]."""
        items: list[StreamItem] = []
        cur = lo
        for s in sorted(got):
            if s > cur:
                items.append(self._gap(cur, s - 1, why))
            items.append(self._item(s, got[s], replayed=True))
            cur = s + 1
        if cur <= hi:
            items.append(self._gap(cur, hi, why))
        return items

    @staticmethod
    def _gap(lo: int, hi: int, why: str) -> StreamItem:
        n = hi - lo + 1
        return StreamItem(
            "gap", missing=(lo, hi), detail=f"{n} batch{'es' if n != 1 else ''} lost: {why}"
        )

    def _bad(self, seq: int | None, why: str, replayed: bool = False) -> StreamItem:
        self.stats.bad_frames += 1
        return StreamItem("bad_frame", seq=seq, replayed=replayed, detail=why)

    def _item(self, seq: int, payload: bytes, replayed: bool) -> StreamItem:
        # A payload that does not decode still consumed its seq: it is reported, not replayed.
        self.stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except CodecError as e:
            return self._bad(seq, str(e), replayed)
        self.stats.batches += 1
        self.stats.replayed += int(replayed)
        return StreamItem("batch", seq=seq, batch=batch, replayed=replayed)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


# --------------------------------------------------------------------------------------
# Socket drivers


@dataclass
class _Config:
    endpoint: str
    replay_endpoint: str | None
    topic: str
    bind: bool
    from_seq: int | None
    replay_timeout_s: float
    pending: deque[StreamItem] = field(default_factory=deque)


def _open_sub(ctx: zmq.Context, endpoint: str, topic: str, bind: bool) -> tuple[zmq.Socket, str]:
    check_endpoint_syntax(endpoint)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.RCVHWM, _RCV_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        if bind:
            endpoint = bind_socket(sub, endpoint)
        else:
            sub.connect(endpoint)
    except zmq.ZMQError as e:
        sub.close(linger=0)
        verb = "bind" if bind else "connect to"
        raise EndpointError(f"cannot {verb} {endpoint}: {e.strerror}") from None
    return sub, endpoint


def _open_dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    check_endpoint_syntax(endpoint)
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
    except zmq.ZMQError as e:
        dealer.close(linger=0)
        raise EndpointError(f"cannot connect to replay endpoint {endpoint}: {e.strerror}") from None
    return dealer


class _SubscriberSockets:
    """What the blocking and the asyncio subscriber share: the SUB socket, the lazily opened
    replay DEALER, the sequencing rules and their counters. Subclasses choose the ZMQ context
    class (plain or asyncio) and drive the sockets their way."""

    _context_cls: type[zmq.Context] = zmq.Context

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        from_seq: int | None = None,
        replay_timeout_s: float = 2.0,
        context: zmq.Context | None = None,
    ) -> None:
        self._own_ctx = context is None
        self._ctx = self._context_cls() if context is None else context
        self._cfg = _Config(endpoint, replay_endpoint, topic, bind, from_seq, replay_timeout_s)
        self._seq = Sequencer(topic.encode("utf-8"))
        self.stats = self._seq.stats
        self._dealer: zmq.Socket | None = None
        self._started = from_seq is None
        try:
            if replay_endpoint is not None:
                check_endpoint_syntax(replay_endpoint)
            self._sub, self.endpoint = _open_sub(self._ctx, endpoint, topic, bind)
        except Exception:
            if self._own_ctx:
                self._ctx.term()
            raise
        self.replay_endpoint = replay_endpoint
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        if self._own_ctx:
            self._ctx.term()


class EventSubscriber(_SubscriberSockets):
    """Blocking subscriber: ``recv()`` one item at a time, or iterate. Not thread-safe."""

    def recv(self, timeout_s: float | None = None) -> StreamItem | None:
        """The next item, or None when ``timeout_s`` passes without one (None: wait forever)."""
        pending = self._cfg.pending
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not pending:
            if not self._started:
                self._started = True
                assert self._cfg.from_seq is not None
                pending.extend(self._drive(self._seq.start(self._cfg.from_seq)))
                continue
            ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(ms, zmq.POLLIN):
                return None
            frames = self._sub.recv_multipart(zmq.NOBLOCK)
            pending.extend(self._drive(self._seq.on_live(frames)))
        return pending.popleft()

    def __iter__(self) -> Iterator[StreamItem]:
        while not self._closed:
            item = self.recv()
            if item is not None:
                yield item

    def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Ask the replay endpoint for every buffered batch from ``start_seq`` on.

        Raises ReplayError when there is no replay endpoint or it does not answer in time.
        """
        return [(s, p) for _t, s, p in self._replay_raw(start_seq)]

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drive(self, steps: Steps) -> list[StreamItem]:
        try:
            req = next(steps)
            while True:
                try:
                    result: ReplayResult = self._replay_raw(req.start_seq)
                except ReplayError as e:
                    result = str(e)
                req = steps.send(result)
        except StopIteration as done:
            return done.value

    def _replay_raw(self, start_seq: int) -> list[tuple[bytes | None, int, bytes]]:
        ep = self.replay_endpoint
        if ep is None:
            raise ReplayError("no replay endpoint configured")
        if self._dealer is None:
            self._dealer = _open_dealer(self._ctx, ep)
        dealer = self._dealer
        timeout_ms = int(self._cfg.replay_timeout_s * 1000)
        out: list[tuple[bytes | None, int, bytes]] = []
        try:
            if not dealer.poll(timeout_ms, zmq.POLLOUT):
                raise ReplayError(f"replay endpoint {ep} did not accept the request")
            dealer.send_multipart([b"", encode_seq(start_seq)], zmq.NOBLOCK)
            while True:
                if not dealer.poll(timeout_ms, zmq.POLLIN):
                    raise ReplayError(
                        f"replay from {ep} timed out after {self._cfg.replay_timeout_s:g}s"
                    )
                r = parse_replay_reply(dealer.recv_multipart(zmq.NOBLOCK))
                if r is True:
                    return out
                if r:
                    out.append(r)  # type: ignore[arg-type]
        except (ReplayError, zmq.ZMQError) as e:
            # A late answer must not be mistaken for the reply to the next request.
            dealer.close(linger=0)
            self._dealer = None
            if isinstance(e, ReplayError):
                raise
            raise ReplayError(f"replay from {ep} failed: {e.strerror}") from None


class AsyncEventSubscriber(_SubscriberSockets):
    """The same subscriber on zmq.asyncio: ``await recv()`` or ``async for``.

    Takes the same arguments; ``context`` must then be a ``zmq.asyncio.Context``.
    """

    _context_cls = zmq.asyncio.Context

    async def recv(self, timeout_s: float | None = None) -> StreamItem | None:
        pending = self._cfg.pending
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not pending:
            if not self._started:
                self._started = True
                assert self._cfg.from_seq is not None
                pending.extend(await self._drive(self._seq.start(self._cfg.from_seq)))
                continue
            ms = None if deadline is None else max(0, int((deadline - loop.time()) * 1000))
            if not await self._sub.poll(ms, zmq.POLLIN):
                return None
            frames = await self._sub.recv_multipart()
            pending.extend(await self._drive(self._seq.on_live(frames)))
        return pending.popleft()

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        while not self._closed:
            item = await self.recv()
            if item is not None:
                yield item

    async def replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        return [(s, p) for _t, s, p in await self._replay_raw(start_seq)]

    async def __aenter__(self) -> AsyncEventSubscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _drive(self, steps: Steps) -> list[StreamItem]:
        try:
            req = next(steps)
            while True:
                try:
                    result: ReplayResult = await self._replay_raw(req.start_seq)
                except ReplayError as e:
                    result = str(e)
                req = steps.send(result)
        except StopIteration as done:
            return done.value

    async def _replay_raw(self, start_seq: int) -> list[tuple[bytes | None, int, bytes]]:
        ep = self.replay_endpoint
        if ep is None:
            raise ReplayError("no replay endpoint configured")
        if self._dealer is None:
            self._dealer = _open_dealer(self._ctx, ep)  # type: ignore[assignment]
        dealer = self._dealer
        assert dealer is not None
        timeout_ms = int(self._cfg.replay_timeout_s * 1000)
        out: list[tuple[bytes | None, int, bytes]] = []
        try:
            if not await dealer.poll(timeout_ms, zmq.POLLOUT):
                raise ReplayError(f"replay endpoint {ep} did not accept the request")
            await dealer.send_multipart([b"", encode_seq(start_seq)])
            while True:
                if not await dealer.poll(timeout_ms, zmq.POLLIN):
                    raise ReplayError(
                        f"replay from {ep} timed out after {self._cfg.replay_timeout_s:g}s"
                    )
                r = parse_replay_reply(await dealer.recv_multipart())
                if r is True:
                    return out
                if r:
                    out.append(r)  # type: ignore[arg-type]
        except (ReplayError, zmq.ZMQError) as e:
            dealer.close(linger=0)
            self._dealer = None
            if isinstance(e, ReplayError):
                raise
            raise ReplayError(f"replay from {ep} failed: {e.strerror}") from None
