"""One generation request as the engine core sees it: tokens, progress and block hashes.

The request owns its block hashes (as in vLLM) because the hash of a block depends only on
the request's tokens and extra keys, and computing them when tokens arrive keeps the
scheduler's lookup to one dict probe per block. Hashes are full digests (bytes); events
carry their low 64 bits.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

from events.hashing import HashScheme, LoRA

ReportMode = str  # "incremental" (vLLM default) or "full" (re-announce hit blocks)
REPORT_MODES = ("incremental", "full")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class RequestBlockHasher:
    """Extends a request's hash chain with the blocks its tokens have filled since last time.

    Incremental on purpose: prompt blocks are hashed once at creation, then each generated
    block once when its last token arrives, so the decode loop never rehashes the prefix.
    """

    def __init__(self, scheme: HashScheme) -> None:
        self.scheme = scheme

    def __call__(self, request: Request) -> list[bytes]:
        bs = self.scheme.block_size
        start = len(request.block_hashes)
        tokens = request.all_token_ids
        if len(tokens) < (start + 1) * bs:
            return []
        return self.scheme.block_digests(
            tokens,
            cache_salt=request.cache_salt,
            lora=request.lora,
            parent=request.block_hashes[-1] if start else None,
            start_block=start,
        )


class Request:
    """A request's tokens, progress through the model and prefix-cache identity.

    Made without ``block_hasher`` it has no hashes until a KVCacheManager first sees it and
    attaches its own scheme (then the prompt is hashed at once).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        kv_cache_report_mode: ReportMode = "incremental",
        *,
        lora_int_id: int | None = None,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        max_tokens: int = 16,
        ignore_eos: bool = True,
        eos_token_id: int | None = None,
        skip_reading_prefix_cache: bool = False,
        seed: int | None = None,
        temperature: float = 1.0,
        eos_after: int | None = None,
        sample_key: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        if kv_cache_report_mode not in REPORT_MODES:
            raise ValueError(
                f"kv_cache_report_mode must be one of {REPORT_MODES}, got {kv_cache_report_mode!r}"
            )
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.cache_salt = cache_salt or None
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.lora_int_id = lora_int_id
        self.lora = LoRA(lora_name, lora_path or "") if lora_name else None
        self.kv_cache_report_mode = kv_cache_report_mode
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.eos_token_id = eos_token_id
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.seed = seed
        self.temperature = temperature
        self.eos_after = eos_after
        self.sample_key = sample_key
        self.arrival_time = time.time() if arrival_time is None else arrival_time

        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix-cache hit at the first admission (what usage.cached_tokens reports); -1 = unset.
        self.num_cached_tokens = -1
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.update_block_hashes()

    # -- tokens ---------------------------------------------------------------------------

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Add sampled tokens; blocks they fill get their hash now (vLLM's moment)."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    # -- hashes ---------------------------------------------------------------------------

    @property
    def has_block_hasher(self) -> bool:
        return self._block_hasher is not None

    def set_block_hasher(self, hasher: Callable[[Request], list[bytes]]) -> None:
        """Attach a hasher (once) and hash every block already full."""
        if self._block_hasher is None:
            self._block_hasher = hasher
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
