"""Validation of the OpenAI / vLLM request bodies the shim serves, and vLLM's error shape.

Pure functions from parsed JSON to dataclasses, so every 4xx path is testable without a
server. Field names and defaults are vLLM 0.33's (spec §5): completions add special tokens,
chat does not and adds the generation prompt; ``cache_salt`` follows vLLM's before-validator
(§5.1); ``prompt_logprobs`` makes the engine skip the prefix-cache lookup, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CACHE_SALT_MAX_LEN = 128
_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
REPORT_MODES = ("incremental", "full")
# The simulated model "answers" in this many tokens when a chat request sets no max_tokens
# (it then ends with EOS); a real model stops on its own, the simulation needs a length.
DEFAULT_NATURAL_LENGTH = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default


class ProtocolError(Exception):
    """A client mistake: rendered as an OpenAI-shaped error with this status."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        err_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type or _TYPES.get(status, "BadRequestError")


_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> dict:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


# -- field readers --------------------------------------------------------------------------


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _opt_int(
    body: dict, key: str, default: int | None = None, minimum: int | None = None
) -> int | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ProtocolError(f"{key}: expected an integer, got {_type_name(v)}", key)
    if minimum is not None and v < minimum:
        raise ProtocolError(f"{key} must be at least {minimum}, got {v}.", key)
    return v


def _opt_float(body: dict, key: str, default: float | None = None) -> float | None:
    v = body.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(f"{key}: expected a number, got {_type_name(v)}", key)
    return float(v)


def _opt_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{key}: expected a boolean, got {_type_name(v)}", key)
    return v


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ProtocolError(f"{key}: expected a string, got {_type_name(v)}", key)
    return v


def _opt_dict(body: dict, key: str) -> dict | None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise ProtocolError(f"{key}: expected an object, got {_type_name(v)}", key)
    return v


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def validate_cache_salt(v: Any) -> str | None:
    """vLLM 0.33's rules: absent/None, or a non-empty str of at most 128 chars without @ / \\ NUL."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise ProtocolError("Parameter 'cache_salt' must be a string.", "cache_salt")
    if not v:
        raise ProtocolError("Parameter 'cache_salt' must be a non-empty string.", "cache_salt")
    if len(v) > CACHE_SALT_MAX_LEN:
        raise ProtocolError(
            f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_LEN} characters.",
            "cache_salt",
        )
    if any(c in v for c in _SALT_FORBIDDEN):
        raise ProtocolError(
            "Parameter 'cache_salt' must not contain '@', '/', '\\' or NUL characters.",
            "cache_salt",
        )
    return v


def check_token_ids(ids: Any, key: str, vocab_size: int | None) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ProtocolError(f"{key}: expected a list of integer token ids", key)
    if vocab_size is not None:
        for t in ids:
            if t < 0 or t >= vocab_size:
                raise ProtocolError(f"Token id {t} is out of vocabulary", key)
    return ids


# -- generation requests --------------------------------------------------------------------


@dataclass
class GenerationRequest:
    model: str | None
    max_tokens: int | None
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_salt: str | None
    kv_cache_report_mode: str
    skip_prefix_cache: bool
    eos_after: int | None
    request_id: str | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletionRequest(GenerationRequest):
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    add_special_tokens: bool = True
    echo: bool = False


@dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None


def _common(body: dict, chat: bool) -> dict[str, Any]:
    model = _opt_str(body, "model")
    max_tokens = _opt_int(body, "max_tokens", minimum=1)
    mct = _opt_int(body, "max_completion_tokens", minimum=1)
    if mct is not None and (chat or max_tokens is None):
        max_tokens = mct  # chat: max_completion_tokens wins; completions: a fallback
    if not chat and "max_tokens" not in body and mct is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    temperature = _opt_float(body, "temperature", 1.0)
    if temperature is not None and temperature < 0:
        raise ProtocolError(f"temperature must be non-negative, got {temperature}.", "temperature")
    n = _opt_int(body, "n", 1)
    if n != 1:
        raise ProtocolError("the engine shim serves n=1 only", "n")
    stream = _opt_bool(body, "stream", False)
    so = _opt_dict(body, "stream_options")
    if so is not None and not stream:
        raise ProtocolError(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = _opt_bool(so or {}, "include_usage", False)
    xargs = _opt_dict(body, "vllm_xargs") or {}
    mode = xargs.get("kv_cache_report_mode", "incremental")
    if mode not in REPORT_MODES:
        raise ProtocolError(
            f"vllm_xargs.kv_cache_report_mode must be one of {', '.join(REPORT_MODES)}",
            "vllm_xargs",
        )
    eos_after = _opt_int(xargs, "eos_after", minimum=0)
    prompt_logprobs = _opt_int(body, "prompt_logprobs", minimum=-1)
    ignore_eos = _opt_bool(body, "ignore_eos", False)
    if chat and max_tokens is None and eos_after is None:
        eos_after = DEFAULT_NATURAL_LENGTH
    rid = _opt_str(body, "request_id")
    return dict(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=_opt_int(body, "seed"),
        stream=stream,
        include_usage=include_usage,
        ignore_eos=ignore_eos,
        cache_salt=validate_cache_salt(body.get("cache_salt")),
        kv_cache_report_mode=mode,
        skip_prefix_cache=prompt_logprobs is not None,
        eos_after=eos_after,
        request_id=rid,
    )


def parse_completion(body: Any, vocab_size: int | None = None) -> CompletionRequest:
    body = require_object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise ProtocolError("prompt: field required", "prompt")
    prompt = body["prompt"]
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ProtocolError(
                "the engine shim serves one prompt per request (batch of 1)", "prompt"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("Prompt cannot be empty", "prompt")
        text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise ProtocolError("Prompt cannot be empty", "prompt")
        ids = check_token_ids(prompt, "prompt", vocab_size)
    else:
        raise ProtocolError(
            f"prompt: expected a string or a list of token ids, got {_type_name(prompt)}", "prompt"
        )
    return CompletionRequest(
        **_common(body, chat=False),
        prompt_text=text,
        prompt_token_ids=ids,
        add_special_tokens=_opt_bool(body, "add_special_tokens", True),
        echo=_opt_bool(body, "echo", False),
    )


def _check_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise ProtocolError("messages: field required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProtocolError("messages: expected a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProtocolError(f"messages[{i}]: expected an object with a string role", "messages")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise ProtocolError(f"messages[{i}].content: expected a string or a list", "messages")
        if isinstance(c, list):
            for part in c:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ProtocolError(
                        f"messages[{i}].content: only text parts are supported", "messages"
                    )
    return msgs


def flatten_content(messages: list[dict]) -> list[dict]:
    """Text parts joined into one string, as vLLM's chat renderer does for text-only models."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            m = {**m, "content": "\n".join(p["text"] for p in c)}
        out.append(m)
    return out


def _chat_flags(body: dict) -> dict[str, Any]:
    agp = _opt_bool(body, "add_generation_prompt", True)
    cfm = _opt_bool(body, "continue_final_message", False)
    if agp and cfm:
        raise ProtocolError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ProtocolError("tools: expected a list of objects", "tools")
    return dict(
        messages=flatten_content(_check_messages(body)),
        tools=tools,
        add_generation_prompt=agp,
        continue_final_message=cfm,
        add_special_tokens=_opt_bool(body, "add_special_tokens", False),
        chat_template=_opt_str(body, "chat_template"),
        chat_template_kwargs=_opt_dict(body, "chat_template_kwargs"),
    )


def parse_chat(body: Any) -> ChatRequest:
    body = require_object(body)
    flags = _chat_flags(body)
    return ChatRequest(**_common(body, chat=True), **flags)


# -- tokenize / detokenize ------------------------------------------------------------------


@dataclass
class TokenizeRequest:
    model: str | None
    return_token_strs: bool
    prompt: str | None = None
    add_special_tokens: bool = True
    chat: dict[str, Any] | None = None  # the chat flags when the body has messages


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = require_object(body)
    model = _opt_str(body, "model")
    strs = _opt_bool(body, "return_token_strs", False)
    if "messages" in body:
        flags = _chat_flags(body)
        return TokenizeRequest(
            model, strs, add_special_tokens=flags["add_special_tokens"], chat=flags
        )
    if "prompt" not in body:
        raise ProtocolError("either prompt or messages is required", "prompt")
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise ProtocolError(f"prompt: expected a string, got {_type_name(prompt)}", "prompt")
    return TokenizeRequest(
        model, strs, prompt=prompt, add_special_tokens=_opt_bool(body, "add_special_tokens", True)
    )


def parse_detokenize(body: Any, vocab_size: int | None = None) -> tuple[str | None, list[int]]:
    body = require_object(body)
    if "tokens" not in body:
        raise ProtocolError("tokens: field required", "tokens")
    return _opt_str(body, "model"), check_token_ids(body["tokens"], "tokens", vocab_size)
