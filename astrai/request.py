"""A request's life: its tokens, its pages, and how far its KV has been computed."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from astrai.page_pool import PageKey
from astrai.sampling import SamplingParams

if TYPE_CHECKING:
    import torch  # only in a type: the trace replay builds requests without loading torch

_ids = itertools.count()


class Status(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class Request:
    """One prompt being generated. ``token_ids`` is prompt + generated; KV exists for ``num_computed`` of them."""

    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    page_keys: list[PageKey] = field(default_factory=list)  # chain keys of the leading full pages
    num_computed: int = 0
    computed_high: int = 0  # the most tokens it ever had KV for: below this, computing again is recomputing
    recomputed_tokens: int = 0  # tokens computed again after a preemption took their KV (not served by the cache)
    indexed_pages: int = 0  # leading pages already in the prefix index (or checked against it)
    cached_tokens: int | None = None  # prefix hit at first admission, for the UI
    preemptions: int = 0
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    ended_step: int | None = None  # the engine step whose sample records its end (its pages given back)
    page_offset: int = 0  # its tenant's first page among the engine's KV pages: ``pages`` are the tenant's numbers

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def advance(self, count: int) -> None:
        """``count`` more tokens have KV now; those it had before a preemption count as recomputed."""
        start, self.num_computed = self.num_computed, self.num_computed + count
        self.recomputed_tokens += max(0, min(self.num_computed, self.computed_high) - start)
        self.computed_high = max(self.computed_high, self.num_computed)

    def decoded(self, count: int) -> int:
        """Of the ``count`` tokens it computes next, those that are decodes: generated tokens computed for the first
        time. The rest is prefill: the prompt, and whatever a preemption made it compute again."""
        return max(0, self.num_computed + count - max(self.num_computed, self.prompt_len, self.computed_high))

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.CANCELLED, Status.FAILED)
