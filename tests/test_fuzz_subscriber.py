"""Fuzzing the event path: codec, sequencer and the router's ingest behind a raw PUB socket.

An engine (or anything that can reach the events port) may send any bytes. Whatever it
sends, the router must not crash, must not change its index because of a frame it could not
read, and must count every such frame. Example counts are bounded so this stays fast.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from conftest import free_port
from fault_tools import LoopThread
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from events.codec import CodecError, decode_batch, encode_batch
from events.endpoints import encode_seq
from events.model import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from events.subscriber import Sequencer

pytestmark = pytest.mark.timeout(120)

U64 = st.integers(0, 2**64 - 1)

# msgpack-shaped values: what a broken or hostile publisher can put in a payload.
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.binary(max_size=40),
    st.text(max_size=20),
)
_value = st.recursive(
    _leaf,
    lambda kids: (
        st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids, max_size=6)
    ),
    max_leaves=30,
)
_tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus", ""])
# Event-shaped: right tags, wrong or missing fields.
_event = st.one_of(
    st.lists(_value, max_size=10).flatmap(lambda xs: _tags.map(lambda t: [t, *xs])),
    st.dictionaries(
        st.sampled_from(
            ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]
        ),
        _value,
    ),
)
_batch_like = st.one_of(
    st.tuples(_value, st.lists(_event, max_size=4)).map(list),
    st.tuples(_value, st.lists(_event, max_size=4), _value).map(list),
    _value,
)


def _only_codec_error(payload: bytes) -> KVEventBatch | None:
    try:
        return decode_batch(payload)
    except CodecError:
        return None


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_decode_random_bytes_raises_only_codec_error(payload):
    b = _only_codec_error(payload)
    assert b is None or isinstance(b, KVEventBatch)


@settings(max_examples=250, deadline=None)
@given(_batch_like)
def test_decode_msgpack_shapes_raises_only_codec_error(obj):
    payload = msgpack.packb(obj, use_bin_type=True)
    b = _only_codec_error(payload)
    if b is not None:  # what decodes must round-trip (compared as bytes: NaN != NaN)
        once = encode_batch(b)
        assert encode_batch(decode_batch(once)) == once


def _stored(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        medium="GPU",
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


_real_event = st.one_of(
    st.builds(_stored, st.lists(U64, min_size=1, max_size=4), st.none() | U64),
    st.builds(lambda hs: BlockRemoved(block_hashes=hs, medium="GPU"), st.lists(U64, max_size=4)),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_real_event, max_size=6), st.floats(0, 2e9), st.booleans(), st.data())
def test_mutated_real_payloads_raise_only_codec_error(events, ts, array, data):
    payload = bytearray(
        encode_batch(KVEventBatch(ts=ts, events=events), "array" if array else "map")
    )
    assume(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    _only_codec_error(bytes(payload[:cut]))


# -- the sequencer ---------------------------------------------------------------------


_frame_op = st.one_of(
    st.tuples(st.just("next"), st.integers(0, 0)),
    st.tuples(st.just("skip"), st.integers(1, 5)),
    st.tuples(st.just("dup"), st.integers(1, 3)),
    st.tuples(st.just("restart"), st.integers(0, 3)),
    st.tuples(st.just("junk"), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_frame_op, max_size=40), st.booleans())
def test_sequencer_random_streams_keep_order_and_account_for_every_seq(ops, replay_works):
    """Random live streams (gaps, duplicates, restarts, junk) against a replay oracle.

    Between two restarts every delivered seq is new and increasing, and each seq the
    publisher used is either delivered, reported in a "gap" item, or a counted bad frame.
    """
    sent: list[tuple[int, bytes]] = []  # the current publisher run's buffer
    nxt = 0
    run = 0
    sq = Sequencer()
    seen: list[tuple[str, int | None]] = []

    def replies(req_start: int):
        if not replay_works:
            return "no replay endpoint configured"
        return [(b"", s, p) for s, p in sent if s >= req_start]

    def feed(frames: list[bytes]) -> None:
        steps = sq.on_live(frames)
        try:
            req = next(steps)
            while True:
                req = steps.send(replies(req.start_seq))
        except StopIteration as done:
            for it in done.value:
                seen.append((it.kind, it.seq))
                if it.kind == "gap":
                    assert it.missing is not None and it.missing[0] <= it.missing[1]

    def publish() -> tuple[int, bytes]:
        nonlocal nxt
        p = encode_batch(KVEventBatch(ts=float(run * 1000 + nxt), events=[]))
        sent.append((nxt, p))
        nxt += 1
        return sent[-1]

    for op, n in ops:
        if op == "next":
            s, p = publish()
            feed([b"", encode_seq(s), p])
        elif op == "skip":
            for _ in range(n):
                publish()
            s, p = publish()
            feed([b"", encode_seq(s), p])
        elif op == "dup" and sent:
            s, p = sent[max(0, len(sent) - n)]
            if s == nxt - 1:
                continue  # the last one repeated is a plain duplicate of the present
            feed([b"", encode_seq(s), p])
        elif op == "restart":
            run += 1
            sent.clear()
            nxt = 0
            for _ in range(n):
                publish()
            s, p = publish()
            feed([b"", encode_seq(s), p])
        elif op == "junk":
            feed([b"", encode_seq(nxt)] if n == 0 else [b"", b"\x01", b"x"])
    # Order: delivered batches increase between restart items.
    last = -1
    for kind, seq in seen:
        if kind == "restart":
            last = -1
        elif kind == "batch":
            assert seq is not None and seq > last, seen
            last = seq
    assert sq.stats.bad_frames == sum(1 for k, _ in seen if k == "bad_frame")


# -- the router's ingest behind a raw PUB -------------------------------------------------


class IngestRig:
    """A router whose one instance's events come from a PUB socket this test owns."""

    def __init__(self) -> None:
        from router.config import RouterConfig
        from router.instance import EngineSpec, InstanceKey
        from router.server import Router

        self.lt = LoopThread()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        url = f"http://127.0.0.1:{free_port()}"  # nobody there: health fails, ingest runs
        self.key = InstanceKey(url, 0)
        cfg = RouterConfig(
            engines=[EngineSpec(url, events=f"tcp://127.0.0.1:{port}", replay="none")],
            tokenizer="engine",
            health_interval_s=5,
            connect_timeout_s=0.2,
        )
        self.router = Router(cfg)
        self.lt.run(self.router.start())
        self.seq = 0
        self._sync()
        # Parents set: block-0 events would start the hash-parity check, which is not
        # what this rig is about (made-up hashes fail it and the index is re-keyed).
        self.send_batch([_stored([11, 12, 13], 10), _stored([14], 13)])
        self.wait_seq(self.seq - 1)
        self.baseline = self.index()
        assert self.baseline == {11: 1, 12: 1, 13: 1, 14: 1}

    def _sync(self) -> None:
        deadline = time.monotonic() + 10
        while self.stats().last_seq is None:
            assert time.monotonic() < deadline, "router never subscribed"
            self.send_batch([])
            time.sleep(0.02)  # ZMQ slow joiner: nothing to await on this side

    def send_batch(self, events: list) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        self.pub.send_multipart([b"", encode_seq(self.seq), payload])
        self.seq += 1

    def stats(self):
        return self.lt.call(lambda: self.router.applier.stats_of(self.key))

    def index(self) -> dict[int, int]:
        return self.lt.call(lambda: dict(self.router.index.instance_hashes(self.key)))

    def bad_frames_metric(self) -> float:
        m = self.router.metrics.bad_frames.labels(str(self.key))
        return self.lt.call(lambda: m._value.get())

    def wait_seq(self, seq: int) -> None:
        deadline = time.monotonic() + 10
        while True:
            s = self.lt.call(lambda: self.router.applier.stats_of(self.key).last_seq)
            if s == seq:
                return
            assert time.monotonic() < deadline, f"seq {seq} never applied (last {s})"
            time.sleep(0.005)

    def close(self) -> None:
        self.lt.run(self.router.stop())
        self.lt.close()
        self.pub.close(linger=0)
        self.ctx.term()


@pytest.fixture(scope="module")
def rig():
    r = IngestRig()
    yield r
    r.close()


_garbage = st.binary(max_size=200).filter(lambda p: _only_codec_error(p) is None)
_bad_frame = st.one_of(
    st.tuples(st.just("payload"), _garbage),
    st.tuples(
        st.just("frames"),
        st.lists(st.binary(max_size=20), max_size=6).filter(lambda fs: len(fs) != 3),
    ),
    st.tuples(st.just("seqlen"), st.binary(max_size=12).filter(lambda b: len(b) != 8)),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
@given(st.lists(_bad_frame, min_size=1, max_size=4))
def test_bad_frames_leave_the_index_unchanged_and_are_counted(rig, bad):
    before_metric = rig.bad_frames_metric()
    before_gaps = rig.stats().gaps
    for kind, v in bad:
        if kind == "payload":
            rig.pub.send_multipart([b"", encode_seq(rig.seq), v])
            rig.seq += 1  # a frame with a good seq and a bad payload consumes its seq
        elif kind == "frames":
            rig.pub.send_multipart(v or [b""])
        else:
            rig.pub.send_multipart([b"", v, b"\x90"])
    rig.send_batch([])  # a valid sentinel: once applied, everything before it was handled
    rig.wait_seq(rig.seq - 1)
    assert rig.index() == rig.baseline
    assert rig.bad_frames_metric() - before_metric == len(bad)
    assert rig.stats().gaps == before_gaps
