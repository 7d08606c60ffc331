"""Fuzzing the HTTP surface of the router and of the engine shim.

A client's mistake (any body, any JSON, odd headers) must get a 4xx in OpenAI's error shape,
never a 5xx and never a hang. Both servers run in a loop thread; requests go over real
sockets with a timeout, so a hang fails the example. Example counts are bounded.
"""

from __future__ import annotations

import http.client
import json

import pytest
from conftest import free_port
from fault_tools import LoopThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_harness import MODEL

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class Servers:
    def __init__(self) -> None:
        from aiohttp import web

        from engine_shim.runner import start_shim
        from engine_shim.testing import shim_config
        from router.config import RouterConfig
        from router.instance import EngineSpec
        from router.server import Router, build_app

        self.lt = LoopThread()
        cfg = shim_config(max_model_len=512)
        self.shim = self.lt.run(start_shim(cfg))
        self.shim_port = int(self.shim.url.rsplit(":", 1)[1])
        self.router_port = free_port()
        rcfg = RouterConfig(
            host="127.0.0.1",
            port=self.router_port,
            engines=[EngineSpec(self.shim.url, events="none", replay="none")],
            health_interval_s=1.0,
            max_body_bytes=1 << 16,
        )
        self.router = Router(rcfg)

        async def serve():
            runner = web.AppRunner(build_app(self.router), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.router_port).start()
            return runner

        self.runner = self.lt.run(serve())

    def close(self) -> None:
        self.lt.run(self.runner.cleanup())
        self.lt.run(self.shim.stop())
        self.lt.close()


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    yield s
    s.close()


def request(port: int, method: str, path: str, body: bytes | None, headers: dict) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check(status: int, data: bytes) -> None:
    assert status < 500, (status, data[:300])
    if status >= 400:
        try:
            err = json.loads(data)["error"]
        except ValueError:
            # aiohttp's HTTP parser refused a malformed message before any handler ran.
            assert 400 <= status < 500, (status, data[:300])
            return
        assert isinstance(err["message"], str) and err["code"] == status


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda k: st.lists(k, max_size=4) | st.dictionaries(st.text(max_size=10), k, max_size=4),
    max_leaves=20,
)
_content = st.one_of(
    st.text(max_size=40),
    _json,
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "x"])}, optional={"text": _json}
        ),
        max_size=3,
    ),
)
_message = (
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus", ""])},
        optional={"content": _content, "name": _json, "tool_calls": _json},
    )
    | _json
)
# Chat bodies near the valid ones: every known field with good and bad values.
_chat = st.fixed_dictionaries(
    {
        "model": st.sampled_from([MODEL, "", "nope"]) | _json,
        "messages": st.lists(_message, max_size=3) | _json,
        "max_tokens": st.integers(-2, 8) | st.sampled_from([10**9, "4", None, 1.5]),
    },
    optional={
        "stream": st.booleans() | _json,
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": _json}) | _json,
        "cache_salt": st.text(max_size=10) | _json,
        "temperature": st.floats() | _json,
        "top_p": st.floats() | _json,
        "n": st.integers(-1, 3) | _json,
        "logprobs": _json,
        "top_logprobs": st.integers(-1, 30),
        "prompt_logprobs": _json,
        "add_generation_prompt": _json,
        "continue_final_message": _json,
        "chat_template_kwargs": _json,
        "stop": _json,
        "seed": _json,
    },
)
_completion = st.fixed_dictionaries(
    {
        "model": st.sampled_from([MODEL]) | _json,
        "max_tokens": st.integers(-2, 8) | st.sampled_from([10**9, "4", None]),
    },
    optional={
        "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60000), max_size=20) | _json,
        "prompt_embeds": _json | st.binary(max_size=30).map(lambda b: b.hex()),
        "stream": st.booleans() | _json,
        "echo": _json,
        "cache_salt": _json,
        "suffix": _json,
    },
)

TARGETS = ["router_port", "shim_port"]


@pytest.mark.parametrize("target", TARGETS)
@SETTINGS
@given(body=_chat)
def test_chat_bodies_never_5xx(servers, target, body):
    port = getattr(servers, target)
    status, data = request(
        port, "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "json"}
    )
    check(status, data)


@pytest.mark.parametrize("target", TARGETS)
@SETTINGS
@given(body=_completion)
def test_completion_bodies_never_5xx(servers, target, body):
    port = getattr(servers, target)
    status, data = request(port, "POST", "/v1/completions", json.dumps(body).encode(), {})
    check(status, data)


@pytest.mark.parametrize("target", TARGETS)
@SETTINGS
@given(
    raw=st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/nope"]),
)
def test_raw_bodies_never_5xx(servers, target, raw, path):
    status, data = request(getattr(servers, target), "POST", path, raw, {})
    check(status, data)


_token = st.text("abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=20)
_hval = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)


@pytest.mark.parametrize("target", TARGETS)
@SETTINGS
@given(
    headers=st.dictionaries(
        _token
        | st.sampled_from(
            [
                "Content-Type",
                "Authorization",
                "X-Request-Id",
                "X-data-parallel-rank",
                "Content-Encoding",
                "Accept-Encoding",
                "Connection",
                "Expect",
                "Transfer-Encoding",
            ]
        ),
        _hval,
        max_size=6,
    )
)
def test_headers_never_5xx(servers, target, headers):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {k: v for k, v in headers.items() if k.lower() not in ("content-length",)}
    try:
        status, data = request(
            getattr(servers, target),
            "POST",
            "/v1/chat/completions",
            json.dumps(body).encode(),
            headers,
        )
    except (http.client.HTTPException, ConnectionError):
        return  # the server refused a malformed message outright: fine, nothing hung
    check(status, data)
