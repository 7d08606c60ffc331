"""Seeded workloads for the fleet benchmark, written to and replayed from JSONL.

Every workload is a list of ``WorkloadRequest`` with an arrival offset ``t`` (seconds from the
start). Requests of one ``session`` (a chat, an agent loop) are sent in turn order, each no
earlier than its ``t`` *and* no earlier than the previous turn's completion: the next turn of a
conversation cannot be typed before the answer to the last one arrived. Requests without a
session are independent.

The shapes stand for the traffic that decides whether prefix-aware routing pays:

* ``chat``: multi-turn chat sessions; each turn re-sends the whole history (the chat template
  renders it, so the router's tokenizer path is exercised), a few system prompts are shared.
* ``shared``: many one-shot users behind a few long system prompts (popularity is skewed).
* ``agent``: agent loops: a long fixed tool preamble, then short tool-call/tool-result steps.
* ``unique``: the no-sharing control; every prompt starts with different text.
* ``mooncake``: Mooncake's trace format (timestamp ms, input_length, output_length, hash_ids
  of 512-token blocks) replayed as /v1/completions token-id prompts; equal hash_ids give equal
  512-token chunks, so a public trace's sharing structure survives the replay.

Content is made of plain English words (about 1.3 SmolLM2 tokens each), so sizes below are
in words for chat shapes and in tokens for Mooncake.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MOONCAKE_BLOCK",
    "WORKLOADS",
    "WorkloadRequest",
    "agent_workload",
    "chat_workload",
    "make_mooncake_trace",
    "mooncake_chunk",
    "mooncake_workload",
    "read_jsonl",
    "read_mooncake_trace",
    "request_rate",
    "scale_to_rate",
    "shared_prompt_workload",
    "unique_workload",
    "write_jsonl",
    "write_mooncake_trace",
]

MOONCAKE_BLOCK = 512  # tokens per hash_id in Mooncake traces
DATA_DIR = Path(__file__).parent / "data"
SYNTHETIC_TRACE = DATA_DIR / "mooncake_synthetic.jsonl"

# Token ids used for Mooncake chunks: clear of SmolLM2's special tokens (ids < 17) and of the
# top of its 49 152-token vocabulary, so any tokenizer of that size accepts them.
_TOKEN_LO, _TOKEN_HI = 1000, 48000

_WORDS = (  # noqa: SIM905 - a word list reads better as text
    "cache latency throughput memory token budget policy shard replica window queue batch "
    "stream region quota schedule backup restore migrate archive index kitchen sauce oven "
    "recipe flight hotel museum train ticket passport review patch commit network request "
    "system engine cluster tenant invoice ledger contract report metric alert dashboard "
    "garden river mountain harbour village market bakery library theatre stadium bridge "
    "tunnel signal sensor battery charger voltage circuit module driver kernel thread lock "
    "mutex channel socket packet header payload checksum buffer pointer vector matrix tensor "
    "gradient epoch dataset label feature sample weight bias layer block chain anchor"
).split()


@dataclass
class WorkloadRequest:
    """One request of a workload; ``kind`` picks the endpoint (chat or completions)."""

    id: str
    t: float
    kind: str  # "chat" | "completions"
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: list[int] | str | None = None
    session: str | None = None
    turn: int = 0
    group: str = ""  # what it shares (system prompt, tool set, ...), for the report
    meta: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body (streaming, usage at the end, exact output length)."""
        b: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.kind == "chat":
            b["messages"] = self.messages
        else:
            b["prompt"] = self.prompt
        return b

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: v for k, v in d.items() if v is not None and v != {} and v != ""}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WorkloadRequest:
        try:
            kind = d["kind"]
            if kind not in ("chat", "completions"):
                raise ValueError(f"kind must be chat or completions, got {kind!r}")
            if kind == "chat" and not isinstance(d.get("messages"), list):
                raise ValueError("a chat request needs a messages list")
            if kind == "completions" and d.get("prompt") is None:
                raise ValueError("a completions request needs a prompt")
            return cls(
                id=str(d["id"]),
                t=float(d["t"]),
                kind=kind,
                max_tokens=int(d["max_tokens"]),
                messages=d.get("messages"),
                prompt=d.get("prompt"),
                session=d.get("session"),
                turn=int(d.get("turn", 0)),
                group=str(d.get("group", "")),
                meta=dict(d.get("meta") or {}),
            )
        except KeyError as e:
            raise ValueError(f"missing field {e.args[0]!r}") from None


# ----------------------------------------------------------------------------------------
# JSONL


def write_jsonl(
    path: str | Path, requests: Sequence[WorkloadRequest], meta: dict[str, Any] | None = None
) -> None:
    """First line ``{"workload": meta}``, then one request per line, in arrival order."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        f.write(json.dumps({"workload": meta or {}}) + "\n")
        for r in sorted(requests, key=lambda r: (r.t, r.id)):
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path) -> tuple[list[WorkloadRequest], dict[str, Any]]:
    """Requests and the header's metadata; a bad line is an error naming its line number."""
    out: list[WorkloadRequest] = []
    meta: dict[str, Any] = {}
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("expected a JSON object")
                if "workload" in d and len(d) == 1:
                    meta = dict(d["workload"] or {})
                    continue
                out.append(WorkloadRequest.from_json(d))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate request ids")
    return out, meta


def request_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Mean arrival rate (requests/s) over the span of the arrival times."""
    if len(requests) < 2:
        return 0.0
    span = max(r.t for r in requests) - min(r.t for r in requests)
    return (len(requests) - 1) / span if span > 0 else 0.0


def scale_to_rate(requests: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """Stretch or squeeze the arrival times so the mean rate becomes ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    cur = request_rate(requests)
    if cur <= 0:
        return list(requests)
    f = cur / rate
    t0 = min(r.t for r in requests)
    out = []
    for r in requests:
        d = WorkloadRequest(**{**r.__dict__})
        d.t = (r.t - t0) * f
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------
# Text helpers


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _paragraphs(rng: random.Random, n_words: int, per: int = 60) -> str:
    parts = []
    left = n_words
    while left > 0:
        k = min(per, left)
        parts.append(_words(rng, k).capitalize() + ".")
        left -= k
    return "\n".join(parts)


def _poisson_times(rng: random.Random, n: int, rate: float) -> list[float]:
    t = 0.0
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ----------------------------------------------------------------------------------------
# Generators


def chat_workload(
    sessions: int = 40,
    turns: int = 6,
    system_prompts: int = 4,
    system_words: int = 300,
    user_words: int = 80,
    reply_words: int = 150,
    max_tokens: int = 16,
    rate: float = 8.0,
    think_s: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Multi-turn chats; turn k re-sends the system prompt and turns 0..k-1 with their replies.

    The replies in the history are fixed text (not the engine's output), as in a replayed log;
    the engine caches every prompt, so turn k's prompt is a prefix of turn k+1's.
    """
    rng = random.Random(seed)
    sys_texts = [
        f"You are assistant number {i}. Follow the house rules below.\n"
        + _paragraphs(random.Random(seed * 1000 + i), system_words)
        for i in range(system_prompts)
    ]
    starts = _poisson_times(rng, sessions, rate / max(turns, 1))
    out: list[WorkloadRequest] = []
    for s in range(sessions):
        g = rng.randrange(system_prompts)
        msgs: list[dict[str, str]] = [{"role": "system", "content": sys_texts[g]}]
        t = starts[s]
        for k in range(turns):
            msgs.append(
                {"role": "user", "content": f"(chat {s}, turn {k}) " + _words(rng, user_words)}
            )
            out.append(
                WorkloadRequest(
                    id=f"chat-{s}-{k}",
                    t=round(t, 4),
                    kind="chat",
                    max_tokens=max_tokens,
                    messages=[dict(m) for m in msgs],
                    session=f"chat-{s}",
                    turn=k,
                    group=f"sys{g}",
                )
            )
            msgs.append({"role": "assistant", "content": _paragraphs(rng, reply_words)})
            t += rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
    return sorted(out, key=lambda r: r.t)


def shared_prompt_workload(
    requests: int = 200,
    system_prompts: int = 6,
    system_words: int = 900,
    question_words: int = 40,
    max_tokens: int = 16,
    rate: float = 10.0,
    zipf_s: float = 1.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Many users, one turn each, behind a few long system prompts of skewed popularity."""
    rng = random.Random(seed)
    sys_texts = [
        f"Product manual {i}. Answer only from this manual.\n"
        + _paragraphs(random.Random(seed * 1000 + 500 + i), system_words)
        for i in range(system_prompts)
    ]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(system_prompts)]
    times = _poisson_times(rng, requests, rate)
    out = []
    for i, t in enumerate(times):
        g = rng.choices(range(system_prompts), weights=weights)[0]
        out.append(
            WorkloadRequest(
                id=f"shared-{i}",
                t=round(t, 4),
                kind="chat",
                max_tokens=max_tokens,
                messages=[
                    {"role": "system", "content": sys_texts[g]},
                    {"role": "user", "content": f"(user {i}) " + _words(rng, question_words)},
                ],
                group=f"sys{g}",
            )
        )
    return out


def agent_workload(
    loops: int = 30,
    steps: int = 6,
    tool_sets: int = 3,
    preamble_words: int = 1200,
    tail_words: int = 25,
    max_tokens: int = 16,
    rate: float = 8.0,
    step_s: float = 0.3,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Agent loops: a long fixed tool preamble, then short tool-call/tool-result steps."""
    rng = random.Random(seed)
    preambles = []
    for i in range(tool_sets):
        r = random.Random(seed * 1000 + 900 + i)
        tools = "\n".join(
            f"- tool_{i}_{j}(arg: string) -> json: " + _words(r, preamble_words // 12)
            for j in range(12)
        )
        preambles.append(f"You are an agent. Tool set {i}. Call tools as JSON.\n{tools}")
    starts = _poisson_times(rng, loops, rate / max(steps, 1))
    out = []
    for a in range(loops):
        g = rng.randrange(tool_sets)
        msgs = [
            {"role": "system", "content": preambles[g]},
            {"role": "user", "content": f"(task {a}) " + _words(rng, tail_words)},
        ]
        t = starts[a]
        for k in range(steps):
            out.append(
                WorkloadRequest(
                    id=f"agent-{a}-{k}",
                    t=round(t, 4),
                    kind="chat",
                    max_tokens=max_tokens,
                    messages=[dict(m) for m in msgs],
                    session=f"agent-{a}",
                    turn=k,
                    group=f"tools{g}",
                )
            )
            call = f'{{"tool": "tool_{g}_{rng.randrange(12)}", "arg": "{_words(rng, 3)}"}}'
            msgs.append({"role": "assistant", "content": call})
            msgs.append({"role": "user", "content": "tool result: " + _words(rng, tail_words)})
            t += rng.expovariate(1.0 / step_s) if step_s > 0 else 0.0
    return sorted(out, key=lambda r: r.t)


def unique_workload(
    requests: int = 150,
    words: int = 600,
    max_tokens: int = 16,
    rate: float = 8.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """The control: no two prompts share even their first block."""
    rng = random.Random(seed)
    times = _poisson_times(rng, requests, rate)
    return [
        WorkloadRequest(
            id=f"unique-{i}",
            t=round(t, 4),
            kind="chat",
            max_tokens=max_tokens,
            messages=[
                {
                    "role": "user",
                    "content": f"Ticket {rng.getrandbits(64):016x}-{i}: " + _words(rng, words),
                }
            ],
            group="none",
        )
        for i, t in enumerate(times)
    ]


# ----------------------------------------------------------------------------------------
# Mooncake traces


def mooncake_chunk(hash_id: int, salt: int = 0) -> list[int]:
    """The 512 token ids that stand for one Mooncake hash_id (same id -> same chunk)."""
    r = random.Random((int(hash_id) << 16) ^ (salt * 0x9E3779B1) ^ 0x5EED)
    return [r.randrange(_TOKEN_LO, _TOKEN_HI) for _ in range(MOONCAKE_BLOCK)]


def mooncake_prompt(
    hash_ids: Sequence[int], input_length: int, salt: int = 0, cache: dict | None = None
) -> list[int]:
    """Token ids for one trace line: the chunks of its hash_ids, cut to ``input_length``."""
    if input_length <= 0:
        raise ValueError(f"input_length must be > 0, got {input_length}")
    need = -(-input_length // MOONCAKE_BLOCK)
    if len(hash_ids) < need:
        raise ValueError(
            f"input_length {input_length} needs {need} hash_ids of {MOONCAKE_BLOCK} tokens, "
            f"the line has {len(hash_ids)}"
        )
    toks: list[int] = []
    for h in hash_ids[:need]:
        if cache is not None:
            c = cache.get(h)
            if c is None:
                c = cache[h] = mooncake_chunk(h, salt)
        else:
            c = mooncake_chunk(h, salt)
        toks.extend(c)
    return toks[:input_length]


def read_mooncake_trace(path: str | Path) -> list[dict[str, Any]]:
    """Lines of {timestamp (ms), input_length, output_length, hash_ids}; bad lines are errors."""
    out = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
                rec = {
                    "timestamp": float(d["timestamp"]),
                    "input_length": int(d["input_length"]),
                    "output_length": int(d["output_length"]),
                    "hash_ids": [int(h) for h in d["hash_ids"]],
                }
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({e!r})") from None
            out.append(rec)
    return out


def write_mooncake_trace(path: str | Path, lines: Iterable[dict[str, Any]]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for d in lines:
            f.write(json.dumps(d, separators=(", ", ": ")) + "\n")


def make_mooncake_trace(
    requests: int = 240,
    documents: int = 6,
    doc_blocks: tuple[int, int] = (2, 4),
    max_blocks: int = 7,
    conversation_share: float = 0.4,
    rate: float = 4.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """A synthetic trace with Mooncake's sharing shapes: popular documents, growing chats.

    hash_ids are allocated the way the real trace does: a new id for every new 512-token
    block, a reused id (and so a reused prefix) for a block whose whole prefix was seen.
    """
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs = [fresh(rng.randint(*doc_blocks)) for _ in range(documents)]
    weights = [1.0 / (i + 1) for i in range(documents)]
    chats: list[list[int]] = []
    t = 0.0
    out = []
    for _ in range(requests):
        t += rng.expovariate(rate)
        if chats and rng.random() < conversation_share:
            i = rng.randrange(len(chats))
            ids = chats[i] + fresh(1)
            if len(ids) >= max_blocks:
                chats.pop(i)
            else:
                chats[i] = ids
        else:
            doc = rng.choices(docs, weights=weights)[0]
            ids = doc + fresh(rng.randint(1, 2))
            if rng.random() < 0.5:
                chats.append(ids)
        ids = ids[:max_blocks]
        last = rng.randint(64, MOONCAKE_BLOCK)
        out.append(
            {
                "timestamp": int(t * 1000),
                "input_length": MOONCAKE_BLOCK * (len(ids) - 1) + last,
                "output_length": rng.randint(8, 64),
                "hash_ids": ids,
            }
        )
    return out


def mooncake_workload(
    trace: str | Path | Sequence[dict[str, Any]] | None = None,
    limit: int | None = None,
    max_tokens: int | None = 16,
    max_input: int | None = None,
    salt: int = 0,
) -> list[WorkloadRequest]:
    """A Mooncake trace as completions requests (token-id prompts), timestamps ms -> s.

    ``max_tokens`` caps output_length (None: as traced); ``max_input`` cuts long prompts to
    fit a small engine (the cut keeps the prefix, so the sharing structure is unchanged).
    """
    lines = read_mooncake_trace(trace or SYNTHETIC_TRACE) if not isinstance(trace, list) else trace
    if limit is not None:
        lines = lines[:limit]
    if not lines:
        return []
    t0 = min(d["timestamp"] for d in lines)
    cache: dict[int, list[int]] = {}
    out = []
    for i, d in enumerate(lines):
        n_in = d["input_length"] if max_input is None else min(d["input_length"], max_input)
        out_len = d["output_length"] if max_tokens is None else min(d["output_length"], max_tokens)
        out.append(
            WorkloadRequest(
                id=f"mc-{i}",
                t=round((d["timestamp"] - t0) / 1000.0, 4),
                kind="completions",
                max_tokens=max(1, out_len),
                prompt=mooncake_prompt(d["hash_ids"], n_in, salt, cache),
                group=f"h{d['hash_ids'][0]}" if d["hash_ids"] else "",
                meta={"hash_ids": d["hash_ids"], "input_length": d["input_length"]},
            )
        )
    return out


WORKLOADS = {
    "chat": chat_workload,
    "shared": shared_prompt_workload,
    "agent": agent_workload,
    "unique": unique_workload,
    "mooncake": mooncake_workload,
}
