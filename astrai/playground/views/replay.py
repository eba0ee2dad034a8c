"""Step-by-step replay of a visitor's run, rebuilt from the engine's per-step history. Pure functions, no I/O.

A ``Recording`` is a base snapshot (the pool just before the run was submitted) plus every ``StepSample`` after
it. Each sample carries the pages that changed in that step (as full records) and the tokens it appended, so the
pool after step k is the base with the changes of steps 1..k applied in order. LRU ranks are rebuilt the same way
the pool builds its LRU: a page joins the back when it becomes cached and leaves when it stops being cached. A
backend that does not publish its LRU order (vLLM) records cached pages without a rank, and their replay keeps
none: a rank is rebuilt only for pages whose record had one, never invented.

One approximation, said here rather than hidden: if the base snapshot was taken while another visitor's step was
in flight, and in that same step a cached page was hit and released again, that page's LRU rank can be off in
the replay's first step (it is right from the next change on).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.observation import CacheSnapshot, PageRecord, StepSample
from astrai.playground.views.series import Series


@dataclass(frozen=True)
class Recording:
    """One run: where the pool started, what each step did, and which request is which panel."""

    base: CacheSnapshot
    samples: tuple[StepSample, ...]
    request_ids: tuple[int, ...]  # index = panel

    @property
    def steps(self) -> list[int]:
        """The engine steps of the recording, in order (other visitors' steps included: they share the pool)."""
        return [s.step for s in self.samples]

    def extended(self, samples: Sequence[StepSample]) -> Recording:
        """The recording with the samples that came after its last one."""
        last = self.samples[-1].step if self.samples else self.base.step
        return dataclasses.replace(self, samples=self.samples + tuple(s for s in samples if s.step > last))


def pages_at(recording: Recording, index: int) -> list[PageRecord]:
    """The pool after the first ``index`` samples of the recording (0 = the base)."""
    pages = {p.page: p for p in recording.base.pages}
    lru = [p.page for p in sorted(recording.base.pages, key=_rank) if p.state == "cached"]
    for sample in recording.samples[:index]:
        for change in sample.page_changes:
            was_cached = change.page in pages and pages[change.page].state == "cached"  # vLLM: maybe unseen
            pages[change.page] = change
            if was_cached and change.state != "cached":
                lru.remove(change.page)
            elif change.state == "cached" and not was_cached:
                lru.append(change.page)
    ranks = {page: rank for rank, page in enumerate(lru)}
    return [
        dataclasses.replace(p, lru_rank=ranks.get(p.page) if p.lru_rank is not None else None)
        for p in (pages[i] for i in sorted(pages))
    ]


def _rank(record: PageRecord) -> int:
    return record.lru_rank if record.lru_rank is not None else -1


def tokens_at(recording: Recording, index: int) -> list[list[int]]:
    """The tokens each panel had generated after the first ``index`` samples."""
    panel = {rid: i for i, rid in enumerate(recording.request_ids)}
    out: list[list[int]] = [[] for _ in recording.request_ids]
    for sample in recording.samples[:index]:
        for rid, token in sample.sampled:
            if rid in panel:
                out[panel[rid]].append(token)
    return out


def texts_at(recording: Recording, index: int, decode: Callable[[list[int]], str]) -> list[str]:
    return [decode(tokens) for tokens in tokens_at(recording, index)]


def narrate(recording: Recording, index: int) -> str:
    """One line on what the ``index``-th sample did for this run's panels, e.g.
    "step 12: panel 3 admitted, 3 pages hit, 1 page computed"."""
    if index == 0 or not recording.samples:
        return f"step {recording.base.step}: before the run"
    sample = recording.samples[index - 1]
    before = _states_before(recording, index - 1, {c.page for c in sample.page_changes})
    panel = {rid: i for i, rid in enumerate(recording.request_ids)}
    mine = [panel[r] + 1 for r in sample.requests if r in panel]
    seen_before = {r for s in recording.samples[: index - 1] for r in s.requests}
    admitted = [panel[r] + 1 for r in sample.requests if r in panel and r not in seen_before]
    parts = [f"panel {p} admitted" for p in admitted]
    for label, state in (("allocated", "in_use"), ("freed to the LRU", "cached"), ("freed", "free")):
        moved = [c for c in sample.page_changes if c.state == state and before[c.page] != state]
        fresh = [c for c in moved if before[c.page] == "free"] if state == "in_use" else moved
        hits = [c for c in moved if before[c.page] == "cached"] if state == "in_use" else []
        if fresh:
            parts.append(f"{_count(len(fresh), 'page')} {label}")
        if hits:
            parts.append(f"{_count(len(hits), 'cached page')} hit")
    if sample.hit_tokens:
        parts.append(f"{sample.hit_tokens} of {sample.query_tokens} prompt tokens from cache")
    if sample.evictions:
        parts.append(f"{_count(sample.evictions, 'eviction')}")
    if sample.preemptions:
        parts.append(f"{_count(sample.preemptions, 'preemption')}")
    if sample.prefill_tokens is None or sample.decode_tokens is None:
        computed = "tokens computed per step: n/a (not reported)"
    else:
        computed = f"{sample.prefill_tokens} prefill + {sample.decode_tokens} decode tokens computed"
    who = f"panels {', '.join(map(str, mine))}" if len(mine) > 1 else f"panel {mine[0]}" if mine else "other sessions"
    return f"step {sample.step}: {who}; {computed}" + ("; " + ", ".join(parts) if parts else "")


def _states_before(recording: Recording, index: int, pages: set[int]) -> dict[int, str]:
    """These pages' states after the first ``index`` samples: each one's latest change, else the base, else "free".
    Walks back from ``index`` and stops once every page is found (usually within a few steps). A page can be in
    neither: the vLLM backend's pages are the blocks its KV events told of, so one first stored during the run is
    absent from the base (it was free to us)."""
    found: dict[int, str] = {}
    for sample in reversed(recording.samples[:index]):
        for change in sample.page_changes:
            if change.page in pages and change.page not in found:
                found[change.page] = change.state
        if len(found) == len(pages):
            return found
    base = {p.page: p.state for p in recording.base.pages}
    return {page: found.get(page) or base.get(page, "free") for page in pages}


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def replay_series(recording: Recording, index: int) -> Series:
    """The run's charts, x in seconds since its first step, with the marker on the ``index``-th sample.

    The hit rate here is the run's own: hits over prompt tokens admitted since the run started.
    """
    samples = recording.samples
    start = samples[0].time - samples[0].duration_s if samples else 0.0
    hits = queries = 0
    evictions: int | None = 0
    hit_rate: list[float | None] = []
    evicted: list[int | None] = []
    for s in samples:
        hits, queries = hits + s.hit_tokens, queries + s.query_tokens
        evictions = None if evictions is None or s.evictions is None else evictions + s.evictions
        hit_rate.append(hits / queries if queries else None)
        evicted.append(evictions)
    admitted = [s for s in samples if s.query_tokens]
    x = [round(s.time - start, 3) for s in samples]
    base = recording.base.pages
    return Series(
        x_title="seconds into the run",
        ages=[0.0, *x],
        used=[sum(p.state == "in_use" for p in base), *(s.used_pages for s in samples)],
        cached=[sum(p.state == "cached" for p in base), *(s.cached_pages for s in samples)],
        free=[sum(p.state == "free" for p in base), *(s.free_pages for s in samples)],
        evictions=[0, *evicted],
        hit_rate=[None, *hit_rate],
        step_hit_ages=[round(s.time - start, 3) for s in admitted],
        step_hit_rate=[s.hit_tokens / s.query_tokens for s in admitted],
        marker=x[index - 1] if index > 0 and x else 0.0,
    )
