"""The HTTP surface with the official openai client and raw aiohttp: shapes, hits, metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from openai import AsyncOpenAI

from engine_shim.testing import running_shim, wait_until
from events.hashing import HashScheme
from events.tokenizer import DEFAULT_MODEL_NAME, encode_chat, encode_prompt

MODEL = DEFAULT_MODEL_NAME
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def client(shim) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=shim.url + "/v1", api_key="unused", max_retries=0, timeout=20)


async def test_completion_repeated_prompt_reports_cached_tokens(tokenizer):
    async with running_shim(tokenizer) as shim:
        c = client(shim)
        n = len(encode_prompt(tokenizer, PROMPT))
        r1 = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        r2 = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        assert r1.object == "text_completion" and r1.choices[0].finish_reason == "length"
        assert r1.usage.prompt_tokens == n and r1.usage.completion_tokens == 5
        assert r1.usage.total_tokens == n + 5
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
        assert r1.choices[0].text == r2.choices[0].text  # deterministic continuation
        assert r1.choices[0].text.strip()


async def test_completion_with_token_ids_and_seed(tokenizer):
    async with running_shim(tokenizer) as shim:
        c = client(shim)
        ids = list(range(100, 140))
        a = await c.completions.create(model=MODEL, prompt=ids, max_tokens=4, seed=1)
        b = await c.completions.create(model=MODEL, prompt=ids, max_tokens=4, seed=2)
        assert a.usage.prompt_tokens == 40
        assert b.usage.prompt_tokens_details.cached_tokens == 32
        assert a.choices[0].text != b.choices[0].text


async def test_chat_stream_with_usage(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    n = len(encode_chat(tokenizer, msgs))
    async with running_shim(tokenizer) as shim:
        c = client(shim)
        await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text.strip()
        finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert [f.choices[0].finish_reason for f in finals] == ["length"]
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        assert (usage.prompt_tokens, usage.completion_tokens) == (n, 6)
        assert usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16


async def test_chat_without_max_tokens_stops_on_eos(tokenizer):
    async with running_shim(tokenizer) as shim:
        r = await client(shim).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
        assert r.object == "chat.completion"
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.role == "assistant"
        assert r.usage.completion_tokens == 17  # 16 words, then EOS


async def test_raw_sse_framing(tokenizer):
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        body = {"prompt": "hello", "max_tokens": 3, "stream": True}
        async with s.post(shim.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        data = [json.loads(e[len("data: ") :]) for e in events[:-2]]
        assert all(d["object"] == "text_completion" for d in data)
        assert data[-1]["choices"][0]["finish_reason"] == "length"


async def test_models_health_version_ping(tokenizer):
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        models = await client(shim).models.list()
        assert [m.id for m in models.data] == [MODEL]
        for path in ("/health", "/ping"):
            async with s.get(shim.url + path) as r:
                assert r.status == 200 and await r.read() == b""
        async with s.get(shim.url + "/version") as r:
            assert (await r.json()) == {"version": "0.33.0"}


async def test_tokenize_parity_with_events_tokenizer(tokenizer):
    msgs = [{"role": "user", "content": "What is a prefix cache?"}]
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        async with s.post(shim.url + "/tokenize", json={"prompt": PROMPT}) as r:
            d = await r.json()
        assert d["tokens"] == encode_prompt(tokenizer, PROMPT, add_special_tokens=True)
        assert d["count"] == len(d["tokens"]) and d["max_model_len"] == 2048
        assert d["token_strs"] is None
        async with s.post(
            shim.url + "/tokenize", json={"messages": msgs, "return_token_strs": True}
        ) as r:
            d = await r.json()
        assert d["tokens"] == encode_chat(tokenizer, msgs)
        assert d["token_strs"] == tokenizer.convert_ids_to_tokens(d["tokens"])
        body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
        async with s.post(shim.url + "/tokenize", json=body) as r:
            d = await r.json()
        assert d["tokens"] == encode_chat(
            tokenizer, msgs, add_generation_prompt=False, continue_final_message=True
        )
        async with s.post(shim.url + "/detokenize", json={"tokens": d["tokens"]}) as r:
            assert (await r.json())["prompt"] == tokenizer.decode(d["tokens"])


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_metrics_counters_move(tokenizer):
    n = len(encode_prompt(tokenizer, PROMPT))
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        c = client(shim)
        for _ in range(2):
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        async with s.get(shim.url + "/metrics") as r:
            text = await r.text()
        assert f'model_name="{MODEL}"' in text and 'engine="0"' in text
        assert _metric(text, "vllm:prefix_cache_queries_total") == 2 * n
        assert _metric(text, "vllm:prefix_cache_hits_total") == (n - 1) // 16 * 16
        assert _metric(text, "vllm:prompt_tokens_total") == 2 * n
        assert _metric(text, "vllm:generation_tokens_total") == 6
        assert _metric(text, "vllm:time_to_first_token_seconds_count") == 2
        assert _metric(text, "vllm:num_requests_running") == 0
        assert _metric(text, "vllm:num_requests_waiting") == 0
        assert _metric(text, "vllm:kv_cache_usage_perc") == 0


async def test_debug_kv_cache_is_the_index_truth(tokenizer):
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        await client(shim).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        async with s.get(shim.url + "/debug/kv_cache") as r:
            d = await r.json()
        rank = d["ranks"]["0"]
        ids = encode_prompt(tokenizer, PROMPT)
        want = HashScheme("sha256_cbor", None, 16).block_hashes(ids)
        assert rank["block_size"] == 16 and sorted(rank["hashes"]) == sorted(want)
        assert rank["num_free_blocks"] == 255


async def test_prompt_logprobs_skips_the_cache(tokenizer):
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        body = {"prompt": PROMPT, "max_tokens": 1}
        for extra in ({}, {"prompt_logprobs": 1}):
            async with s.post(shim.url + "/v1/completions", json={**body, **extra}) as r:
                usage = (await r.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_client_disconnect_frees_blocks(tokenizer):
    async with running_shim(tokenizer, time_scale=0.2) as shim:
        engine = shim.engines[0]
        free0 = engine.kv.get_num_free_blocks()
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 1000, "stream": True}
            r = await s.post(shim.url + "/v1/completions", json=body)
            await r.content.readline()  # the first chunk arrived: the request is running
            assert engine.load == 1 and engine.kv.get_num_free_blocks() < free0
            r.close()
        await wait_until(lambda: engine.load == 0, what="the request to be aborted")
        assert engine.kv.get_num_free_blocks() == free0


async def test_non_streaming_disconnect_frees_blocks(tokenizer):
    async with running_shim(tokenizer, time_scale=0.2) as shim:
        engine = shim.engines[0]
        free0 = engine.kv.get_num_free_blocks()
        async with aiohttp.ClientSession() as s:
            body = {"prompt": PROMPT, "max_tokens": 1000}
            t = asyncio.ensure_future(s.post(shim.url + "/v1/completions", json=body))
            await wait_until(lambda: engine.load == 1, what="the request to start")
            t.cancel()  # closes the connection while the server is still generating
            with pytest.raises(asyncio.CancelledError):
                await t
        await wait_until(lambda: engine.load == 0, what="the request to be aborted")
        assert engine.kv.get_num_free_blocks() == free0
