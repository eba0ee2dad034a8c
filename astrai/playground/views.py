"""Pure view functions: typed observations in, what the page shows out. No Gradio, no I/O, unit-tested directly.

The privacy rule lives here (``page_views``): a visitor sees the tokens of a page only when one of their own
requests is using it or stored it; any other page is labelled "other session" and its text is withheld.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.observation import CacheStats, PageRecord, RequestInfo, StepSample

MAX_HIGHLIGHT_TOKENS = 300
SPECIAL_TOKEN_TEXT = "⟨s⟩"
TABLE_COLUMNS = [
    "panel",
    "prompt",
    "status",
    "prompt tokens",
    "cached tokens",
    "generated",
    "TTFT s",
    "tok/s",
    "preemptions",
]
HIT_RATE_CAPTION = (
    "Share of prompt tokens served from the prefix cache. Each request is counted once, at its first admission "
    "(a request preempted and re-admitted is not counted again). Line: since the engine started; dots: the "
    "requests admitted in that step."
)


@dataclass(frozen=True)
class Owner:
    """Who submitted a request: the privacy rule's input."""

    session: str
    panel: int


def badge(info: RequestInfo | None) -> str:
    if info is None:
        return ""
    parts = [f"**{info.prompt_tokens}** prompt tokens"]
    if info.cached_tokens is not None:
        parts.append(f"**{info.cached_tokens}** cached ({100 * info.cached_tokens / info.prompt_tokens:.0f}%)")
    if info.ttft is not None:
        parts.append(f"TTFT {info.ttft:.2f} s")
    if info.tokens_per_s:
        parts.append(f"{info.tokens_per_s:.1f} tok/s")
    if info.preemptions:
        parts.append(f"preempted ×{info.preemptions}")
    if info.status in ("cancelled", "failed"):
        parts.append(info.status)
    return " · ".join(parts)


def token_highlights(
    info: RequestInfo, decode: Callable[[list[int]], str], special_ids: set[int]
) -> list[tuple[str, str]]:
    """The prompt's tokens labelled "cached" or "computed" (for gr.HighlightedText), capped for the page's sake."""
    cached = info.cached_tokens or 0
    return [
        (SPECIAL_TOKEN_TEXT if token in special_ids else decode([token]), "cached" if i < cached else "computed")
        for i, token in enumerate(info.prompt_ids[:MAX_HIGHLIGHT_TOKENS])
    ]


def request_rows(infos: Sequence[RequestInfo | None], prompts: Sequence[str]) -> list[list]:
    """One table row per panel that has a request, in ``TABLE_COLUMNS`` order."""
    return [
        [
            i + 1,
            prompts[i][:40],
            info.status,
            info.prompt_tokens,
            info.cached_tokens,
            info.generated_tokens,
            round(info.ttft, 3) if info.ttft is not None else None,
            round(info.tokens_per_s, 1) if info.tokens_per_s else None,
            info.preemptions,
        ]
        for i, info in enumerate(infos)
        if info is not None
    ]


def stats_line(stats: CacheStats, model_label: str) -> str:
    readmitted = (
        f" (+{stats.readmitted_hit_tokens} of {stats.readmitted_query_tokens} on re-admission)"
        if stats.readmitted_query_tokens
        else ""
    )
    return (
        f"**{stats.used_pages}** in use · **{stats.cached_pages}** cached · **{stats.free_pages}** free "
        f"of {stats.n_pages} pages × {stats.page_size} tokens · hits {stats.hit_tokens} of {stats.query_tokens} "
        f"prompt tokens ({stats.hit_rate:.0%}){readmitted} · {stats.evictions} evictions · {stats.preemptions} "
        f"preemptions · prefix caching {'on' if stats.prefix_caching else 'off'} · model: {model_label}"
    )


@dataclass(frozen=True)
class PageView:
    """What one visitor may see of one page."""

    page: int
    state: str  # free / in_use / cached
    ref_count: int
    lru_rank: int | None
    chain_pos: int
    panels: tuple[int, ...]  # this visitor's panels using it
    other_users: int  # requests of other sessions (or unknown ones) using it
    text: str | None  # None when the text is not this visitor's to see
    just_evicted: bool
    hits: int = 0


def visible_panels(record: PageRecord, owners: dict[int, Owner], session: str) -> tuple[tuple[int, ...], bool]:
    """The privacy rule: this session's panels using the page, and whether the session may see its tokens
    (one of its requests uses the page, or stored it)."""
    mine = tuple(owners[r].panel for r in record.requests if r in owners and owners[r].session == session)
    stored_by = owners.get(record.stored_by) if record.stored_by is not None else None
    return mine, bool(mine) or (stored_by is not None and stored_by.session == session)


def page_views(
    records: Sequence[PageRecord],
    owners: dict[int, Owner],
    session: str,
    evicted: set[int],
    decode: Callable[[list[int]], str],
) -> list[PageView]:
    """Apply the privacy rule to every page: text only for pages this session's requests use or stored."""
    views = []
    for record in records:
        mine, visible = visible_panels(record, owners, session)
        views.append(
            PageView(
                page=record.page,
                state=record.state,
                ref_count=record.ref_count,
                lru_rank=record.lru_rank,
                chain_pos=record.chain_pos,
                panels=mine,
                other_users=len(record.requests) - len(mine),
                text=decode(list(record.token_ids)) if visible and record.token_ids else None,
                just_evicted=record.page in evicted,
                hits=record.hits,
            )
        )
    return views


@dataclass(frozen=True)
class Series:
    """The time series the charts draw, one point per engine step (live: plus one for "now")."""

    x_title: str
    ages: list[float]  # x of each point: seconds before now (live), or since the run started (replay)
    used: list[int]
    cached: list[int]
    free: list[int]
    evictions: list[int]  # cumulative from the left edge
    hit_rate: list[float | None]  # cumulative hit rate (0..1) after each step
    step_hit_ages: list[float]  # steps that admitted requests ...
    step_hit_rate: list[float]  # ... and the hit share of the prompt tokens they admitted
    marker: float | None = None  # replay: the x of the step shown


def series(history: Sequence[StepSample], stats: CacheStats, now: float, window_s: float = 120.0) -> Series:
    """Turn per-step samples into chart series over the last ``window_s`` seconds.

    The cumulative hit rate after step k is recovered exactly from the current totals minus the hits and queries
    of the steps after k, so it agrees with ``stats`` at the right edge whatever the history ring still holds.
    """
    samples = [s for s in history if s.time >= now - window_s]
    hits_after, queries_after = 0, 0
    hit_rate: list[float | None] = []
    for s in reversed(samples):
        hits, queries = stats.hit_tokens - hits_after, stats.query_tokens - queries_after
        hit_rate.append(hits / queries if queries else None)
        hits_after += s.hit_tokens
        queries_after += s.query_tokens
    hit_rate.reverse()
    evictions, total = [], 0
    for s in samples:
        total += s.evictions
        evictions.append(total)
    admitted = [s for s in samples if s.query_tokens]
    return Series(
        x_title="seconds ago",
        ages=[round(s.time - now, 3) for s in samples] + [0.0],
        used=[s.used_pages for s in samples] + [stats.used_pages],
        cached=[s.cached_pages for s in samples] + [stats.cached_pages],
        free=[s.free_pages for s in samples] + [stats.free_pages],
        evictions=evictions + [total],
        hit_rate=hit_rate + [stats.hit_rate if stats.query_tokens else None],
        step_hit_ages=[round(s.time - now, 3) for s in admitted],
        step_hit_rate=[s.hit_tokens / s.query_tokens for s in admitted],
    )


@dataclass(frozen=True)
class RunSummary:
    """What one run cost: prefill tokens computed against submitted, and its times as the visitor saw them."""

    prompt_tokens: int
    computed_tokens: int  # prompt tokens not served from the cache (counted at each request's first admission)
    ttft_s: float  # median over the panels
    total_s: float  # submit to the last token


def run_summary(infos: Sequence[RequestInfo], total_s: float) -> RunSummary | None:
    if not infos or any(i.cached_tokens is None or i.ttft is None for i in infos):
        return None  # a request that never started has nothing to compare
    ttfts = sorted(i.ttft or 0.0 for i in infos)
    return RunSummary(
        prompt_tokens=sum(i.prompt_tokens for i in infos),
        computed_tokens=sum(i.prompt_tokens - (i.cached_tokens or 0) for i in infos),
        ttft_s=ttfts[len(ttfts) // 2],
        total_s=total_s,
    )


def savings_note(on: RunSummary | None, off: RunSummary | None, small_model: bool) -> str:
    """The sentence under the savings chart: the token ratio, and why the times may differ little."""
    if on is None:
        return "Run a batch, then press **Compare with caching off** to run the same prompts without the cache."
    saved = on.prompt_tokens - on.computed_tokens
    line = (
        f"With caching, **{on.computed_tokens}** of {on.prompt_tokens} prompt tokens were computed: "
        f"{saved} ({saved / on.prompt_tokens:.0%}) came from the cache."
    )
    if off is None:
        return line + " Press **Compare with caching off** for the other side."
    line += f" Without it, all {off.computed_tokens} were computed."
    if small_model:
        line += (
            " The embedded model is tiny, so prefill costs little next to the per-step overheads and the times "
            "differ little; the token count is the work saved. Load a larger model (Engine settings) to see the "
            "time follow the tokens."
        )
    return line
