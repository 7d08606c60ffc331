"""KV events on the wire, read back with events/ (subscriber with replay), and DP ranks."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from conftest import free_port

from engine_shim.testing import running_shim, wait_until
from events.hashing import HashScheme
from events.model import AllBlocksCleared, BlockStored
from events.subscriber import EventSubscriber
from events.tokenizer import encode_prompt

PROMPT = "Prefix caching lets an engine skip work it has already done. " * 5
SCHEME = HashScheme("sha256_cbor", None, 16)


async def next_batch(sub: EventSubscriber, timeout_s: float = 5.0):
    item = await asyncio.to_thread(sub.recv, timeout_s)
    assert item is not None, "no event batch arrived"
    assert item.kind == "batch", item
    return item


async def complete(s, url, headers=None, **body):
    body = {"prompt": PROMPT, "max_tokens": 2, **body}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers, await r.json()


async def test_events_on_the_wire_match_the_prompt(tokenizer):
    async with running_shim(tokenizer, events=True, replay_endpoint="tcp://*:0") as shim:
        ep, rep = shim.events_endpoints[0]
        sub = EventSubscriber(ep, replay_endpoint=rep, from_seq=0)
        try:
            async with aiohttp.ClientSession() as s:
                await complete(s, shim.url)
                item = await next_batch(sub)
                assert item.seq == 0 and item.batch.data_parallel_rank == 0
                (ev,) = item.batch.events
                assert isinstance(ev, BlockStored) and ev.parent_block_hash is None
                ids = encode_prompt(tokenizer, PROMPT)
                assert ev.block_hashes == SCHEME.block_hashes(ids)
                assert ev.token_ids == ids[: len(ev.block_hashes) * 16]
                assert ev.kv_cache_spec_kind == "full_attention" and ev.medium == "GPU"
                # kv_cache_report_mode=full re-announces the hit blocks.
                await complete(s, shim.url, vllm_xargs={"kv_cache_report_mode": "full"})
                item = await next_batch(sub)
                assert item.seq == 1
                stored = [e for e in item.batch.events if isinstance(e, BlockStored)]
                assert stored[0].block_hashes == SCHEME.block_hashes(ids)[: len(ids) // 16]
        finally:
            sub.close()


async def test_reset_prefix_cache_idle_and_under_load(tokenizer):
    async with running_shim(tokenizer, events=True, dev_mode=True, time_scale=0.2) as shim:
        ep, _ = shim.events_endpoints[0]
        sub = EventSubscriber(ep)
        engine = shim.engines[0]
        try:
            async with aiohttp.ClientSession() as s:
                body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
                r = await s.post(shim.url + "/v1/completions", json=body)
                await r.content.readline()
                async with s.post(shim.url + "/reset_prefix_cache") as rr:
                    assert await rr.json() == {"success": False}
                r.close()
                await wait_until(lambda: engine.load == 0, what="abort")
                async with s.post(shim.url + "/reset_prefix_cache") as rr:
                    assert await rr.json() == {"success": True}
                # Published at once, although the engine is idle (documented deviation).
                while True:
                    item = await next_batch(sub)
                    if any(isinstance(e, AllBlocksCleared) for e in item.batch.events):
                        break
                async with s.get(shim.url + "/debug/kv_cache") as rr:
                    assert (await rr.json())["ranks"]["0"]["hashes"] == []
        finally:
            sub.close()


def two_free_ports() -> int:
    """A base port p with p and p+1 both free (the DP offset needs consecutive ports)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no consecutive free ports")


async def test_data_parallel_ranks_ports_and_header(tokenizer):
    base, rbase = two_free_ports(), two_free_ports()
    async with running_shim(
        tokenizer,
        events=True,
        endpoint=f"tcp://*:{base}",
        replay_endpoint=f"tcp://*:{rbase}",
        dp=2,
    ) as shim:
        ports = [(ep.rsplit(":", 1)[1], rep.rsplit(":", 1)[1]) for ep, rep in shim.events_endpoints]
        assert ports == [(str(base), str(rbase)), (str(base + 1), str(rbase + 1))]
        sub1 = EventSubscriber(
            f"tcp://127.0.0.1:{base + 1}", f"tcp://127.0.0.1:{rbase + 1}", from_seq=0
        )
        try:
            async with aiohttp.ClientSession() as s:
                headers, _ = await complete(s, shim.url, headers={"X-data-parallel-rank": "1"})
                assert headers["x-data-parallel-rank"] == "1"
                item = await next_batch(sub1)
                assert item.batch.data_parallel_rank == 1
                async with s.get(shim.url + "/debug/kv_cache") as r:
                    ranks = (await r.json())["ranks"]
                assert (
                    ranks["0"]["hashes"] == []
                    and len(ranks["1"]["hashes"]) == len(encode_prompt(tokenizer, PROMPT)) // 16
                )
                # Without the header: the least-loaded rank, ties to rank 0.
                headers, _ = await complete(s, shim.url)
                assert headers["x-data-parallel-rank"] == "0"
        finally:
            sub1.close()


async def test_default_rank_is_least_loaded(tokenizer):
    async with running_shim(tokenizer, dp=2, time_scale=0.2) as shim, aiohttp.ClientSession() as s:
        body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
        r0 = await s.post(shim.url + "/v1/completions", json=body)
        r1 = await s.post(shim.url + "/v1/completions", json=body)
        assert {r0.headers["x-data-parallel-rank"], r1.headers["x-data-parallel-rank"]} == {
            "0",
            "1",
        }
        r0.close()
        r1.close()
