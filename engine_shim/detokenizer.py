"""Incremental detokenization for streaming: emit only text that can no longer change.

Decoding token by token breaks multi-byte characters and merges; decoding everything each
step is quadratic. As in vLLM/HF streamers, we decode a short window from ``prefix_offset``
and emit what lies beyond ``read_offset`` once it no longer ends in a replacement char.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.tok is None:
            return "".join(f" t{t}" for t in ids)
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly final text (maybe empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character stays as is)."""
        rest = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = rest[len(prefix) :]
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += delta
        return delta
