"""Prompt tokenization and hashing as vLLM does it (issue 4, item 4)."""

from __future__ import annotations

import base64
import io
import random

import pytest
import torch

from events.hashing import HashScheme, LoRA, prompt_embeds_digests
from events.tokenizer import encode_chat, encode_prompt
from router.prompt import (
    PromptHasher,
    PromptTokenizer,
    PromptUnsupported,
    RequestError,
    decode_prompt_embeds,
    uses_prefix_cache,
    validate_cache_salt,
)


@pytest.fixture(scope="module")
def pt(tokenizer):
    return PromptTokenizer(tokenizer)


MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_segment_cache_enabled_for_default_tokenizer(pt):
    assert pt.segment_cache_enabled


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"add_generation_prompt": False},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    ],
)
def test_chat_tokens_equal_vllm_flags(pt, tokenizer, flags):
    body = {"model": "m", "messages": MSGS, **flags}
    want = encode_chat(
        tokenizer,
        MSGS,
        add_generation_prompt=flags.get("add_generation_prompt", True),
        continue_final_message=flags.get("continue_final_message", False),
        add_special_tokens=flags.get("add_special_tokens", False),
        chat_template_kwargs=flags.get("chat_template_kwargs"),
        tools=flags.get("tools"),
    )
    if flags.get("add_special_tokens"):
        want = tokenizer.encode(
            tokenizer.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True),
            add_special_tokens=True,
        )
    assert pt.chat_tokens(body) == want


def test_chat_text_parts_join_with_newlines(pt, tokenizer):
    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]
    }
    assert pt.chat_tokens(body) == encode_chat(tokenizer, [{"role": "user", "content": "a\nb"}])
    with pytest.raises(PromptUnsupported):
        pt.chat_tokens(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
        )


def _random_text(rng: random.Random) -> str:
    pieces = [
        "hello",
        " world",
        "  ",
        "\n",
        "\n\n",
        "\t",
        "é",
        "漢字",
        "🙂",
        "<|im_end|>",
        "<|im_start|>",
        "<b>",
        "'s",
        "123",
        " 4567",
        "...",
        "<",
        "|",
        ">",
        "im_end",
        "\r\n",
        "  x",
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 25)))


def test_segment_cache_equals_whole_for_many_conversations(tokenizer):
    pt = PromptTokenizer(tokenizer, cache_segments=64)  # small: evictions happen too
    rng = random.Random(11)
    for _ in range(150):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": _random_text(rng)})
        for t in range(rng.randint(1, 6)):
            msgs.append(
                {"role": "user" if t % 2 == 0 else "assistant", "content": _random_text(rng)}
            )
        agp = rng.random() < 0.7
        body = {"messages": msgs, "add_generation_prompt": agp}
        assert pt.chat_tokens(body) == encode_chat(tokenizer, msgs, add_generation_prompt=agp)
    assert pt.hits > 0 and pt.misses > 0


def test_growing_chat_reuses_segments(tokenizer):
    pt = PromptTokenizer(tokenizer)
    msgs = [{"role": "system", "content": "S " * 200}]
    for turn in range(10):
        msgs.append({"role": "user", "content": f"question {turn} " * 30})
        before = pt.misses
        assert pt.chat_tokens({"messages": msgs}) == encode_chat(tokenizer, msgs)
        assert pt.misses - before <= 3  # only the new turn's text is tokenized
        msgs.append({"role": "assistant", "content": f"answer {turn} " * 30})


def test_chat_errors(pt):
    with pytest.raises(RequestError, match="Cannot set both"):
        pt.chat_tokens({"messages": MSGS, "continue_final_message": True})
    for bad in [None, [], "hi", [1]]:
        with pytest.raises(RequestError) as e:
            pt.chat_tokens({"messages": bad})
        assert e.value.code == 400
    with pytest.raises(RequestError, match="boolean"):
        pt.chat_tokens({"messages": MSGS, "add_generation_prompt": "yes"})
    with pytest.raises(RequestError):
        pt.chat_tokens({"messages": MSGS, "chat_template_kwargs": [1]})
    with pytest.raises(RequestError):
        pt.chat_tokens({"messages": MSGS, "tools": [{"function": {}}]})
    err = RequestError("bad", "x").to_openai()
    assert err == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "x", "code": 400}
    }


def test_completion_tokens(pt, tokenizer):
    assert pt.completion_tokens({"prompt": "Once upon a time"}) == encode_prompt(
        tokenizer, "Once upon a time", add_special_tokens=True
    )
    assert pt.completion_tokens(
        {"prompt": "Once upon a time", "add_special_tokens": False}
    ) == encode_prompt(tokenizer, "Once upon a time", add_special_tokens=False)
    assert pt.completion_tokens({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert pt.completion_tokens({"prompt": [[5, 6], [7]]}) == [5, 6]
    assert len(pt.completion_prompts({"prompt": ["a", "b c"]})) == 2
    assert pt.completion_tokens({"prompt_embeds": "xx"}) == []
    for bad in [None, "", [], 5, [1, "a"], [[1], "a"], [-1]]:
        with pytest.raises(RequestError):
            pt.completion_tokens({"prompt": bad})


@pytest.mark.parametrize(
    ("salt", "ok"),
    [
        (None, True),
        ("tenant-A", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("", False),
        (5, False),
        (["a"], False),
        ("a@b", False),
        ("a/b", False),
        ("a\\b", False),
        ("a\x00b", False),
        ("ünïcode salt", True),
    ],
)
def test_cache_salt_validation(salt, ok):
    if ok:
        assert validate_cache_salt(salt) == salt
    else:
        with pytest.raises(RequestError) as e:
            validate_cache_salt(salt)
        assert e.value.param == "cache_salt" and e.value.code == 400


def test_uses_prefix_cache():
    assert uses_prefix_cache({}, chat=True)
    assert not uses_prefix_cache({"prompt_logprobs": 0}, chat=False)
    assert not uses_prefix_cache({"echo": True}, chat=True)  # top_logprobs defaults to 0
    assert uses_prefix_cache({"echo": True}, chat=False)  # logprobs None: none computed
    assert not uses_prefix_cache({"echo": True, "logprobs": 2}, chat=False)
    assert not uses_prefix_cache({"skip_reading_prefix_cache": True}, chat=True)


def test_hashes_with_salt_and_lora():
    tokens = [*list(range(40)), 300, 70000, 151643, *list(range(1000, 1013))]
    h = PromptHasher()
    s = HashScheme()
    assert h.hashes(tokens, s) == [
        2233398808101521225,
        17911472383915781900,
        15929016977416759163,
    ]
    assert h.hashes(tokens, s, cache_salt="s1") == [
        16868077126905186569,
        1414065028342139162,
        17314461395344803950,
    ]
    lora = LoRA("my-lora", "/adapters/my-lora")
    assert h.hashes(tokens, s, lora=lora) == [
        14554600408563267446,
        5304254642391274310,
        2546400835048584276,
    ]


def _b64_tensor(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def test_prompt_embeds_decode_and_hash():
    t = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    got = decode_prompt_embeds(_b64_tensor(t))
    assert torch.equal(got, t)
    assert torch.equal(decode_prompt_embeds(_b64_tensor(t.unsqueeze(0))), t)  # batch dim of 1
    s = HashScheme()
    want = s.block_hashes([0] * 40, embeds_digests=prompt_embeds_digests(t, 16))
    assert PromptHasher().embeds_hashes(got, s) == want
    assert len(want) == 2
    assert PromptHasher().embeds_hashes(t.to(torch.float16), s) != want  # dtype matters


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "",
        "not base64!!",
        base64.b64encode(b"garbage").decode(),
        _b64_tensor({"a": torch.zeros(2)}),
        _b64_tensor(torch.zeros(4, 2, dtype=torch.int64)),
        _b64_tensor(torch.zeros(8)),
        _b64_tensor(torch.zeros(0, 4)),
    ],
)
def test_prompt_embeds_bad_input(bad):
    with pytest.raises(RequestError) as e:
        decode_prompt_embeds(bad)
    assert e.value.param == "prompt_embeds"
