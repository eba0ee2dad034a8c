"""Incremental detokenization: text deltas that never split a multi-byte character.

Each new token is decoded together with a few tokens before it, because many tokenizers decode a token
differently at the start of a string (a leading-space marker, say) than after other tokens. Text ending in the
replacement character is held back until the following token completes the character.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        self._prefix = 0  # start of the context window
        self._read = 0  # ids up to here are already in ``emitted``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.emitted += delta
        return delta

    def flush(self) -> str:
        """At the end, emit whatever was held back, so the joined deltas equal the full decode."""
        full = self._decode(self.ids)
        if not full.startswith(self.emitted):
            return ""
        delta = full[len(self.emitted) :]
        self.emitted = full
        return delta

    @property
    def text(self) -> str:
        return self._decode(self.ids)
