"""Fault injection: engines, event streams and the router fail; the index stays true.

Every test breaks one real part (a killed or restarted engine, a cut or stalled event
connection, a missing replay socket, a restarted router, an engine that never answers) and
then checks what users see (every request answered, no hang) and what the router believes
(``truth.assert_truth``: its index of each engine equals the engine's own block pool).
test_router_e2e.py covers the plain cases (a kill under load, a forced gap, a slow restart);
these go after the harder timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest
from fault_tools import TcpRelay, fault_slot, router_on
from router_harness import (
    ShimProcess,
    chat_body,
    long_text,
    new_slot,
    running_fleet,
    wait_for,
)
from truth import assert_truth, compare

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"


async def post(s: aiohttp.ClientSession, url: str, body: dict, timeout: float = 20.0):
    """(status, headers, raw body) with a hard client-side bound: a hang fails the test."""
    async with asyncio.timeout(timeout):
        async with s.post(url + CHAT, json=body) as r:
            return r.status, r.headers, await r.read()


async def warm(url: str, seeds: range, words: int = 120) -> None:
    """Requests straight to an engine (no router): fills its cache, publishes events."""
    async with aiohttp.ClientSession() as s:
        for n in seeds:
            st, _, data = await post(s, url, chat_body(long_text(n, words), "warm"))
            assert st == 200, data


def applier_stats(router, key):
    return router.applier.stats_of(key)


async def until_live(fleet, i: int, seed: int) -> None:
    """Warm engine i until a live batch reaches the router (ZMQ's slow joiner loses the first)."""
    stats = applier_stats(fleet.router, fleet.key(i))
    deadline = time.monotonic() + 10
    while stats.batches - stats.replayed == 0:
        assert time.monotonic() < deadline, "the event stream never went live"
        await warm(fleet.slots[i].url, range(seed, seed + 1))
        seed += 1000  # a new prompt each time: a cached one publishes nothing
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: stats.batches - stats.replayed > 0, 0.2, "live batch")


async def catch_up(fleet, i: int, seed: int, timeout: float = 15.0) -> int:
    """Send new prompts to engine i until the router has seen its last seq (returns next seed).

    After a loss, only a later batch that gets through shows the gap; ZMQ may lose a few more
    while it reconnects or while a full PUB drains, so one is not always enough.
    """
    stats = applier_stats(fleet.router, fleet.key(i))
    pub = fleet.slots[i].shim.server.publishers[0]
    deadline = time.monotonic() + timeout

    def done() -> bool:
        return stats.last_seq is not None and stats.last_seq >= pub._done - 1

    while not done():
        assert time.monotonic() < deadline, "the router never caught up with the stream"
        await warm(fleet.slots[i].url, range(seed, seed + 1))
        seed += 1
        with contextlib.suppress(AssertionError):
            await wait_for(done, 0.5, "stream caught up")
    return seed


# -- engines ---------------------------------------------------------------------------


async def test_killed_engine_queued_requests_finish_elsewhere_streams_end_cleanly(tokenizer):
    """SIGKILL an engine holding running and queued requests, streaming and not."""
    victim = ShimProcess(new_slot(time_scale=2.0))
    await victim.start()
    survivors = [new_slot(time_scale=0.05) for _ in range(2)]
    try:
        async with running_fleet(
            tokenizer, survivors, external=[victim.slot], retries=2, load_weight=0.05
        ) as fleet:
            await fleet.joined()
            vkey = fleet.key(2)
            # One long shared prefix warmed on the victim pulls the burst there.
            system = long_text(300, 600)
            async with aiohttp.ClientSession() as s:
                st, _, _ = await post(s, victim.slot.url, chat_body(system, "warm", max_tokens=1))
                assert st == 200
                await wait_for(lambda: len(fleet.router_blocks(2)) > 20, 10, "victim indexed")

                async def one(n: int):
                    body = chat_body(system, f"q{n}", max_tokens=48, stream=n % 2 == 0)
                    t0 = time.monotonic()
                    status, hdrs, data = await post(s, fleet.base_url, body)
                    return n % 2 == 0, status, hdrs.get("x-routed-to"), data, time.monotonic() - t0

                tasks = [asyncio.create_task(one(n)) for n in range(12)]
                await wait_for(
                    lambda: fleet.router.fleet.get(vkey).in_flight >= 4, 10, "victim loaded"
                )
                victim.kill()
                results = await asyncio.gather(*tasks)
            errored_streams = 0
            for is_stream, status, routed, data, _dt in results:
                assert status == 200, data
                if not is_stream:
                    # Not yet answered when the engine died: retried, answered elsewhere.
                    assert routed != victim.slot.url
                    assert json.loads(data)["choices"]
                    continue
                assert data.endswith(b"data: [DONE]\n\n")  # every stream is closed properly
                if routed == victim.slot.url:
                    errored_streams += 1
                    last = data.rstrip().split(b"\n\n")[-2]
                    assert json.loads(last[len(b"data: ") :])["error"]["code"] == 502
                else:
                    assert b'"error"' not in data
            m = fleet.router.metrics
            assert m.requests.labels(str(vkey), "stream_error")._value.get() == errored_streams
            assert m.retries.labels(str(vkey))._value.get() >= 1
            await wait_for(lambda: not fleet.router.fleet.get(vkey).healthy, 5, "victim out")
            for i in range(2):
                await assert_truth(fleet.router, survivors[i].url)
    finally:
        await victim.wait()


async def test_engine_process_restart_rebuilds_exact_index(tokenizer):
    """A real process restart (SIGKILL, same ports, seq from 0): old blocks go, new ones match."""
    slot = new_slot()
    proc = ShimProcess(slot)
    await proc.start()
    try:
        async with running_fleet(tokenizer, [], external=[slot]) as fleet:
            await fleet.joined()
            await warm(fleet.base_url, range(400, 406))
            await assert_truth(fleet.router, slot.url)
            old = fleet.router_blocks(0)
            await proc.wait()
            st = fleet.router.fleet.get(fleet.key(0))
            await wait_for(lambda: not st.healthy, 10, "engine seen down")
            await proc.start()
            await wait_for(lambda: st.healthy, 10, "engine back")
            await warm(fleet.base_url, range(410, 413))
            d = await assert_truth(fleet.router, slot.url)
            assert d.router_blocks > 0 and not (old & fleet.router_blocks(0))
            assert applier_stats(fleet.router, fleet.key(0)).drops >= 1
    finally:
        await proc.wait()


async def test_fast_restart_inside_the_replay_window_is_detected(tokenizer):
    """The engine restarts before any live batch reached a freshly started router.

    The router's initial replay delivered seqs 0..N-1; the new engine's first seqs fall in
    that window. Only the payloads tell them from late live copies (events/subscriber.py);
    the health checker is made too slow to notice, so the stream alone must catch it.
    """
    slot = new_slot()
    await slot.start(tokenizer)
    try:
        await warm(slot.url, range(420, 430))
        async with running_fleet(tokenizer, [], external=[slot], health_interval_s=60) as fleet:
            await fleet.joined()
            await assert_truth(fleet.router, slot.url)
            stats = applier_stats(fleet.router, fleet.key(0))
            assert stats.replayed >= 10
            old = fleet.router_blocks(0)
            await slot.stop()
            await slot.start(tokenizer)  # in-process: back in milliseconds
            window = stats.last_seq
            pub = slot.shim.server.publishers[0]
            n = 430
            while stats.restarts == 0:  # until the re-connected SUB hears the new run
                await warm(slot.url, range(n, n + 1))
                n += 1
                await asyncio.sleep(0.05)
                assert pub._done <= window, "the new run left the replay window unheard"
            await assert_truth(fleet.router, slot.url)
            assert not (old & fleet.router_blocks(0))
    finally:
        await slot.stop()


# -- event streams -----------------------------------------------------------------------


async def test_dropped_event_connection_is_repaired_by_replay(tokenizer):
    slot = fault_slot()
    relay = await TcpRelay(slot.events_port).start()
    slot.events_via = relay.port
    try:
        async with running_fleet(tokenizer, [slot]) as fleet:
            await fleet.joined()
            await until_live(fleet, 0, 439)
            await warm(slot.url, range(440, 443))
            await assert_truth(fleet.router, slot.url)
            stats = applier_stats(fleet.router, fleet.key(0))
            before = stats.replayed
            relay.refusing = True
            relay.cut()  # the router's SUB is disconnected and cannot reconnect for now
            await warm(slot.url, range(443, 450))  # published while nobody listens: lost
            relay.refusing = False
            await wait_for(lambda: relay.connections >= 2, 10, "SUB reconnected")
            await catch_up(fleet, 0, 450)  # the next live batch shows the gap
            await assert_truth(fleet.router, slot.url)
            assert stats.replayed - before >= 7
            assert stats.gaps == 0 and stats.drops == 0
    finally:
        await relay.close()


async def test_events_dropped_at_a_tiny_hwm_are_replayed(tokenizer):
    """PUB high-water mark of 1 and a stalled reader: the engine's PUB drops batches."""
    slot = fault_slot(kv={"hwm": 1}, num_gpu_blocks=2048)
    relay = await TcpRelay(slot.events_port, rcvbuf=2048).start()
    slot.events_via = relay.port
    try:
        async with running_fleet(tokenizer, [slot]) as fleet:
            await fleet.joined()
            await until_live(fleet, 0, 459)
            await warm(slot.url, range(460, 462))
            await assert_truth(fleet.router, slot.url)
            stats = applier_stats(fleet.router, fleet.key(0))
            before = stats.replayed
            n = 470
            deadline = time.monotonic() + 20
            while stats.replayed == before:
                assert time.monotonic() < deadline, "no batch was ever dropped"
                relay.pause()
                await warm(slot.url, range(n, n + 12), words=1200)  # ~1 MB of events
                n += 12
                relay.resume()
                n = await catch_up(fleet, 0, n)
            await assert_truth(fleet.router, slot.url)
            assert stats.gaps == 0 and stats.drops == 0
    finally:
        await relay.close()


async def test_missing_replay_endpoint_marks_stale_and_routes_by_load(tokenizer, caplog):
    """No replay socket: the router says what it lost and never over-predicts."""
    caplog.set_level(logging.WARNING, logger="router.ingest")
    slot = fault_slot(replay_for_router=False)
    await slot.start(tokenizer)
    try:
        warm_sys = long_text(480, 300)
        async with aiohttp.ClientSession() as s:
            st, _, _ = await post(s, slot.url, chat_body(warm_sys, "before the router"))
            assert st == 200
        async with running_fleet(tokenizer, [], external=[slot]) as fleet:
            await fleet.joined()
            key = fleet.key(0)
            stats = applier_stats(fleet.router, key)
            async with aiohttp.ClientSession() as s:
                # The warm prefix is on the engine but unknown to the router: no credit.
                st, h, data = await post(s, fleet.base_url, chat_body(warm_sys, "again"))
                assert st == 200
                assert int(h["x-prefix-hit-tokens"]) == 0
                assert json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                await wait_for(lambda: stats.gaps >= 1, 10, "gap reported")
                assert stats.drops >= 1 and "no replay endpoint" in (stats.last_problem or "")
                assert any("instance blocks dropped" in r.getMessage() for r in caplog.records)
                gaps = fleet.router.metrics.gaps.labels(str(key))._value.get()
                assert gaps >= 1
                d = await compare(fleet.router, slot.url)
                assert d.safe and d.engine_only  # knows less, never more
                # Fresh from here: a new prefix is learnt and predicted exactly.
                fresh = long_text(481, 300)
                await post(s, fleet.base_url, chat_body(fresh, "one"))
                await assert_truth(fleet.router, slot.url, exact=False)
                await wait_for(lambda: len(fleet.router_blocks(0)) > 15, 10, "fresh prefix")
                st, h, data = await post(s, fleet.base_url, chat_body(fresh, "two"))
                cached = json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert int(h["x-prefix-hit-tokens"]) == cached > 0
    finally:
        await slot.stop()


# -- the router --------------------------------------------------------------------------


async def test_router_restart_rebuilds_from_replay(tokenizer):
    slots = [fault_slot(), fault_slot(kv={"buffer_steps": 3})]
    for s in slots:
        await s.start(tokenizer)
    try:
        specs = [s.spec() for s in slots]
        async with router_on(tokenizer, specs) as r1:
            await wait_for(lambda: len(r1.router.ingest._subs) == 2, 10, "subscribed")
            async with aiohttp.ClientSession() as s:
                for n in range(8):
                    st, _, _ = await post(s, r1.base_url, chat_body(long_text(500 + n, 100), "x"))
                    assert st == 200
            for s in slots:
                await assert_truth(r1.router, s.url)
        # A new router process: empty index, rebuilt from each engine's replay buffer.
        async with router_on(tokenizer, specs) as r2:
            await assert_truth(r2.router, slots[0].url)
            d = await assert_truth(r2.router, slots[1].url, exact=False)
            short = applier_stats(r2.router, r2.router.fleet.instances()[1].key)
            if not d.exact:
                # The engine's replay buffer (3 batches) no longer reaches seq 0: the router
                # starts with what it could replay and says so.
                assert short.gaps >= 1
    finally:
        for s in slots:
            await s.stop()


# -- slow engines ------------------------------------------------------------------------


class HangingEngine:
    """Answers /health at once and never answers a completion: a stuck engine."""

    def __init__(self) -> None:
        self.hung = 0
        self.release = asyncio.Event()
        app = aiohttp.web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post(CHAT, self._hang)
        self.runner = aiohttp.web.AppRunner(app, access_log=None)
        self.port = 0

    async def start(self) -> str:
        from conftest import free_port

        await self.runner.setup()
        self.port = free_port()
        await aiohttp.web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def _health(self, request):
        return aiohttp.web.json_response({})

    async def _hang(self, request):
        self.hung += 1
        await self.release.wait()
        return aiohttp.web.json_response({})

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


async def test_slow_engine_times_out_without_blocking_others(tokenizer):
    from router.instance import EngineSpec

    hang = HangingEngine()
    url = await hang.start()
    fast = new_slot()
    try:
        async with running_fleet(
            tokenizer,
            [fast],
            retries=0,
            request_timeout_s=1.5,
            load_weight=1.0,
        ) as fleet:
            fleet.router.fleet.add_engine(EngineSpec(url=url, events="none", replay="none"))
            await wait_for(lambda: fleet.key(0) in fleet.router.ingest._subs, 10, "subscribed")
            async with aiohttp.ClientSession() as s:

                async def one(n: int):
                    t0 = time.monotonic()
                    st, h, data = await post(s, fleet.base_url, chat_body(long_text(n, 40), "x"))
                    return st, h.get("x-routed-to"), data, time.monotonic() - t0

                tasks = [asyncio.create_task(one(600 + n)) for n in range(8)]
                results = await asyncio.gather(*tasks)
            slow = [r for r in results if r[1] == url or r[0] != 200]
            quick = [r for r in results if r[1] == fast.url and r[0] == 200]
            assert hang.hung >= 1 and slow, results
            for st, _, data, dt in slow:
                assert st == 504, (st, data)
                err = json.loads(data)["error"]
                assert err["code"] == 504 and "did not answer in time" in err["message"]
                assert 1.0 < dt < 5
            assert quick
            # The fast engine's requests never waited for the stuck one.
            assert all(dt < 1.5 for *_, dt in quick), [r[3] for r in quick]
            m = fleet.router.metrics
            assert m.requests.labels(url, "timeout")._value.get() == len(slow)
    finally:
        await hang.stop()
