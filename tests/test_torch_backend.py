"""The torch backend computes real SmolLM2 over the block ids the shim's block pool hands out.

Everything real: the converted model (loaded once per session), the shim's own Scheduler and
KVCacheManager, the torch backend. The reference for "a prefix hit changes nothing" is the
same prompt served by an engine with prefix caching off; the reference for the model itself
is a plain transformers forward pass on the same weights.

Tolerance for the logits comparison: max |ours - transformers| <= 1e-3 on logits of
magnitude ~40 (float32; on one thread the two agree to the last bit today, the margin only
absorbs BLAS kernel choices on other machines).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from engine_shim.backend import BackendConfig, ScheduledWork, create_backend  # noqa: E402
from engine_shim.kv_cache_manager import KVCacheManager  # noqa: E402
from engine_shim.model_setup import convert_gguf_model  # noqa: E402
from engine_shim.request import Request  # noqa: E402
from engine_shim.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from engine_shim.torch_backend import TorchBackend  # noqa: E402
from engine_shim.torch_model import LlamaPagedModel, SeqInput  # noqa: E402

pytestmark = pytest.mark.timeout(60)

LOGIT_ATOL = 1e-3
BS = 16


@pytest.fixture(scope="session")
def model_dir():
    return convert_gguf_model()  # no-op once converted (make does it at install time)


@pytest.fixture(scope="session")
def model(model_dir):
    torch.set_num_threads(1)
    return LlamaPagedModel.from_dir(model_dir)


@dataclass
class Served:
    tokens: list[int]
    cached: int


@dataclass
class Engine:
    """A test driver: the shim's Scheduler and KVCacheManager feeding a TorchBackend."""

    model: LlamaPagedModel
    num_blocks: int = 64
    caching: bool = True
    budget: int = 2048
    max_seqs: int = 16
    writers: dict[int, set[str]] = field(default_factory=dict)  # block id -> requests that wrote

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.num_blocks, BS, enable_caching=self.caching)
        self.sched = Scheduler(
            self.kv, SchedulerConfig(max_num_batched_tokens=self.budget, max_num_seqs=self.max_seqs)
        )
        cfg = BackendConfig(num_gpu_blocks=self.num_blocks, block_size=BS, max_model_len=2048)
        self.backend = TorchBackend(cfg, model=self.model)
        self.steps = 0

    def work(self, req: Request, n: int, temperature: float, seed: int | None) -> ScheduledWork:
        start = req.num_computed_tokens
        blocks = self.kv.get_block_ids(req.request_id)
        for p in range(start, start + n):
            self.writers.setdefault(blocks[p // BS], set()).add(req.request_id)
        return ScheduledWork(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start : start + n],
            start_position=start,
            block_ids=blocks,
            num_computed_tokens=start,
            num_tokens=req.num_tokens,
            needs_sample=start + n == req.num_tokens,
            output_index=req.num_output_tokens,
            temperature=temperature,
            seed=seed,
            sample_key=hash((tuple(req.prompt_token_ids), seed)) & 0xFFFFFFFFFFFFFFFF,
        )

    def serve(
        self,
        prompts: dict[str, list[int]],
        max_tokens: int = 4,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> dict[str, Served]:
        """Submit all prompts at once and step until every one has finished."""
        reqs = {rid: Request(rid, p, max_tokens=max_tokens) for rid, p in prompts.items()}
        for r in reqs.values():
            self.sched.add_request(r)
        for _ in range(200):
            if not self.sched.has_unfinished_requests():
                break
            out = self.sched.schedule()
            work = [self.work(r, n, temperature, seed) for r, n in out.scheduled]
            self.sched.update_from_output(out, self.backend.execute(work))
            self.steps += 1
        else:
            raise AssertionError("requests did not finish within 200 steps")
        return {
            rid: Served(list(r.output_token_ids), max(r.num_cached_tokens, 0))
            for rid, r in reqs.items()
        }


_UNCACHED: dict[tuple[int, ...], list[int]] = {}


def uncached(model: LlamaPagedModel, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """Greedy output with prefix caching off (memoised: a longer greedy run has the shorter
    one as its prefix, and decode steps are what make these tests slow)."""
    key = tuple(prompt)
    have = _UNCACHED.get(key, [])
    if len(have) < max_tokens:
        have = Engine(model, caching=False).serve({"x": prompt}, max_tokens)["x"].tokens
        _UNCACHED[key] = have
    return have[:max_tokens]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """A shared 'system prompt' (>= 3 blocks) with different user turns."""
    from events.tokenizer import encode_chat

    system = (
        "You are a terse assistant for a shipping company. Answer in one short sentence, "
        "never apologise, and prefer numbers to words."
    )

    def chat(q: str) -> list[int]:
        return encode_chat(
            tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )

    return {
        "a": chat("How many days does a parcel take from Paris to Lyon?"),
        "b": chat("What is the heaviest parcel you accept?"),
        "c": chat("Do you deliver on Sundays?"),
    }


def test_logits_match_transformers(model, model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = prompts["a"]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    del hf
    cache = model.new_cache(16, BS)
    # Whole prompt in one prefill, blocks in a scrambled order.
    table = [9, 3, 12, 5, 7, 1]
    full = model.forward([SeqInput(ids, 0, table, all_logits=True)], cache)[0]
    assert (full - ref).abs().max().item() <= LOGIT_ATOL
    # Same prompt as a "hit" of 2 blocks + a chunk + one-token decodes, in other blocks.
    cache2 = model.new_cache(16, BS)
    t2 = [2, 4, 6, 8, 10, 11]
    model.forward([SeqInput(ids[:32], 0, t2, want_logits=False)], cache2)
    mid = model.forward([SeqInput(ids[32:-3], 32, t2, all_logits=True)], cache2)[0]
    assert (mid - ref[32:-3]).abs().max().item() <= LOGIT_ATOL
    for p in range(len(ids) - 3, len(ids)):
        one = model.forward([SeqInput([ids[p]], p, t2)], cache2)[0]
        assert (one - ref[p]).abs().max().item() <= LOGIT_ATOL


def test_prefix_hits_give_uncached_output(model, prompts):
    """Hits of 0 blocks, some blocks, and all blocks but the last token; and a follow-up turn
    that hits blocks written during decode."""
    a, b = prompts["a"], prompts["b"]
    exact = a[: (len(a) // BS) * BS + 1]  # k full blocks + 1 token: hit all k, compute 1
    assert len(exact) % BS == 1
    follow_base = a + uncached(model, a, 12)  # turn 1 + its answer, past a block boundary
    follow = [*follow_base, *prompts["c"][-8:]]

    eng = Engine(model, num_blocks=64)
    got = {}
    got.update(eng.serve({"a": a}, 12))  # cold; decode fills blocks past the prompt
    got.update(eng.serve({"b": b, "exact": exact}))
    got.update(eng.serve({"follow": follow}))

    assert got["a"].cached == 0
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // BS * BS
    assert 0 < got["b"].cached == shared < len(b)
    assert got["exact"].cached == len(exact) - 1
    # The follow-up hits past the first prompt, into blocks written by a's decode steps.
    assert got["follow"].cached > len(a)
    for rid, p in {"a": a, "b": b, "exact": exact, "follow": follow}.items():
        n = 12 if rid == "a" else 4
        assert got[rid].tokens == uncached(model, p, n), rid


def test_eviction_and_reuse_keep_outputs_exact(model, prompts):
    """A pool so small that every round evicts the last one's cached blocks and hands the
    same block ids to other requests; partial hits after eviction must still be exact."""
    a, b, c = prompts["a"], prompts["b"], prompts["c"]
    need = -(-(max(len(a), len(b), len(c)) + 4) // BS)
    eng = Engine(model, num_blocks=need + 3)  # room for one request and a bit
    want = {k: uncached(model, p) for k, p in prompts.items()}
    rounds = [("a", a), ("b", b), ("a2", a), ("c", c), ("a3", a), ("b2", b)]
    cached = {}
    for rid, p in rounds:
        s = eng.serve({rid: p})[rid]
        cached[rid] = s.cached
        assert s.tokens == want[rid.rstrip("23")], rid
    assert any(len(w) >= 3 for w in eng.writers.values()), "no block was reused"
    assert cached["a"] == 0 and cached["b"] > 0  # b hits the shared system prompt
    assert 0 < cached["a2"] < len(a)  # only part of a survived b


def test_batched_chunked_and_preempted_steps_stay_exact(model, prompts):
    """Several requests per step, prompts split into chunks, and preemption by recompute."""
    want = {k: uncached(model, p) for k, p in prompts.items()}
    eng = Engine(model, num_blocks=64, budget=24)  # every prompt needs several chunks
    got = eng.serve(prompts)
    assert {k: v.tokens for k, v in got.items()} == want
    # Prompts of exactly 3 blocks in 6 usable blocks: two are admitted, and the first decode
    # step needs a 4th block each, so the newer one is preempted and later recomputed.
    short = {k: p[: 3 * BS] for k, p in prompts.items()}
    want = {k: uncached(model, p) for k, p in short.items()}
    eng = Engine(model, num_blocks=7, caching=False)
    got = eng.serve(short)
    assert eng.sched.num_preemptions > 0
    assert {k: v.tokens for k, v in got.items()} == want


def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(model, prompts):
    a = prompts["a"]
    one = Engine(model).serve({"a": a}, 3, temperature=0.8, seed=7)["a"].tokens
    # Same seed with other requests in the batch: same tokens.
    two = Engine(model).serve(prompts, 3, temperature=0.8, seed=7)["a"].tokens
    assert one == two
    cache = model.new_cache(8, BS)
    logits = model.forward([SeqInput(a, 0, list(range(1, 8)))], cache)[0]
    assert Engine(model).serve({"a": a}, 1)["a"].tokens == [int(logits.argmax())]


def test_create_backend_and_bad_inputs(model_dir):
    cfg = BackendConfig(
        num_gpu_blocks=8, block_size=BS, max_model_len=512, model_path=str(model_dir)
    )
    be = create_backend("torch", cfg)
    assert be.name == "torch" and be.blocking and be.step_seconds([]) == 0.0
    w = ScheduledWork("r", [1, 2, 3], 0, [1], 0, 3, True, temperature=0.0)
    assert set(be.execute([w])) == {"r"}
    with pytest.raises(ValueError, match="block table"):
        be.execute([ScheduledWork("r", list(range(20)), 0, [1], 0, 20, True)])
    with pytest.raises(ValueError, match="out of range"):
        be.execute([ScheduledWork("r", [1], 0, [8], 0, 1, True)])
    with pytest.raises(ValueError, match="out of range"):  # a bad hit block, read only
        be.execute([ScheduledWork("r", [1], 16, [99, 1], 16, 17, True)])
    with pytest.raises(ValueError, match="vocabulary"):
        be.execute([ScheduledWork("r", [10**6], 0, [1], 0, 1, True)])
    with pytest.raises(ValueError, match="num-gpu-blocks"):
        TorchBackend(
            BackendConfig(num_gpu_blocks=10**6, block_size=BS, max_model_len=512),
            model=be.model,
        )
    be.close()


async def test_shim_serves_chat_with_torch_backend_and_hits_change_nothing(tokenizer, model_dir):
    """Through HTTP and the official client: a hit on a shared system prompt, and the same
    text as a shim with prefix caching off."""
    from openai import AsyncOpenAI

    from engine_shim.testing import running_shim
    from events.tokenizer import DEFAULT_MODEL_NAME

    system = {"role": "system", "content": "You answer in five words or fewer."}
    turns = ["Name a primary colour.", "Name a large ocean."]

    async def ask(caching: bool) -> list[tuple[str, int]]:
        out = []
        kw = {"num_gpu_blocks": 48, "max_model_len": 512, "enable_prefix_caching": caching}
        async with running_shim(tokenizer, backend="torch", **kw) as shim:
            c = AsyncOpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0, timeout=30)
            for q in turns:
                r = await c.chat.completions.create(
                    model=DEFAULT_MODEL_NAME,
                    messages=[system, {"role": "user", "content": q}],
                    max_tokens=4,
                    temperature=0.0,
                )
                details = r.usage.prompt_tokens_details
                out.append((r.choices[0].message.content, details.cached_tokens if details else 0))
            await c.close()
        return out

    cached, plain = await ask(True), await ask(False)
    assert cached[0][1] == 0 and cached[1][1] >= 16  # the second turn hit the system prompt
    assert [t for t, _ in cached] == [t for t, _ in plain]
    assert all(t for t, _ in cached)
