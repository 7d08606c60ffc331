"""From a request body to the block hashes the engine will compute for it (issue 4, item 4).

Routing is only exact when the router sees the very token ids the engine will hash, so this
module follows vLLM 0.33's request handling: the chat template rendered to text and encoded
with add_special_tokens=False (chat) or the prompt encoded with add_special_tokens=True
(completions), the request's own flags honoured, cache_salt validated with vLLM's rules
before anything is forwarded, and prompt embeddings hashed per block.

Chat turns grow: turn 20 repeats turns 1-19. Re-tokenizing the whole conversation each time
would make the router's cost grow with the conversation, so the rendered text is split at the
tokenizer's added tokens (``<|im_start|>`` ...) and each text segment's ids come from an LRU
cache. Hugging Face tokenizers never merge across added tokens, so the concatenation equals
tokenizing the whole; the constructor checks that on sample conversations and falls back to
whole-text encoding for a tokenizer where it does not hold.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from events.hashing import HashScheme, LoRA, prompt_embeds_digests

__all__ = [
    "PromptHasher",
    "PromptTokenizer",
    "PromptUnsupported",
    "RequestError",
    "decode_prompt_embeds",
    "uses_prefix_cache",
    "validate_cache_salt",
]


class RequestError(ValueError):
    """A client mistake: answered with HTTP 400 in OpenAI's error shape, never forwarded."""

    def __init__(
        self, message: str, param: str | None = None, code: int = 400, type: str = "BadRequestError"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def to_openai(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class PromptUnsupported(Exception):
    """The router cannot tokenize this request locally (e.g. images): not the client's fault.

    The caller falls back to the engine's /tokenize or to load-only routing.
    """


# --------------------------------------------------------------------------------------
# Validation rules copied as facts from vLLM 0.33 (spec §5.1)

_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX = 128


def validate_cache_salt(v: object) -> str | None:
    """vLLM's cache_salt rule: absent/None, or a non-empty str of at most 128 characters
    without '@', '/', '\\' or NUL. Returns the salt; raises RequestError (400)."""
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise RequestError(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(v) > _SALT_MAX or any(ch in _SALT_FORBIDDEN for ch in v):
        raise RequestError(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return v


def uses_prefix_cache(body: dict, chat: bool) -> bool:
    """Whether vLLM will read its prefix cache for this request.

    vLLM skips the cache when prompt logprobs are computed (they need every prompt position)
    or when ``skip_reading_prefix_cache`` is set; ``echo`` turns the logprobs setting into
    prompt logprobs.
    """
    skip = body.get("skip_reading_prefix_cache")
    if skip is not None:
        return not skip
    plp = body.get("prompt_logprobs")
    if plp is None and body.get("echo"):
        plp = body.get("top_logprobs", 0) if chat else body.get("logprobs")
    return plp is None


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"Parameter '{key}' must be a boolean.", key)
    return v


# --------------------------------------------------------------------------------------
# Tokenization


# Names that ``apply_chat_template`` (or the render under it) takes as its own arguments: a
# chat_template_kwargs key among them does not reach the template as a variable there, so
# such a request takes the full path to behave exactly as transformers does.
_RENDER_ARGS = frozenset(
    {
        "conversation",
        "conversations",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class PromptTokenizer:
    """Token ids of chat and completion bodies, as a vLLM engine with this tokenizer sees them."""

    def __init__(self, tokenizer: Any, cache_segments: int = 8192, segment_cache: bool = True):
        self.tok = tokenizer
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_max = cache_segments
        self.hits = 0
        self.misses = 0
        self._split: re.Pattern | None = None
        self._added: dict[str, int] = {}
        self._fast: Any = None  # (compiled default template, special tokens) once looked up
        if segment_cache:
            self._setup_segments()

    # ---- segment cache

    @property
    def segment_cache_enabled(self) -> bool:
        return self._split is not None

    def _setup_segments(self) -> None:
        decoder = getattr(self.tok, "added_tokens_decoder", None)
        if not decoder:
            return
        for tid, at in decoder.items():
            # Stripping or single-word rules change the neighbouring text: not segmentable.
            if getattr(at, "lstrip", False) or getattr(at, "rstrip", False):
                return
            if getattr(at, "single_word", False):
                return
            self._added[at.content] = tid
        alts = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(a) for a in alts) + ")")
        if not self._self_check():
            self._split = None

    def _self_check(self) -> bool:
        samples = [
            [{"role": "user", "content": "Hello there!  How are   you?\n"}],
            [
                {"role": "system", "content": " Be brief.\n\n"},
                {"role": "user", "content": "¿Qué tal? 你好 🙂 <b>x</b>"},
                {"role": "assistant", "content": "Fine,\tthanks. "},
                {"role": "user", "content": "  spaces  "},
            ],
        ]
        for msgs in samples:
            for agp in (True, False):
                try:
                    text = self._render(msgs, agp, False, None, None, None)
                except Exception:
                    return True  # the template cannot render the sample; nothing to compare
                whole = list(self.tok.encode(text, add_special_tokens=False))
                if self._encode_segments(text) != whole:
                    return False
        return True

    def _encode_segments(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        added = self._added
        for i, seg in enumerate(self._split.split(text)):  # type: ignore[union-attr]
            if not seg:
                continue
            if i % 2:  # odd parts are the separators, i.e. added tokens
                out.append(added[seg])
                continue
            ids = cache.get(seg)
            if ids is None:
                self.misses += 1
                ids = tuple(self.tok.encode(seg, add_special_tokens=False))
                cache[seg] = ids
                if len(cache) > self._cache_max:
                    cache.popitem(last=False)
            else:
                self.hits += 1
                cache.move_to_end(seg)
            out.extend(ids)
        return out

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of rendered text; uses the segment cache when it is exact."""
        if add_special_tokens or self._split is None:
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens))
        return self._encode_segments(text)

    # ---- chat

    def _default_template(self) -> Any:
        """The tokenizer's own chat template, compiled once, with the variables it gets.

        ``apply_chat_template`` looks the template up, rebuilds ``special_tokens_map`` (a
        walk over every special-token attribute) and validates its arguments on each call:
        about half of its time for a short chat. The router's tokenizer never changes, so
        for the common request (no tools, no template override, no final-message
        continuation) the compiled template is rendered directly with the same variables
        transformers passes. Anything else, or a transformers without these helpers, takes
        the full ``apply_chat_template`` path.
        """
        if self._fast is None:
            self._fast = False
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                source = self.tok.get_chat_template(None, None)
                self._fast = (_compile_jinja_template(source), dict(self.tok.special_tokens_map))
            except Exception:
                pass
        return self._fast

    def _render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict | None,
        tools: list | None,
        chat_template: str | None,
    ) -> str:
        if (
            tools is None
            and chat_template is None
            and not continue_final_message
            and (not kwargs or _RENDER_ARGS.isdisjoint(kwargs))
        ):
            fast = self._default_template()
            if fast:
                compiled, special = fast
                return compiled.render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **({**special, **kwargs} if kwargs else special),
                )
        return self.tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(kwargs or {}),
        )

    def render_chat(self, body: dict) -> tuple[str, bool]:
        """The chat template applied to a body: (text, add_special_tokens)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("Parameter 'messages' must be a non-empty list.", "messages")
        agp = _bool(body, "add_generation_prompt", True)
        cfm = _bool(body, "continue_final_message", False)
        if agp and cfm:
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        ast = _bool(body, "add_special_tokens", False)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError(
                "Parameter 'chat_template_kwargs' must be an object.", "chat_template_kwargs"
            )
        kwargs = {
            k: v
            for k, v in (kwargs or {}).items()
            if k not in ("add_generation_prompt", "continue_final_message", "tokenize", "tools")
        }
        tools = _normalize_tools(body.get("tools"))
        template = body.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise RequestError("Parameter 'chat_template' must be a string.", "chat_template")
        msgs = [_normalize_message(m, i) for i, m in enumerate(messages)]
        try:
            text = self._render(msgs, agp, cfm, kwargs, tools, template)
        except RequestError:
            raise
        except Exception as e:  # jinja errors, template raise_exception(), bad roles
            raise RequestError(f"The chat template could not be applied: {e}") from e
        return text, ast

    def chat_tokens(self, body: dict) -> list[int]:
        text, ast = self.render_chat(body)
        return self.encode_text(text, add_special_tokens=ast)

    # ---- completions

    def completion_prompts(self, body: dict) -> list[list[int]]:
        """Token ids of every prompt in a /v1/completions body (vLLM accepts a batch)."""
        prompt = body.get("prompt")
        ast = _bool(body, "add_special_tokens", True)
        if prompt is None or prompt == [] or prompt == "":
            if body.get("prompt_embeds") is not None:
                return []
            raise RequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        if isinstance(prompt, str):
            return [self.encode_text(prompt, ast)]
        if isinstance(prompt, list):
            if all(_is_token(t) for t in prompt):
                return [list(prompt)]
            if all(isinstance(p, str) for p in prompt):
                return [self.encode_text(p, ast) for p in prompt]
            if all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt):
                return [list(p) for p in prompt]
        raise RequestError(
            "Parameter 'prompt' must be a string, a list of strings, a list of token ids "
            "or a list of lists of token ids.",
            "prompt",
        )

    def completion_tokens(self, body: dict) -> list[int]:
        """The first prompt's ids: a batched request is routed as one, by its first prompt."""
        prompts = self.completion_prompts(body)
        return prompts[0] if prompts else []


def _is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _normalize_message(m: object, i: int) -> dict:
    """vLLM's 'string' content format: text parts joined with newlines; no media."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(
            f"messages[{i}] must be an object with a string 'role'.", f"messages[{i}]"
        )
    content = m.get("content")
    if content is None or isinstance(content, str):
        out = dict(m)
        out["content"] = content or ""
        return out
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                t = part.get("text")
                if not isinstance(t, str):
                    raise RequestError(
                        f"messages[{i}].content: a text part needs a string 'text'.",
                        f"messages[{i}].content",
                    )
                texts.append(t)
            elif isinstance(part, dict) and part.get("type") == "refusal":
                texts.append(str(part.get("refusal", "")))
            else:
                raise PromptUnsupported(f"messages[{i}] has non-text content")
        out = dict(m)
        out["content"] = "\n".join(texts)
        return out
    raise RequestError(
        f"messages[{i}].content must be a string or a list of content parts.",
        f"messages[{i}].content",
    )


def _normalize_tools(tools: object) -> list[dict] | None:
    """Tools as vLLM hands them to the template: its pydantic dump (None fields kept)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("Parameter 'tools' must be a list.", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}] must have a function with a name.", f"tools[{i}]")
        f = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        for opt in ("strict", "defer_loading"):
            if fn.get(opt) is not None:
                f[opt] = fn[opt]
        tool = {"type": t.get("type", "function"), "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
            f.setdefault("defer_loading", t["defer_loading"])
        out.append(tool)
    return out


# --------------------------------------------------------------------------------------
# Prompt embeddings


def decode_prompt_embeds(b64: object) -> Any:
    """A ``prompt_embeds`` value as vLLM loads it: base64 of a ``torch.save``d 2-D tensor.

    Loaded with ``weights_only=True`` (no code runs), densified, a leading batch dimension of
    1 squeezed away; float32/float16/bfloat16 only. Anything else is a RequestError (400).
    """
    import torch

    if isinstance(b64, str):
        raw_in = b64.encode("ascii", "ignore") if b64.isascii() else None
    elif isinstance(b64, (bytes, bytearray)):
        raw_in = bytes(b64)
    else:
        raw_in = None
    if not raw_in:
        raise RequestError("prompt_embeds must be a base64-encoded tensor.", "prompt_embeds")
    try:
        raw = base64.b64decode(raw_in, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"prompt_embeds is not valid base64: {e}", "prompt_embeds") from e
    try:
        t = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:
        raise RequestError(
            f"prompt_embeds could not be loaded as a tensor: {e}", "prompt_embeds"
        ) from e
    if not isinstance(t, torch.Tensor):
        raise RequestError("prompt_embeds must hold a single tensor.", "prompt_embeds")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise RequestError(
            f"prompt_embeds must be float32, float16 or bfloat16, got {t.dtype}.",
            "prompt_embeds",
        )
    t = t.to_dense()
    if t.dim() > 2:
        t = t.squeeze(0)
    if t.dim() != 2 or t.shape[0] == 0:
        raise RequestError(
            f"prompt_embeds must have shape [num_tokens, hidden_size], got {tuple(t.shape)}.",
            "prompt_embeds",
        )
    return t


# --------------------------------------------------------------------------------------
# Hashing


class PromptHasher:
    """The event hashes of a prompt's full blocks under one scheme, with request extras."""

    def hashes(
        self,
        tokens: Sequence[int],
        scheme: HashScheme,
        cache_salt: str | None = None,
        lora: LoRA | None = None,
        embeds_digests: Sequence[bytes] | None = None,
    ) -> list[int]:
        return scheme.block_hashes(
            tokens, cache_salt=cache_salt, lora=lora, embeds_digests=embeds_digests
        )

    def embeds_hashes(
        self,
        embeds: Any,
        scheme: HashScheme,
        cache_salt: str | None = None,
        lora: LoRA | None = None,
    ) -> list[int]:
        """An embeddings-only prompt: vLLM hashes placeholder token ids (0) plus each
        block's embeddings digest as an extra key."""
        n = int(embeds.shape[0])
        digests = prompt_embeds_digests(embeds, scheme.block_size)
        return self.hashes([0] * n, scheme, cache_salt, lora, digests)
