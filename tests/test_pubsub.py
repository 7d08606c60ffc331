"""Publisher and subscriber over real loopback ZMQ: vLLM's wire behaviour and gap repair.

ZMQ's PUB drops everything sent before a SUB's connection is up (slow joiner), so every test
first publishes probe batches until the subscriber has seen one (``sync``), and waits for
the seqs it expects with deadlines instead of sleeping.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from conftest import free_port

from events.codec import decode_batch, encode_batch
from events.endpoints import END_SEQ, encode_seq, endpoint_binds, offset_endpoint_port
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from events.publisher import ZmqEventPublisher
from events.subscriber import (
    AsyncEventSubscriber,
    EventSubscriber,
    ReplayError,
    Sequencer,
    StreamItem,
)

DEADLINE_S = 10.0


def batch(i: int, dp: int | None = None) -> KVEventBatch:
    return KVEventBatch(
        ts=1_700_000_000.0 + i,
        events=[
            BlockStored(
                block_hashes=[1000 + i],
                parent_block_hash=None if i == 0 else 999 + i,
                token_ids=list(range(16)),
                block_size=16,
                medium="GPU",
                extra_keys=[None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            BlockRemoved(block_hashes=[i], medium="GPU"),
        ],
        data_parallel_rank=dp,
    )


class Feed:
    """Publishes and keeps count of the seqs it handed out (one per publish, from 0)."""

    def __init__(self, pub: ZmqEventPublisher) -> None:
        self.pub = pub
        self.published = 0

    def send(self, n: int = 1) -> int:
        """Publish n batches, wait until sent; return the last seq."""
        for _ in range(n):
            self.pub.publish(batch(self.published))
            self.published += 1
        assert self.pub.flush(5.0)
        return self.published - 1


def collect(
    sub: EventSubscriber, until_seq: int, deadline_s: float = DEADLINE_S
) -> list[StreamItem]:
    """Items up to and including the batch with seq ``until_seq`` (raises on deadline)."""
    items: list[StreamItem] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        it = sub.recv(timeout_s=0.1)
        if it is None:
            continue
        items.append(it)
        if it.kind in ("batch", "bad_frame") and it.seq == until_seq:
            return items
    raise AssertionError(f"seq {until_seq} not received; got {[(i.kind, i.seq) for i in items]}")


def sync(feed: Feed, sub: EventSubscriber) -> list[StreamItem]:
    """Publish probes until the subscriber receives one; return all items through the last."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        last = feed.send()
        it = sub.recv(timeout_s=0.05)
        if it is not None:
            rest = [] if it.seq == last else collect(sub, last)
            return [it, *rest]
    raise AssertionError("subscriber never connected")


def seqs(items: list[StreamItem]) -> list[tuple[str, int | None, bool]]:
    return [(i.kind, i.seq, i.replayed) for i in items]


@pytest.fixture
def pub():
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=100)
    yield p
    p.close()


@pytest.fixture
def sub_factory():
    subs: list[EventSubscriber] = []

    def make(*args, **kw) -> EventSubscriber:
        kw.setdefault("replay_timeout_s", 2.0)
        s = EventSubscriber(*args, **kw)
        subs.append(s)
        return s

    yield make
    for s in subs:
        s.close()


# --------------------------------------------------------------------------------------
# Endpoint rules


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://10.0.0.1:6000", 1, "tcp://10.0.0.1:6001"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://*:0", 4, "tcp://*:0"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/x", 0, "ipc:///tmp/x"),
        (None, 2, None),
        ("", 2, ""),
    ],
)
def test_offset_endpoint_port(endpoint, rank, expected):
    assert offset_endpoint_port(endpoint, rank) == expected


def test_offset_endpoint_port_rejects_ipc_with_rank():
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        offset_endpoint_port("ipc:///tmp/kv", 1)


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router-host:5557", False),
    ],
)
def test_endpoint_binds(endpoint, binds):
    assert endpoint_binds(endpoint) is binds


# --------------------------------------------------------------------------------------
# Publisher wire format


def test_live_frames_are_vllms(sub_factory):
    """[topic, 8-byte big-endian seq from 0, msgpack payload] read by a raw SUB."""
    p = ZmqEventPublisher("tcp://*:0", topic="kv@pod1@m", data_parallel_rank=0)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(p.endpoint)
    try:
        feed = Feed(p)
        end = time.monotonic() + DEADLINE_S
        first = None
        while first is None and time.monotonic() < end:
            feed.send()
            if raw.poll(50):
                first = raw.recv_multipart()
        assert first is not None
        topic, seq_b, payload = first
        assert topic == b"kv@pod1@m"
        assert len(seq_b) == 8
        seq = int.from_bytes(seq_b, "big")
        got = decode_batch(payload)
        assert got == batch(seq, dp=0)  # publish() filled in the publisher's DP rank
        assert payload == encode_batch(batch(seq, dp=0))
        last = feed.send(3)
        frames = [raw.recv_multipart() for _ in range(last - seq)]
        assert [f[1] for f in frames] == [encode_seq(s) for s in range(seq + 1, last + 1)]
    finally:
        raw.close(linger=0)
        ctx.term()
        p.close()


def test_raw_replay_protocol(pub):
    """ROUTER replay: [b"", topic, seq, payload] per buffered batch, then the end marker."""
    feed = Feed(pub)
    feed.send(5)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", b"bad", b"request"])  # 3 frames at the ROUTER: ignored
        dealer.send_multipart([b"", encode_seq(2)])
        msgs = []
        while True:
            assert dealer.poll(5000)
            m = dealer.recv_multipart()
            msgs.append(m)
            if m[2] == END_SEQ:
                break
        assert msgs[-1] == [b"", b"", END_SEQ, b""]
        assert [(m[0], m[1], m[2]) for m in msgs[:-1]] == [
            (b"", b"", encode_seq(s)) for s in (2, 3, 4)
        ]
        assert [decode_batch(m[3]).ts for m in msgs[:-1]] == [batch(s).ts for s in (2, 3, 4)]
        # A start in the future gets only the end marker.
        dealer.send_multipart([b"", encode_seq(99)])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        dealer.close(linger=0)
        ctx.term()


def test_old_replay_layout_and_raw_replay(sub_factory):
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", replay_layout="v0.24")
    try:
        Feed(p).send(4)
        sub = sub_factory(p.endpoint, replay_endpoint=p.replay_endpoint)
        got = sub.replay(1)
        assert [s for s, _ in got] == [1, 2, 3]
        assert decode_batch(got[0][1]).ts == batch(1).ts
        # Late join through the 2-frame layout.
        sub2 = sub_factory(p.endpoint, replay_endpoint=p.replay_endpoint, from_seq=0)
        items = collect(sub2, 3)
        assert seqs(items) == [("batch", s, True) for s in range(4)]
    finally:
        p.close()


def test_buffer_steps_bounds_replay(sub_factory):
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=3)
    try:
        Feed(p).send(10)
        sub = sub_factory(p.endpoint, replay_endpoint=p.replay_endpoint)
        assert [s for s, _ in sub.replay(0)] == [7, 8, 9]
    finally:
        p.close()


def test_publish_after_close_raises():
    p = ZmqEventPublisher("tcp://*:0")
    p.close()
    with pytest.raises(RuntimeError):
        p.publish(batch(0))


def test_dp_rank_offsets_ports_and_fills_rank(sub_factory):
    base, rbase = free_port(), free_port()
    rank = 2
    p = ZmqEventPublisher(
        f"tcp://*:{base}", replay_endpoint=f"tcp://*:{rbase}", data_parallel_rank=rank
    )
    try:
        assert p.endpoint == f"tcp://*:{base + rank}"
        assert p.replay_endpoint == f"tcp://*:{rbase + rank}"
        sub = sub_factory(
            f"tcp://127.0.0.1:{base + rank}", replay_endpoint=f"tcp://127.0.0.1:{rbase + rank}"
        )
        items = sync(Feed(p), sub)
        assert all(i.batch.data_parallel_rank == rank for i in items)
        p.publish(batch(0, dp=5))  # an explicit rank is kept
        assert p.flush()
        assert collect(sub, items[-1].seq + 1)[-1].batch.data_parallel_rank == 5
    finally:
        p.close()


def test_port_zero_reports_bound_endpoint():
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0")
    try:
        for ep in (p.endpoint, p.replay_endpoint):
            assert ep.startswith("tcp://127.0.0.1:")
            assert int(ep.rsplit(":", 1)[1]) > 0
    finally:
        p.close()


def test_several_publishers_in_one_process(sub_factory):
    """Each DP rank owns its context: closing one leaves the others publishing."""
    pubs = [ZmqEventPublisher("tcp://*:0", data_parallel_rank=r) for r in range(3)]
    try:
        pubs[0].close()
        for r in (1, 2):
            sub = sub_factory(pubs[r].endpoint)
            items = sync(Feed(pubs[r]), sub)
            assert items[0].batch.data_parallel_rank == r
    finally:
        for p in pubs:
            p.close()


# --------------------------------------------------------------------------------------
# Subscriber: stream order, gaps, restarts


def test_live_stream_in_order(pub, sub_factory):
    sub = sub_factory(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    feed = Feed(pub)
    first = sync(feed, sub)
    start = first[-1].seq
    last = feed.send(50)
    items = collect(sub, last)
    assert seqs(items) == [("batch", s, False) for s in range(start + 1, last + 1)]
    assert items[0].batch == batch(start + 1, dp=0)
    assert sub.stats.gaps == 0 and sub.stats.last_seq == last


def test_late_join_replays_everything(pub, sub_factory):
    feed = Feed(pub)
    feed.send(10)
    sub = sub_factory(pub.endpoint, replay_endpoint=pub.replay_endpoint, from_seq=0)
    items = collect(sub, 9)
    assert seqs(items) == [("batch", s, True) for s in range(10)]
    # Then live, with whatever raced the replay de-duplicated: every seq exactly once.
    more = sync(feed, sub)
    all_batches = [i.seq for i in items + more if i.kind == "batch"]
    assert all_batches == list(range(feed.published))
    assert [i.kind for i in more] == ["batch"] * len(more)
    assert sub.stats.restarts == 0 and sub.stats.gaps == 0


def test_skipped_sends_are_filled_by_replay_in_order(pub, sub_factory):
    sub = sub_factory(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    feed = Feed(pub)
    start = sync(feed, sub)[-1].seq
    skip = {start + 2, start + 3, start + 6}
    pub.skip_send = lambda s: s in skip
    last = feed.send(8)
    items = collect(sub, last)
    assert [(i.kind, i.seq) for i in items] == [("batch", s) for s in range(start + 1, last + 1)]
    assert [i.seq for i in items if i.replayed] == sorted(skip)
    assert sub.stats.gaps == 2 and sub.stats.gaps_filled == 2 and sub.stats.replayed == 3
    assert all(i.batch == batch(i.seq, dp=0) for i in items)


def test_gap_larger_than_buffer_is_reported(sub_factory):
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=3)
    try:
        sub = sub_factory(p.endpoint, replay_endpoint=p.replay_endpoint)
        feed = Feed(p)
        k = sync(feed, sub)[-1].seq
        p.skip_send = lambda s: k < s <= k + 6
        last = feed.send(7)  # k+1..k+6 skipped, k+7 live; the buffer keeps k+5..k+7
        items = collect(sub, last)
        assert items[0].kind == "gap"
        assert items[0].missing == (k + 1, k + 4)
        assert "replay buffer" in items[0].detail
        assert seqs(items[1:]) == [
            ("batch", k + 5, True),
            ("batch", k + 6, True),
            ("batch", k + 7, False),
        ]
        assert sub.stats.gaps_unfilled == 1
    finally:
        p.close()


def test_gap_without_replay_endpoint(sub_factory):
    p = ZmqEventPublisher("tcp://*:0")
    try:
        sub = sub_factory(p.endpoint)
        feed = Feed(p)
        k = sync(feed, sub)[-1].seq
        p.skip_send = lambda s: s in (k + 1, k + 2)
        items = collect(sub, feed.send(3))
        assert items[0].kind == "gap" and items[0].missing == (k + 1, k + 2)
        assert "no replay endpoint" in items[0].detail
        assert seqs(items[1:]) == [("batch", k + 3, False)]
    finally:
        p.close()


def test_replay_timeout_is_a_gap(sub_factory):
    p = ZmqEventPublisher("tcp://*:0")
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # accepts replay requests and never answers
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = sub_factory(
            p.endpoint, replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout_s=0.3
        )
        feed = Feed(p)
        k = sync(feed, sub)[-1].seq
        p.skip_send = lambda s: s == k + 1
        items = collect(sub, feed.send(2))
        assert items[0].kind == "gap" and items[0].missing == (k + 1, k + 1)
        assert "timed out" in items[0].detail
        with pytest.raises(ReplayError, match="timed out"):
            sub.replay(0)
    finally:
        mute.close(linger=0)
        ctx.term()
        p.close()


def test_publisher_restart_on_same_port(sub_factory):
    port, rport = free_port(), free_port()
    p1 = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    sub = sub_factory(f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    f1 = Feed(p1)
    sync(f1, sub)
    collect(sub, f1.send(30))
    p1.close()
    p2 = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    try:
        items = sync(Feed(p2), sub)
        assert items[0].kind == "restart"
        assert f"went back from {f1.published - 1} to {items[0].seq}" in items[0].detail
        # Whatever the new publisher sent before we reconnected came back through replay.
        assert [(i.kind, i.seq) for i in items[1:]] == [("batch", s) for s in range(len(items) - 1)]
        assert sub.stats.restarts == 1
    finally:
        p2.close()


def test_bad_frames_are_counted_and_stream_continues(sub_factory):
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = sub_factory(f"tcp://127.0.0.1:{port}")
        seq = 0
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            raw.send_multipart([b"", encode_seq(seq), encode_batch(batch(seq))])
            seq += 1
            it = sub.recv(0.05)
            if it is not None:
                break
        if it.seq != seq - 1:
            collect(sub, seq - 1)
        raw.send_multipart([b"", encode_seq(seq)])  # 2 frames
        raw.send_multipart([b"", b"\x00" * 7, encode_batch(batch(seq))])  # 7-byte seq
        raw.send_multipart([b"", encode_seq(seq), b"\xc1garbage"])  # undecodable payload
        raw.send_multipart([b"", encode_seq(seq + 1), encode_batch(batch(seq + 1))])
        items = collect(sub, seq + 1)
        assert [(i.kind, i.seq) for i in items] == [
            ("bad_frame", None),
            ("bad_frame", None),
            ("bad_frame", seq),
            ("batch", seq + 1),
        ]
        assert "3 frames" in items[0].detail and "7 bytes" in items[1].detail
        assert sub.stats.bad_frames == 3 and sub.stats.gaps == 0
    finally:
        raw.close(linger=0)
        ctx.term()


def test_subscriber_binds_when_engine_connects(sub_factory):
    """An engine given tcp://router-host:port connects; the router's SUB binds there."""
    port = free_port()
    sub = sub_factory(f"tcp://127.0.0.1:{port}", bind=True)
    p = ZmqEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        assert not endpoint_binds(p.endpoint)
        items = sync(Feed(p), sub)
        assert items[-1].kind == "batch"
    finally:
        p.close()


def test_topic_filter(sub_factory):
    p = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", topic="kv@pod1@m")
    try:
        feed = Feed(p)
        feed.send(3)
        sub = sub_factory(
            p.endpoint, replay_endpoint=p.replay_endpoint, topic="kv@pod1", from_seq=0
        )
        assert seqs(collect(sub, 2)) == [("batch", s, True) for s in range(3)]
        other = sub_factory(
            p.endpoint, replay_endpoint=p.replay_endpoint, topic="kv@pod2", from_seq=0
        )
        feed.send(2)
        assert other.recv(timeout_s=0.3) is None
    finally:
        p.close()


def test_invalid_endpoint_is_a_clear_error():
    from events.endpoints import EndpointError

    with pytest.raises(EndpointError, match="expected TRANSPORT://ADDRESS"):
        EventSubscriber("localhost:5557")
    with pytest.raises(EndpointError, match="not a number"):
        EventSubscriber("tcp://127.0.0.1:http")


# --------------------------------------------------------------------------------------
# Sequencer rules, without sockets


def _run(steps, replies):
    """Drive a Sequencer generator, answering replay requests from ``replies`` in turn."""
    asked = []
    try:
        req = next(steps)
        while True:
            asked.append(req.start_seq)
            req = steps.send(replies.pop(0))
    except StopIteration as done:
        return done.value, asked


def _live(seq: int, i: int | None = None) -> list[bytes]:
    return [b"", encode_seq(seq), encode_batch(batch(seq if i is None else i))]


def _rep(*ss: int) -> list:
    return [(b"", s, encode_batch(batch(s))) for s in ss]


def test_sequencer_dedups_only_inside_the_replay_window():
    sq = Sequencer()
    items, asked = _run(sq.start(0), [_rep(0, 1, 2, 3)])
    assert asked == [0] and [i.seq for i in items] == [0, 1, 2, 3]
    assert _run(sq.on_live(_live(2)), [])[0] == []  # raced the replay: dropped silently
    assert [i.seq for i in _run(sq.on_live(_live(3)), [])[0]] == []
    assert seqs(_run(sq.on_live(_live(4)), [])[0]) == [("batch", 4, False)]
    # Past the window a lower seq is a restart, and seq 0..1 of the new run are replayed.
    items, asked = _run(sq.on_live(_live(2)), [_rep(0, 1, 2)])
    assert asked == [0]
    assert [(i.kind, i.seq, i.replayed) for i in items] == [
        ("restart", 2, False),
        ("batch", 0, True),
        ("batch", 1, True),
        ("batch", 2, False),
    ]


def test_sequencer_restart_inside_the_replay_window_is_not_a_duplicate():
    # The publisher restarts before the live stream passed the initial replay's window: its
    # new seq 1 falls inside [0, 3] but carries another payload, so it is a restart.
    sq = Sequencer()
    _run(sq.start(0), [_rep(0, 1, 2, 3)])
    assert _run(sq.on_live(_live(1)), [])[0] == []  # same payload: the live copy, dropped
    restarted = [(b"", 0, encode_batch(batch(50))), (b"", 1, encode_batch(batch(51)))]
    items, asked = _run(sq.on_live(_live(1, i=51)), [restarted])
    assert asked == [0]
    assert [(i.kind, i.seq, i.replayed) for i in items] == [
        ("restart", 1, False),
        ("batch", 0, True),
        ("batch", 1, False),
    ]
    assert items[1].batch == decode_batch(encode_batch(batch(50)))
    assert sq.stats.restarts == 1 and sq.expect == 2


def test_sequencer_seq_missing_from_the_replay_is_a_restart():
    # Replay started late (0..4 evicted): a live seq 2 cannot be a queued copy of anything.
    sq = Sequencer()
    _run(sq.start(0), [_rep(5, 6)])
    items, _ = _run(sq.on_live(_live(2)), [_rep(0, 1, 2)])
    assert (items[0].kind, items[0].seq) == ("restart", 2)
    assert sq.stats.restarts == 1


def test_publisher_restart_inside_initial_replay_window(sub_factory):
    """A late joiner replays 0..19; the publisher restarts and its seqs 0..k are live news."""
    port, rport = free_port(), free_port()
    p1 = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    f1 = Feed(p1)
    f1.send(20)
    sub = sub_factory(
        f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", from_seq=0
    )
    items = collect(sub, 19)
    assert seqs(items) == [("batch", s, True) for s in range(20)]
    p1.close()
    p2 = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    try:
        f2 = Feed(p2)
        f2.published = 100  # distinct payloads (ts) from the first run's
        got: list[StreamItem] = []
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end and not got:
            f2.send()
            it = sub.recv(timeout_s=0.05)
            if it is not None:
                got.append(it)
        assert got and got[0].kind == "restart", seqs(got)
        assert got[0].seq is not None and got[0].seq < 20  # inside the first replay's window
        assert sub.stats.restarts == 1
    finally:
        p2.close()


def test_sequencer_reports_every_hole():
    sq = Sequencer()
    _run(sq.on_live(_live(0)), [])
    items, _ = _run(sq.on_live(_live(10)), [_rep(3, 4, 7, 10, 11)])
    assert [(i.kind, i.seq or i.missing) for i in items] == [
        ("gap", (1, 2)),
        ("batch", 3),
        ("batch", 4),
        ("gap", (5, 6)),
        ("batch", 7),
        ("gap", (8, 9)),
        ("batch", 10),
    ]
    assert sq.stats.gaps == 1 and sq.stats.gaps_unfilled == 1


def test_sequencer_from_seq_ahead_of_a_restarted_publisher():
    sq = Sequencer()
    assert _run(sq.start(500), [_rep()])[0] == []
    items, asked = _run(sq.on_live(_live(4)), [_rep(0, 1, 2, 3, 4)])
    assert asked == [0]
    assert [(i.kind, i.seq) for i in items] == [("restart", 4)] + [("batch", s) for s in range(5)]


def test_sequencer_late_start_reports_head_gap():
    sq = Sequencer()
    items, _ = _run(sq.start(0), [_rep(5, 6)])
    assert [(i.kind, i.missing or i.seq) for i in items] == [
        ("gap", (0, 4)),
        ("batch", 5),
        ("batch", 6),
    ]
    assert sq.expect == 7


# --------------------------------------------------------------------------------------
# asyncio subscriber


async def _acollect(sub: AsyncEventSubscriber, until_seq: int) -> list[StreamItem]:
    items = []
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        it = await sub.recv(timeout_s=0.1)
        if it is None:
            continue
        items.append(it)
        if it.kind in ("batch", "bad_frame") and it.seq == until_seq:
            return items
    raise AssertionError(f"seq {until_seq} not received; got {seqs(items)}")


async def _async_feed(feed: Feed, n: int = 1) -> int:
    return await asyncio.to_thread(feed.send, n)


async def test_async_late_join_gap_fill_and_restart():
    port, rport = free_port(), free_port()
    p = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    feed = Feed(p)
    await _async_feed(feed, 5)
    sub = AsyncEventSubscriber(
        f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}", from_seq=0
    )
    try:
        items = await _acollect(sub, 4)
        assert seqs(items) == [("batch", s, True) for s in range(5)]
        # Live: publish until a live batch arrives.
        end = time.monotonic() + DEADLINE_S
        got: list[StreamItem] = []
        while time.monotonic() < end and not any(not i.replayed for i in got):
            await _async_feed(feed)
            it = await sub.recv(timeout_s=0.05)
            if it is not None:
                got.append(it)
        got += await _acollect(sub, feed.published - 1) if got[-1].seq != feed.published - 1 else []
        assert [i.seq for i in items + got] == list(range(feed.published))
        # Skipped sends are repaired in order.
        k = feed.published - 1
        p.skip_send = lambda s: s in (k + 1, k + 2)
        items = await _acollect(sub, await _async_feed(feed, 3))
        assert seqs(items) == [
            ("batch", k + 1, True),
            ("batch", k + 2, True),
            ("batch", k + 3, False),
        ]
        # Restart on the same ports.
        await asyncio.to_thread(p.close)
        p = ZmqEventPublisher(f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
        feed2 = Feed(p)
        end = time.monotonic() + DEADLINE_S
        first = None
        while first is None and time.monotonic() < end:
            await _async_feed(feed2)
            first = await sub.recv(timeout_s=0.05)
        assert first is not None and first.kind == "restart"
        assert sub.stats.restarts == 1 and sub.stats.gaps_filled >= 1
        raw = await sub.replay(0)
        assert [s for s, _ in raw] == list(range(feed2.published))
    finally:
        sub.close()
        p.close()


async def test_async_gap_without_replay_and_bad_frame():
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    sub = AsyncEventSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        seq = 0
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            raw.send_multipart([b"", encode_seq(seq), encode_batch(batch(seq))])
            seq += 1
            it = await sub.recv(0.05)
            if it is not None:
                break
        if it.seq != seq - 1:
            await _acollect(sub, seq - 1)
        raw.send_multipart([b"", encode_seq(seq + 2), b"\x93\xcb"])  # gap of 2, then junk
        items = await _acollect(sub, seq + 2)
        assert [(i.kind, i.missing or i.seq) for i in items] == [
            ("gap", (seq, seq + 1)),
            ("bad_frame", seq + 2),
        ]
    finally:
        sub.close()
        raw.close(linger=0)
        ctx.term()


def test_event_types_round_trip_through_the_wire(pub, sub_factory):
    sub = sub_factory(pub.endpoint, replay_endpoint=pub.replay_endpoint)
    feed = Feed(pub)
    k = sync(feed, sub)[-1].seq
    b = KVEventBatch(ts=1.5, events=[AllBlocksCleared(), BlockRemoved([2**64 - 1], medium="CPU")])
    pub.publish(b)
    assert pub.flush()
    (item,) = collect(sub, k + 1)
    assert item.batch == KVEventBatch(ts=1.5, events=b.events, data_parallel_rank=0)
