"""The shim's HTTP face: vLLM's OpenAI-compatible routes over one or more engine ranks.

Everything a router can observe of a vLLM server is here with vLLM's shapes: completions
and chat (streaming and not, usage with cached_tokens), models, health, version, tokenize,
metrics, the dev-mode cache reset, OpenAI-shaped errors (never a 500 for a client's
mistake), plus ``GET /debug/kv_cache`` (shim only) which exposes each rank's cached block
hashes as the "index truth" for router tests.

Data parallel: ``X-data-parallel-rank: <int>`` (vLLM's header) picks the rank; without it
the least-loaded rank (running + waiting, ties to the lowest rank) serves. The response
says which one in ``x-data-parallel-rank``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from aiohttp import web

from engine_shim.detokenizer import IncrementalDetokenizer
from engine_shim.engine import EngineConfig, EngineCore, EngineError, is_aborted
from engine_shim.metrics import CONTENT_TYPE, ShimMetrics
from engine_shim.protocol import (
    ChatRequest,
    GenerationRequest,
    ProtocolError,
    error_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from engine_shim.request import Request
from events.tokenizer import DEFAULT_MODEL_NAME, encode_chat, encode_prompt, load_tokenizer

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
DP_HEADER = "X-data-parallel-rank"
DEFAULT_MAX_BODY = 16 << 20


@lru_cache(maxsize=4)
def cached_tokenizer(path: str | None) -> Any:
    """One tokenizer per path per process: loading takes ~0.5 s and shims share it."""
    return load_tokenizer(path)


@dataclass
class KVEventsConfig:
    """vLLM's --kv-events-config fields."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str | dict | None) -> KVEventsConfig:
        if text is None:
            return cls()
        d = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(d, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"--kv-events-config: unknown fields {sorted(unknown)}")
        return cls(**d)


@dataclass
class ShimConfig:
    host: str = "127.0.0.1"
    port: int = 8001
    engine: EngineConfig = field(default_factory=EngineConfig)
    served_model_name: str = DEFAULT_MODEL_NAME
    tokenizer: str | None = None
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    data_parallel_size: int = 1
    max_request_body_bytes: int = DEFAULT_MAX_BODY
    dev_mode: bool | None = None  # None: from VLLM_SERVER_DEV_MODE


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(obj, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def _error(e: ProtocolError) -> web.Response:
    return _json(error_body(e.message, e.err_type, e.status, e.param), status=e.status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure as an OpenAI-shaped JSON error; client mistakes are 4xx, never 500."""
    try:
        return await handler(request)
    except ProtocolError as e:
        return _error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = e.reason if e.status != 413 else f"request body too large ({e.text})"
        if e.status == 404:
            msg = f"no route for {request.method} {request.path}"
        elif e.status == 405:
            msg = f"method {request.method} not allowed for {request.path}"
        return _json(
            error_body(msg, ProtocolError("", status=e.status).err_type, e.status), status=e.status
        )
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # a bug of ours: say so, keep serving
        log.exception("internal error on %s %s", request.method, request.path)
        return _json(error_body(f"internal error: {e}", "InternalServerError", 500), status=500)


class ShimServer:
    """The aiohttp application and the engines behind it."""

    def __init__(self, config: ShimConfig, tokenizer: Any = None, publishers: list | None = None):
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else cached_tokenizer(config.tokenizer)
        self.vocab_size = len(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        self.model_name = config.served_model_name
        self.created = int(time.time())
        n = config.data_parallel_size
        self.metrics = ShimMetrics(self.model_name, n)
        self.publishers = publishers or [None] * n
        self.engines = [
            EngineCore(
                config.engine,
                rank=r,
                publisher=self.publishers[r],
                tokenizer=self.tokenizer,
                eos_token_id=self.eos_token_id,
                metrics=self.metrics.engines[r],
            )
            for r in range(n)
        ]
        dev = config.dev_mode
        if dev is None:
            dev = os.environ.get("VLLM_SERVER_DEV_MODE", "0").lower() in ("1", "true")
        self.dev_mode = dev
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[error_middleware], client_max_size=self.config.max_request_body_bytes
        )
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get("/debug/kv_cache", self.debug_kv_cache)
        if self.dev_mode:
            r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        for e in self.engines:
            await e.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        for e in self.engines:
            await e.stop()

    # -- helpers --------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"Invalid JSON body: {e}") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(f"The model `{model}` does not exist.", "model", status=404)

    def _pick_rank(self, request: web.Request) -> int:
        raw = request.headers.get(DP_HEADER)
        n = len(self.engines)
        if raw is None:
            return min(range(n), key=lambda r: (self.engines[r].load, r))
        try:
            rank = int(raw)
        except ValueError:
            raise ProtocolError(f"{DP_HEADER} must be an integer, got {raw!r}", DP_HEADER) from None
        if not 0 <= rank < n:
            raise ProtocolError(
                f"{DP_HEADER} {rank} is out of range: this server has ranks 0..{n - 1}", DP_HEADER
            )
        return rank

    def _request(self, rid: str, params: GenerationRequest, prompt: list[int]) -> Request:
        max_len = self.config.engine.max_model_len
        if len(prompt) >= max_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"request has {len(prompt)} input tokens. Please reduce the length of the "
                "input messages.",
                "messages" if isinstance(params, ChatRequest) else "prompt",
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - len(prompt)
        elif len(prompt) + max_tokens > max_len:
            raise ProtocolError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                "max_tokens",
            )
        return Request(
            rid,
            prompt,
            cache_salt=params.cache_salt,
            kv_cache_report_mode=params.kv_cache_report_mode,
            max_tokens=max_tokens,
            ignore_eos=params.ignore_eos,
            skip_reading_prefix_cache=params.skip_prefix_cache,
            seed=params.seed,
            temperature=params.temperature if params.temperature is not None else 1.0,
            eos_after=params.eos_after,
        )

    def _encode_chat(self, params: ChatRequest | dict) -> list[int]:
        p = params if isinstance(params, dict) else params.__dict__
        try:
            return encode_chat(
                self.tokenizer,
                p["messages"],
                add_generation_prompt=p["add_generation_prompt"],
                continue_final_message=p["continue_final_message"],
                add_special_tokens=p["add_special_tokens"],
                chat_template_kwargs=p["chat_template_kwargs"],
                tools=p["tools"],
                chat_template=p["chat_template"],
            )
        except ProtocolError:
            raise
        except Exception as e:  # template errors are the client's input
            raise ProtocolError(f"could not apply the chat template: {e}", "messages") from None

    # -- generation -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        params = parse_completion(await self._body(request), self.vocab_size)
        self._check_model(params.model)
        rank = self._pick_rank(request)
        if params.prompt_token_ids is not None:
            prompt = params.prompt_token_ids
        else:
            assert params.prompt_text is not None
            prompt = encode_prompt(self.tokenizer, params.prompt_text, params.add_special_tokens)
        rid = f"cmpl-{params.request_id or uuid.uuid4().hex}"
        return await self._generate(request, rank, rid, params, prompt, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        params = parse_chat(await self._body(request))
        self._check_model(params.model)
        rank = self._pick_rank(request)
        prompt = self._encode_chat(params)
        rid = f"chatcmpl-{params.request_id or uuid.uuid4().hex}"
        return await self._generate(request, rank, rid, params, prompt, chat=True)

    async def _generate(
        self,
        http: web.Request,
        rank: int,
        rid: str,
        params: GenerationRequest,
        prompt: list[int],
        chat: bool,
    ) -> web.StreamResponse:
        engine = self.engines[rank]
        req = self._request(rid, params, prompt)
        try:
            queue = engine.add_request(req)
        except (EngineError, ValueError) as e:
            raise ProtocolError(str(e)) from None
        headers = {"x-data-parallel-rank": str(rank)}
        created = int(time.time())
        try:
            if params.stream:
                return await self._stream(http, queue, req, params, chat, created, headers)
            return await self._collect(queue, req, params, chat, created, headers)
        finally:
            # Client gone, handler cancelled or finished: a no-op unless still in flight.
            engine.abort(rid)

    def _usage(self, req: Request, num_output: int, cached: int) -> dict:
        p = req.num_prompt_tokens
        return {
            "prompt_tokens": p,
            "total_tokens": p + num_output,
            "completion_tokens": num_output,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _collect(self, queue, req, params, chat, created, headers) -> web.Response:
        detok = IncrementalDetokenizer(self.tokenizer)
        n_out = 0
        cached = 0
        finish = None
        while True:
            item = await queue.get()
            if is_aborted(item):
                raise ProtocolError("the request was aborted", status=503)
            n_out += len(item.new_token_ids)
            cached = item.num_cached_tokens
            detok.add(item.new_token_ids)
            if item.finished:
                finish = item.finish_reason
                break
        detok.flush()
        usage = self._usage(req, n_out, cached)
        if chat:
            choice = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": detok.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": detok.text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
            obj = "text_completion"
        body = {
            "id": req.request_id,
            "object": obj,
            "created": created,
            "model": self.model_name,
            "choices": [choice],
            "usage": usage,
        }
        return _json(body, headers=headers)

    async def _stream(self, http, queue, req, params, chat, created, headers) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                **headers,
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
            }
        )
        await resp.prepare(http)
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": req.request_id, "object": obj, "created": created, "model": self.model_name}

        async def send(d: dict) -> None:
            await resp.write(b"data: " + json.dumps(d, separators=(",", ":")).encode() + b"\n\n")

        def chunk(text: str, finish: str | None, first: bool = False) -> dict:
            if chat:
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta = {"role": "assistant", "content": text}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = None
            return {**base, "choices": [c]}

        detok = IncrementalDetokenizer(self.tokenizer)
        # Like vLLM, the role chunk goes out with the first engine output (after prefill),
        # so a client measuring TTFT from the first chunk measures the prefill.
        role_sent = not chat
        n_out = cached = 0
        while True:
            item = await queue.get()
            if is_aborted(item):
                break
            if not role_sent:
                await send(chunk("", None, first=True))
                role_sent = True
            n_out += len(item.new_token_ids)
            cached = item.num_cached_tokens
            delta = detok.add(item.new_token_ids)
            if item.finished:
                delta += detok.flush()
                await send(chunk(delta, item.finish_reason))
                break
            if delta:
                await send(chunk(delta, None))
        if params.include_usage:
            await send({**base, "choices": [], "usage": self._usage(req, n_out, cached)})
        await resp.write(b"data: [DONE]\n\n")
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    # -- the rest -------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.config.tokenizer or self.model_name,
            "parent": None,
            "max_model_len": self.config.engine.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VLLM_VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        params = parse_tokenize(await self._body(request))
        self._check_model(params.model)
        if params.chat is not None:
            ids = self._encode_chat(params.chat)
        else:
            assert params.prompt is not None
            ids = encode_prompt(self.tokenizer, params.prompt, params.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if params.return_token_strs else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.config.engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        model, ids = parse_detokenize(await self._body(request), self.vocab_size)
        self._check_model(model)
        return _json({"prompt": self.tokenizer.decode(ids)})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        for e in self.engines:
            e._update_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def debug_kv_cache(self, request: web.Request) -> web.Response:
        ranks = {
            str(e.rank): {
                "block_size": e.config.block_size,
                "hashes": e.kv.block_pool.cached_event_hashes(),
                "num_free_blocks": e.kv.get_num_free_blocks(),
            }
            for e in self.engines
        }
        return _json({"ranks": ranks})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        running = request.query.get("reset_running_requests", "false").lower() in ("1", "true")
        ok = True
        for e in self.engines:
            if running:
                e.preempt_all()
            ok = e.reset_prefix_cache() and ok
        return _json({"success": ok})
