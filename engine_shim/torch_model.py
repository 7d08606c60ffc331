"""A Llama forward pass over a paged KV cache, written out in plain torch.

The point of this model is to prove the engine shim's block bookkeeping: the KV of every
token lives in the physical block the block pool assigned to it, a prefix hit attends over
blocks that some earlier request wrote, and a freed block is simply overwritten by its next
owner. If the pool ever handed a request the wrong block ids, the attention would read
someone else's keys and the text would change; the tests compare against an uncached run.

Layout: one tensor per layer, ``[num_blocks, 2, kv_heads, block_size, head_dim]`` (index 0 =
keys, 1 = values), indexed by the block pool's own block ids; a token at position p of a
request lives in ``block_table[p // block_size]`` at offset ``p % block_size``.

Batching: the tokens of every request in a step are flattened into one ``[T, hidden]`` matrix
for the dense parts (QKV, output projection, MLP, norms), which is where nearly all the work
is, so each weight matrix is read once per step however many requests share it. Attention
alone runs as a loop over requests, because each request attends over its own ragged set of
blocks; on a CPU a padded batched kernel would spend more on padding and masks than the loop
costs (vLLM's varlen GPU kernels do this loop in one launch). Keys are stored after RoPE, as
vLLM does, so a cached block never needs its position again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    """The few numbers of a Llama checkpoint that the forward pass depends on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        if cfg.get("model_type") != "llama":
            raise ValueError(f"not a Llama checkpoint: model_type={cfg.get('model_type')!r}")
        if cfg.get("rope_scaling"):
            raise ValueError(f"rope_scaling {cfg['rope_scaling']!r} is not supported")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("biased Llama projections are not supported")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


class PagedKVCache:
    """Preallocated KV memory, one tensor per layer, addressed by block id.

    ``torch.empty`` only reserves address space: the operating system commits a page the
    first time a block is written, so a generous ``num_blocks`` costs little until used.
    Nothing is ever cleared; a block's content is valid exactly while the block pool says so.
    """

    def __init__(
        self,
        config: LlamaConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, 2, config.num_kv_heads, block_size, config.head_dim)
        self.layers = [torch.empty(shape, dtype=dtype) for _ in range(config.num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def slots(self, block_table: list[int], start: int, count: int) -> tuple[torch.Tensor, ...]:
        """Block ids and offsets of positions start..start+count-1 of one request."""
        bs = self.block_size
        last = (start + count - 1) // bs if count else -1
        if last >= len(block_table):
            raise ValueError(
                f"block table of {len(block_table)} blocks cannot hold position {start + count - 1}"
            )
        pos = torch.arange(start, start + count)
        table = torch.tensor(block_table[: last + 1], dtype=torch.long)
        # Check the whole table through the last position: hit blocks are read, not written.
        if len(table) and (int(table.min()) < 0 or int(table.max()) >= self.num_blocks):
            raise ValueError(f"block id out of range 0..{self.num_blocks - 1}: {block_table}")
        return table[pos // bs], pos % bs

    def write(
        self, layer: int, slots: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store k, v of shape [count, kv_heads, head_dim] into their slots."""
        blocks, offsets = slots
        pool = self.layers[layer]
        pool[blocks, 0, :, offsets, :] = k
        pool[blocks, 1, :, offsets, :] = v

    def gather(
        self, layer: int, block_table: list[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..length-1, each [kv_heads, length, head_dim]."""
        nblocks = -(-length // self.block_size)
        ids = torch.tensor(block_table[:nblocks], dtype=torch.long)
        kv = self.layers[layer].index_select(0, ids)  # [n, 2, kvh, bs, hd]
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, kv.shape[2], nblocks * self.block_size, -1)
        return kv[0, :, :length], kv[1, :, :length]


@dataclass
class SeqInput:
    """One request's share of a forward step.

    ``token_ids`` sit at positions ``start .. start+len-1``; positions before ``start`` are
    already in the cache (a prefix hit or earlier steps) and are read, never recomputed.
    ``block_table`` must cover every position through the last new token.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    want_logits: bool = True  # logits of the last new token (the one that gets sampled)
    all_logits: bool = False  # logits of every new token (tests only; the vocab is large)


class _Layer:
    __slots__ = ("down", "gate_up", "in_norm", "o", "post_norm", "qkv")

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        a = prefix + "self_attn."
        m = prefix + "mlp."
        self.qkv = torch.cat(
            [sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]]
        )
        self.o = sd[a + "o_proj.weight"]
        self.gate_up = torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]])
        self.down = sd[m + "down_proj.weight"]
        self.in_norm = sd[prefix + "input_layernorm.weight"]
        self.post_norm = sd[prefix + "post_attention_layernorm.weight"]


class LlamaPagedModel:
    """Inference-only Llama: weights as plain tensors, KV in a :class:`PagedKVCache`."""

    def __init__(
        self, config: LlamaConfig, state_dict: dict[str, torch.Tensor], dtype=torch.float32
    ) -> None:
        self.config = config
        self.dtype = dtype
        sd = {k.removeprefix("model."): v.to(dtype) for k, v in state_dict.items()}
        self.embed = sd["embed_tokens.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else sd["lm_head.weight"]
        self.final_norm = sd["norm.weight"]
        self.layers = [_Layer(sd, f"layers.{i}.") for i in range(config.num_layers)]
        hd = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
        )
        freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(dtype)
        self._sin = emb.sin().to(dtype)

    @classmethod
    def from_dir(cls, path: str | Path, dtype=torch.float32) -> LlamaPagedModel:
        """Load a saved transformers directory (config.json + *.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            sd.update(load_file(str(f)))
        return cls(config, sd, dtype=dtype)

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.config, num_blocks, block_size, dtype=self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return w * (x * torch.rsqrt(var + self.config.rms_norm_eps))

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], cache: PagedKVCache) -> list[torch.Tensor | None]:
        """Run one step; write the new tokens' KV into the cache; return logits per request.

        Each result is [vocab] (last new token), [n, vocab] with ``all_logits``, or None when
        the request asked for no logits (a chunk in the middle of a long prompt).
        """
        cfg = self.config
        if not seqs:
            return []
        for s in seqs:
            if not s.token_ids:
                raise ValueError("a scheduled request must compute at least one token")
            if s.start < 0 or s.start + len(s.token_ids) > cfg.max_position_embeddings:
                raise ValueError(
                    f"positions {s.start}..{s.start + len(s.token_ids) - 1} exceed the model's "
                    f"{cfg.max_position_embeddings}"
                )
        lens = [len(s.token_ids) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"token id outside the vocabulary 0..{cfg.vocab_size - 1}")
        pos = torch.cat(
            [torch.arange(s.start, s.start + n) for s, n in zip(seqs, lens, strict=True)]
        )
        cos = self._cos[pos].unsqueeze(1)  # [T, 1, hd]
        sin = self._sin[pos].unsqueeze(1)
        slots = [cache.slots(s.block_table, s.start, n) for s, n in zip(seqs, lens, strict=True)]
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)

        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[ids]  # [T, hidden]
        for li, layer in enumerate(self.layers):
            h = self._rms(x, layer.in_norm)
            qkv = h @ layer.qkv.T
            q = qkv[:, : nh * hd].view(-1, nh, hd)
            k = qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd)
            v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            attn = torch.empty_like(q)
            for i, s in enumerate(seqs):
                a, b = bounds[i], bounds[i + 1]
                cache.write(li, slots[i], k[a:b], v[a:b])
                attn[a:b] = self._attend(q[a:b], s, li, cache)
            x = x + attn.reshape(-1, nh * hd) @ layer.o.T
            h = self._rms(x, layer.post_norm)
            gu = h @ layer.gate_up.T
            gate, up = gu.split(cfg.intermediate_size, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.down.T

        out: list[torch.Tensor | None] = []
        for i, s in enumerate(seqs):
            a, b = bounds[i], bounds[i + 1]
            if s.all_logits:
                out.append(self._rms(x[a:b], self.final_norm) @ self.lm_head.T)
            elif s.want_logits:
                out.append(self._rms(x[b - 1], self.final_norm) @ self.lm_head.T)
            else:
                out.append(None)
        return out

    def _attend(self, q: torch.Tensor, s: SeqInput, layer: int, cache: PagedKVCache):
        """Causal attention of one request's new queries over its whole cached context."""
        n = q.shape[0]
        total = s.start + n
        k, v = cache.gather(layer, s.block_table, total)  # [kvh, total, hd]
        qh = q.transpose(0, 1)  # [nh, n, hd]
        if n == 1:
            mask = None  # a single query at the end sees everything
        else:
            qpos = torch.arange(s.start, total).unsqueeze(1)
            mask = torch.arange(total).unsqueeze(0) <= qpos  # [n, total]
        o = F.scaled_dot_product_attention(
            qh.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, enable_gqa=True
        )
        return o[0].transpose(0, 1)  # [n, nh, hd]
