"""Step-by-step replay of a visitor's run, rebuilt from the engine's per-step history. Pure functions, no I/O.

A ``Recording`` is a base snapshot (the pool just before the run was submitted) plus every ``StepSample`` from then
until the step that recorded the end of the run's last request (its pages given back), and no further: another
visitor's later steps never join it, nor do the steps of another engine that took its place (``generation``). Each
sample carries the pages that changed in that step (as full records) and the tokens it appended, so the pool after
step k is the base with the changes of steps 1..k applied in order.

The steps in the window that computed none of the run's requests are other visitors' (they share the pool): their
page changes are applied, but the replay shows only the run's own steps, its *frames*. Frame k is the run's k-th
step; the narration names it so ("step 3 of 12 of your run, engine step 267"), and the slider counts frames.

LRU ranks are rebuilt the same way the pool builds its LRU: a page joins the back when it becomes cached and leaves
when it stops being cached. A backend that does not publish its LRU order (vLLM) records cached pages without a
rank, and their replay keeps none: a rank is rebuilt only for pages whose record had one, never invented. Nor is
one rebuilt for an engine under another policy (``eviction``): FIFO, LFU and ARC reorder pages that no step
touched, so their replay shows cached pages without a rank.

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

MAX_SAMPLES = 4096  # a recording's bound: a run of 6 panels × 256 tokens takes a few hundred steps
# ▶ slow's pace, one step at a time: a run of the embedded model takes about a second, so even a quarter of its
# recorded time went by at 27 steps a second, too fast to point at anything
SLOW_STEPS_PER_S = 2.0


@dataclass(frozen=True)
class Recording:
    """One run: where the pool started, what each step did, and which request is which panel."""

    base: CacheSnapshot
    samples: tuple[StepSample, ...]
    request_ids: tuple[int, ...]  # index = panel
    generation: int = 0  # the backend's generation it records: another engine's steps never join it
    closed: bool = False  # the run ended and its last step is in: nothing joins it any more
    prefix_caching: bool = True  # its engine looked prompts up (off: no hit rate to draw, not 0%)
    eviction: str | None = "lru"  # its pool's policy: only LRU's order can be rebuilt from the steps

    @property
    def last_step(self) -> int:
        return self.samples[-1].step if self.samples else self.base.step

    def extended(self, samples: Sequence[StepSample], end_step: int | None = None, ended: bool = False) -> Recording:
        """The recording with the samples after its last one, up to ``end_step`` (the step that recorded the end of
        the run's last request, where the backend knows it). ``ended``: every request of the run has ended, so the
        recording closes once ``end_step`` is in (at once where the backend does not know it)."""
        if self.closed:
            return self
        new = [s for s in samples if s.step > self.last_step and (end_step is None or s.step <= end_step)]
        kept = (self.samples + tuple(new))[:MAX_SAMPLES]
        closed = len(kept) == MAX_SAMPLES or (ended and (end_step is None or any(s.step >= end_step for s in kept)))
        return dataclasses.replace(self, samples=kept, closed=closed)

    @property
    def frames(self) -> list[int]:
        """For each of the run's own steps, in order, how many samples the pool has taken in by its end: frame k
        shows the pool after ``samples[:frames[k - 1]]``. A closed recording's last sample (its end) is a frame."""
        mine = set(self.request_ids)
        ends = [i + 1 for i, s in enumerate(self.samples) if mine.intersection(s.requests) or _sampled_for(s, mine)]
        if self.closed and self.samples and (not ends or ends[-1] != len(self.samples)):
            ends.append(len(self.samples))
        return ends

    def samples_at(self, frame: int) -> int:
        """How many samples the pool has taken in at ``frame`` (0 = the base, before the run)."""
        frames = self.frames
        return frames[min(frame, len(frames)) - 1] if frame > 0 and frames else 0


def _sampled_for(sample: StepSample, requests: set[int]) -> bool:
    return any(rid in requests for rid, _ in sample.sampled)


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
    ranks = {page: rank for rank, page in enumerate(lru)} if recording.eviction == "lru" else {}
    return [
        dataclasses.replace(p, lru_rank=ranks.get(p.page) if p.lru_rank is not None else None)
        for p in (pages[i] for i in sorted(pages))
    ]


def no_rank(recording: Recording) -> str:
    """Why a cached page of this replay has no eviction rank: the backend's, or a policy whose order is not rebuilt."""
    if recording.eviction in (None, "lru"):
        return "the backend does not report it (vLLM: its LRU order)"
    return f"{recording.eviction.upper()} reorders pages no step touched, so a replay does not rebuild its order"


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


def narrate(recording: Recording, frame: int, notes: Callable[[int], Sequence[str]] | None = None) -> str:
    """One line on what the run's ``frame``-th step did for its panels, e.g. "step 3 of 12 of your run (engine step
    267): panel 3 admitted, 3 cached pages hit, 1 page allocated", and what other visitors' steps did since the frame
    before (they share the pool: an eviction there can cost this run a hit). ``notes``: more to say of an engine step
    (``causes.eviction_notes``: an eviction that cost a panel tokens)."""
    frames = recording.frames
    if frame <= 0 or not frames:
        return f"before your run (engine step {recording.base.step})"
    frame = min(frame, len(frames))
    index = frames[frame - 1]
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
    own = [(prompt, cached) for rid, prompt, cached in sample.admitted if rid in panel]
    if own:
        parts.append(f"{sum(c for _, c in own)} of {sum(p for p, _ in own)} prompt tokens from cache")
    if sample.evictions:
        parts.append(_count(sample.evictions, "eviction"))
    if sample.preemptions:
        parts.append(_count(sample.preemptions, "preemption"))
    if sample.prefill_tokens is None or sample.decode_tokens is None:
        computed = "tokens computed per step: n/a (not reported)"
    else:
        computed = f"{sample.prefill_tokens} prefill + {sample.decode_tokens} decode tokens computed"
    who = f"panels {', '.join(map(str, mine))}" if len(mine) > 1 else f"panel {mine[0]}" if mine else "your run ended"
    line = f"step {frame} of {len(frames)} of your run (engine step {sample.step}): {who}; {computed}"
    line += "; " + ", ".join(parts) if parts else ""
    if notes is not None and (said := notes(sample.step)):
        line += " · " + "; ".join(said)
    others = recording.samples[(frames[frame - 2] if frame > 1 else 0) : index - 1]
    if others:
        evicted = sum(s.evictions or 0 for s in others)
        line += f" · before it, {_count(len(others), 'step')} of other sessions" + (
            f" ({_count(evicted, 'eviction')})" if evicted else ""
        )
        if notes is not None and (said := [n for s in others for n in notes(s.step)]):
            line += ": " + "; ".join(said)
    return line


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


def replay_series(recording: Recording, frame: int) -> Series:
    """The run's charts, x in seconds since its first step, with the marker on its ``frame``-th step.

    Occupancy and evictions are the pool's, step by step through the run's window (other visitors' steps included:
    the pool is shared). The hit rate is the run's own: its requests' cached prompt tokens over their prompt
    tokens, admission by admission (``StepSample.admitted``)."""
    samples = recording.samples
    mine = set(recording.request_ids)
    start = samples[0].time - samples[0].duration_s if samples else 0.0
    hits = queries = 0
    evictions: int | None = 0
    hit_rate: list[float | None] = []
    evicted: list[int | None] = []
    admitted_x: list[float] = []
    admitted_rate: list[float] = []
    for s in samples:
        own = [(prompt, cached) for rid, prompt, cached in s.admitted if rid in mine]
        if own:
            step_q, step_h = sum(p for p, _ in own), sum(c for _, c in own)
            hits, queries = hits + step_h, queries + step_q
            admitted_x.append(round(s.time - start, 3))
            admitted_rate.append(step_h / step_q if step_q else 0.0)
        evictions = None if evictions is None or s.evictions is None else evictions + s.evictions
        hit_rate.append(hits / queries if queries else None)
        evicted.append(evictions)
    x = [round(s.time - start, 3) for s in samples]
    base = recording.base.pages
    index = recording.samples_at(frame)
    return Series(
        x_title="seconds into the run",
        ages=[0.0, *x],
        used=[sum(p.state == "in_use" for p in base), *(s.used_pages for s in samples)],
        cached=[sum(p.state == "cached" for p in base), *(s.cached_pages for s in samples)],
        free=[sum(p.state == "free" for p in base), *(s.free_pages for s in samples)],
        evictions=[0, *evicted],
        hit_rate=[None, *hit_rate],
        step_hit_ages=admitted_x,
        step_hit_rate=admitted_rate,
        marker=x[index - 1] if index > 0 and x else 0.0,
        prefix_caching=recording.prefix_caching,
        hit_rate_scope="your run",
        eviction=recording.eviction,
    )
