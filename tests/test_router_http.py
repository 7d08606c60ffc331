"""The router's HTTP surface: every 4xx path, ops routes, pass-through routes, headers, CLI.

One fleet (two engines, one with two dp ranks) serves the whole module.
"""

from __future__ import annotations

import json
import subprocess
import sys

import aiohttp
import openai
import pytest
import pytest_asyncio
from router_harness import MODEL, chat_body, long_text, new_slot, running_fleet, wait_for

from router.discovery import DiscoveryError, DnsDiscovery, parse_target
from router.fleet import Fleet

pytestmark = [pytest.mark.timeout(60), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(tokenizer):
    slots = [new_slot(), new_slot(dp=2)]
    async with running_fleet(tokenizer, slots, max_body_bytes=64 * 1024) as f:
        await f.joined()
        yield f


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(fleet):
    async with aiohttp.ClientSession(base_url=fleet.base_url) as s:
        yield s


async def expect_error(resp: aiohttp.ClientResponse, status: int, param: str | None = None):
    assert resp.status == status, await resp.text()
    body = await resp.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# -- 4xx paths ---------------------------------------------------------------------------


async def test_bad_json_is_400(http):
    async with http.post(
        "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        err = await expect_error(r, 400)
        assert err["type"] == "BadRequestError"


async def test_non_object_body_is_400(http):
    async with http.post("/v1/completions", json=[1, 2, 3]) as r:
        await expect_error(r, 400)


async def test_missing_messages_is_400(http):
    async with http.post("/v1/chat/completions", json={"model": MODEL}) as r:
        await expect_error(r, 400, "messages")


async def test_missing_prompt_is_400(http):
    async with http.post("/v1/completions", json={"model": MODEL}) as r:
        await expect_error(r, 400, "prompt")


@pytest.mark.parametrize("salt", ["", "a/b", "x@y", "back\\slash", "nul\x00", "s" * 129, 42])
async def test_invalid_cache_salt_is_400_before_forwarding(http, fleet, salt):
    before = sum(st.in_flight for st in fleet.router.fleet.instances())
    body = chat_body("sys", "hi", cache_salt=salt)
    async with http.post("/v1/chat/completions", json=body) as r:
        await expect_error(r, 400, "cache_salt")
    assert sum(st.in_flight for st in fleet.router.fleet.instances()) == before


async def test_too_large_is_413(http):
    body = chat_body("x" * 70_000, "hi")
    async with http.post("/v1/chat/completions", json=body) as r:
        await expect_error(r, 413)

    # Chunked upload without Content-Length: the router counts while reading.
    async def gen():
        for _ in range(80):
            yield b" " * 1024

    async with http.post("/v1/chat/completions", data=gen()) as r:
        await expect_error(r, 413)


async def test_unknown_route_is_404_and_wrong_method_405(http):
    async with http.get("/v1/nothing-here") as r:
        err = await expect_error(r, 404)
        assert err["type"] == "NotFoundError"
    async with http.get("/v1/chat/completions") as r:
        await expect_error(r, 405)


async def test_bad_chat_template_flags_are_400(http):
    body = chat_body("s", "u", add_generation_prompt=True, continue_final_message=True)
    async with http.post("/v1/chat/completions", json=body) as r:
        await expect_error(r, 400)
    async with http.post("/v1/chat/completions", json=chat_body("s", "u", stream="yes")) as r:
        await expect_error(r, 400, "stream")


async def test_engine_4xx_passes_through(http):
    body = chat_body("s", "u", model="no-such-model")
    async with http.post("/v1/chat/completions", json=body) as r:
        await expect_error(r, 404)
        assert r.headers["x-routed-to"]


async def test_openai_client_sees_bad_request(fleet):
    client = openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as ei:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"cache_salt": "a/b"},
        )
    assert ei.value.status_code == 400


# -- forwarding, headers ---------------------------------------------------------------


async def test_completions_non_streaming_with_openai_client(fleet):
    client = openai.AsyncOpenAI(base_url=fleet.base_url + "/v1", api_key="x", max_retries=0)
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=long_text(50, 60), max_tokens=4, temperature=0
    )
    c = raw.parse()
    assert c.choices[0].text is not None and c.usage.prompt_tokens > 0
    assert raw.headers["x-routed-to"] in {s.url for s in fleet.slots}
    assert int(raw.headers["x-prefix-hit-tokens"]) >= 0
    assert raw.headers["x-request-id"]


async def test_request_id_and_hop_by_hop(http):
    hdr = {"X-Request-Id": "abc-123", "Connection": "keep-alive", "TE": "trailers"}
    async with http.post("/v1/chat/completions", json=chat_body("s", "u"), headers=hdr) as r:
        assert r.status == 200
        assert r.headers["x-request-id"] == "abc-123"
        assert "Transfer-Encoding" not in r.headers or r.headers["Transfer-Encoding"] == "chunked"


async def test_dp_rank_header(http, fleet):
    dp_url = fleet.slots[1].url
    seen = set()
    for n in range(12):
        async with http.post(
            "/v1/chat/completions", json=chat_body(long_text(300 + n, 60), "u")
        ) as r:
            assert r.status == 200
            if r.headers["x-routed-to"] == dp_url:
                seen.add(r.headers["x-routed-rank"])
            else:
                assert "x-routed-rank" not in r.headers
    assert seen <= {"0", "1"} and seen


async def test_prompt_logprobs_get_no_prefix_credit(http, fleet):
    system = long_text(60, 300)
    async with http.post(
        "/v1/completions", json={"model": MODEL, "prompt": system, "max_tokens": 1}
    ) as r:
        assert r.status == 200
        url = r.headers["x-routed-to"]
        rank = int(r.headers.get("x-routed-rank", 0))
    from router.instance import InstanceKey

    key = InstanceKey(url, rank)
    await wait_for(lambda: len(fleet.router.index.instance_hashes(key)) > 10, 10, "indexed")
    body = {"model": MODEL, "prompt": system, "max_tokens": 1, "prompt_logprobs": 1}
    async with http.post("/debug/route", json=body) as r:
        out = await r.json()
    assert out["prefix_credit"] is False and out["predicted_hit_tokens"] == 0
    body.pop("prompt_logprobs")
    async with http.post("/debug/route", json=body) as r:
        out = await r.json()
    assert out["predicted_hit_tokens"] > 200


# -- other routes ----------------------------------------------------------------------


async def test_models_tokenize_version(http):
    async with http.get("/v1/models") as r:
        assert r.status == 200
        ids = [m["id"] for m in (await r.json())["data"]]
        assert ids == [MODEL]
    async with http.post("/tokenize", json={"model": MODEL, "prompt": "hello world"}) as r:
        assert r.status == 200
        assert (await r.json())["tokens"]
    async with http.get("/version") as r:
        assert r.status == 200


async def test_health_ready_metrics(http, fleet):
    async with http.post("/v1/chat/completions", json=chat_body("s", "metrics")) as r:
        assert r.status == 200
    async with http.get("/health") as r:
        assert r.status == 200
    async with http.get("/ready") as r:
        assert r.status == 200 and (await r.json())["ready"] is True
    async with http.get("/metrics") as r:
        text = await r.text()
    for name in (
        "router_requests_total",
        "router_decision_seconds_bucket",
        "router_kv_events_applied_total",
        "router_hash_parity_state",
        "router_index_entries",
        "router_index_bytes",
        "router_pending_entries",
        "router_instance_healthy",
    ):
        assert name in text, name
    assert 'stage="tokenize"' in text and 'stage="choose"' in text


# -- discovery, CLI --------------------------------------------------------------------


async def test_parse_discovery_target():
    t = parse_target("dns://vllm.ns.svc.cluster.local:8000?events=5557&replay=5558&dp=2")
    assert (t.host, t.port, t.events_port, t.replay_port, t.dp) == (
        "vllm.ns.svc.cluster.local",
        8000,
        5557,
        5558,
        2,
    )
    spec = t.spec_for("10.0.0.7")
    assert spec.url == "http://10.0.0.7:8000"
    assert spec.events_endpoint(1) == "tcp://10.0.0.7:5558"
    for bad in ("http://x:1", "dns://:80", "dns://x:1?bogus=1", "dns://x:1?dp=0"):
        with pytest.raises(DiscoveryError):
            parse_target(bad)


async def test_dns_discovery_tracks_service_membership():
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"], OSError("dns down"), []]

    async def resolver(host, port):
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    fleet = Fleet()
    removed = []
    fleet.on_removed(lambda st: removed.append(st.url))
    d = DnsDiscovery(fleet, parse_target("dns://svc:8000?events=5557"), resolver=resolver)
    await d.resolve_once()
    assert sorted(e.url for e in fleet.engines()) == [
        "http://10.0.0.1:8000",
        "http://10.0.0.2:8000",
    ]
    await d.resolve_once()
    assert sorted(e.url for e in fleet.engines()) == [
        "http://10.0.0.2:8000",
        "http://10.0.0.3:8000",
    ]
    assert removed == ["http://10.0.0.1:8000"]
    assert await d.resolve_once() is False  # a failed lookup keeps the fleet
    assert len(fleet.engines()) == 2
    await d.resolve_once()
    assert fleet.engines() == []


async def test_dns_discovery_resolves_localhost():
    fleet = Fleet()
    d = DnsDiscovery(fleet, parse_target("dns://localhost:8000?events=5557&replay=5558"))
    assert await d.resolve_once()
    assert any("127.0.0.1" in e.url or "[::1]" in e.url for e in fleet.engines())


async def test_cli_help_lists_serve_flags():
    out = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in (
        "--engine",
        "--discovery",
        "--admin-token",
        "--hash-scheme",
        "--config",
        "PREFIX_ROUTER_",
    ):
        assert flag in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "router", "serve"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "no engines" in out.stderr
    json.dumps({})
