"""Every client mistake gets a 4xx with vLLM's OpenAI-shaped error body, never a 500."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from engine_shim.testing import running_shim

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "all"}}, 400, "vllm_xargs"),
    ("/v1/completions", {"prompt": "x", "vllm_xargs": 3}, 400, "vllm_xargs"),
    ("/v1/completions", {"prompt": list(range(1, 2049))}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": "x"}, 400, "tools"),
    ("/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
]  # fmt: skip

BAD_SALTS = ["", "s" * 129, "a/b", "a@b", "a\\b", "a\x00b", 5, ["s"]]


def check_error(status: int, body: dict, want_status: int, param: str | None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == want_status and err["message"]
    assert err["type"] == {400: "BadRequestError", 404: "NotFoundError"}.get(
        want_status, err["type"]
    )
    if param is not None:
        assert err["param"] == param


async def post(s: aiohttp.ClientSession, url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else None
    kw = {"data": data} if data is not None else {"json": body}
    async with s.post(url, **kw) as r:
        return r.status, await r.json()


async def test_every_bad_request(tokenizer):
    async with running_shim(tokenizer) as shim, aiohttp.ClientSession() as s:
        for path, body, status, param in CASES:
            got_status, got = await post(s, shim.url + path, body)
            check_error(got_status, got, status, param)
        for path in ("/v1/completions", "/v1/chat/completions"):
            base = {"prompt": "x"} if "chat" not in path else {"messages": MSGS}
            for salt in BAD_SALTS:
                got_status, got = await post(s, shim.url + path, {**base, "cache_salt": salt})
                check_error(got_status, got, 400, "cache_salt")
            ok, _ = await post(
                s, shim.url + path, {**base, "cache_salt": "s" * 128, "max_tokens": 1}
            )
            assert ok == 200
        # Nothing leaked into the engine.
        assert shim.engines[0].load == 0


async def test_routes_methods_and_sizes(tokenizer):
    async with (
        running_shim(tokenizer, max_request_body_bytes=1024) as shim,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(shim.url + "/v1/nothing") as r:
            check_error(r.status, await r.json(), 404, None)
        async with s.get(shim.url + "/v1/completions") as r:
            check_error(r.status, await r.json(), 405, None)
        async with s.post(shim.url + "/reset_prefix_cache") as r:  # dev mode is off
            check_error(r.status, await r.json(), 404, None)
        status, body = await post(s, shim.url + "/v1/completions", {"prompt": "x" * 5000})
        check_error(status, body, 413, None)


async def test_data_parallel_header_errors(tokenizer):
    async with running_shim(tokenizer, dp=2) as shim, aiohttp.ClientSession() as s:
        for bad in ("two", "2", "-1"):
            headers = {"X-data-parallel-rank": bad}
            async with s.post(
                shim.url + "/v1/completions", json={"prompt": "x"}, headers=headers
            ) as r:
                check_error(r.status, await r.json(), 400, "X-data-parallel-rank")


async def test_openai_client_sees_typed_errors(tokenizer):
    async with running_shim(tokenizer) as shim:
        c = openai.AsyncOpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="gpt-9", prompt="x")
        with pytest.raises(openai.BadRequestError) as e:
            await c.completions.create(model=MODEL, prompt="x", extra_body={"cache_salt": "a/b"})
        assert e.value.body["param"] == "cache_salt"
