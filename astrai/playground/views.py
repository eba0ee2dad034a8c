"""Pure view functions: typed observations in, what the page shows out. No Gradio, no I/O, unit-tested directly.

The privacy rule lives here (``page_views``): a visitor sees the tokens of a page only when one of their own
requests is using it or stored it; any other page is labelled "other session" and its text is withheld.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.observation import CacheStats, PageRecord, RequestInfo, StepSample

MAX_HIGHLIGHT_TOKENS = 300
MAX_POINTS = 300  # per time series drawn
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
NOT_REPORTED = "n/a (vLLM does not report it)"
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
    if info.cached_tokens is not None and info.prompt_tokens:
        parts.append(f"**{info.cached_tokens}** cached ({100 * info.cached_tokens / info.prompt_tokens:.0f}%)")
    if info.ttft is not None:
        parts.append(f"TTFT {info.ttft:.2f} s")
    if info.tokens_per_s:
        parts.append(f"{info.tokens_per_s:.1f} tok/s")
    if info.preemptions:
        parts.append(f"preempted ×{info.preemptions}")
    if info.status == "failed" and info.error:
        parts.append(f"failed: {info.error}")
    elif info.status in ("cancelled", "failed"):
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


def _count(value: int | None) -> str:
    return NOT_REPORTED if value is None else str(value)


def stats_line(stats: CacheStats, model_label: str, derived: frozenset[str] = frozenset()) -> str:
    """The one-line summary under the charts; a quantity the backend does not report reads "n/a (...)", and one
    it only derives (a field name in ``derived``) is marked "(derived)"."""
    readmitted = (
        f" (+{stats.readmitted_hit_tokens} of {stats.readmitted_query_tokens} on re-admission)"
        if stats.readmitted_query_tokens
        else ""
    )

    def pages(value: int | None, name: str, what: str) -> str:
        if value is None:
            return f"{NOT_REPORTED} {what}"
        return f"**{value}** {what}" + (" (derived)" if name in derived else "")

    cached, free = pages(stats.cached_pages, "cached_pages", "cached"), pages(stats.free_pages, "free_pages", "free")
    return (
        f"**{stats.used_pages}** in use · {cached} · {free} "
        f"of {stats.n_pages} pages × {stats.page_size} tokens · hits {stats.hit_tokens} of {stats.query_tokens} "
        f"prompt tokens ({stats.hit_rate:.0%}){readmitted} · {_count(stats.evictions)} evictions · "
        f"{stats.preemptions} preemptions · prefix caching {'on' if stats.prefix_caching else 'off'} · "
        f"model: {model_label}"
    )


def unreachable_line(model_label: str, reason: str) -> str:
    """The stats line while the backend cannot be reached (the app keeps serving and retries)."""
    return f"⚠️ **backend unreachable**: {reason} · retrying every second · model: {model_label}"


@dataclass(frozen=True)
class PageView:
    """What one visitor may see of one page."""

    page: int
    state: str  # free / in_use / cached
    ref_count: int | None  # None: the backend does not know (vLLM)
    lru_rank: int | None
    chain_pos: int
    panels: tuple[int, ...]  # this visitor's panels using it
    other_users: int  # requests of other sessions (or unknown ones) using it
    text: str | None  # None when the text is not this visitor's to see
    just_evicted: bool
    hits: int | None = 0  # None: the backend does not know (vLLM)


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
    cached: list[int | None]  # None: not reported by the backend
    free: list[int | None]
    evictions: list[int | None]  # cumulative from the left edge; None: not reported
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
    evictions: list[int | None] = []
    total: int | None = 0
    for s in samples:
        total = None if total is None or s.evictions is None else total + s.evictions
        evictions.append(total)
    if stats.evictions is None:
        total = None
    admitted = [s for s in samples if s.query_tokens]
    columns = [
        [round(s.time - now, 3) for s in samples] + [0.0],
        [s.used_pages for s in samples] + [stats.used_pages],
        [s.cached_pages for s in samples] + [stats.cached_pages],
        [s.free_pages for s in samples] + [stats.free_pages],
        evictions + [total],
        hit_rate + [stats.hit_rate if stats.query_tokens else None],
    ]
    keep = _points_to_draw(columns[0], list(zip(*columns[1:], strict=True)))
    ages, used, cached, free, evicted, rates = ([column[i] for i in keep] for column in columns)
    return Series(
        x_title="seconds ago",
        ages=ages,
        used=used,
        cached=cached,
        free=free,
        evictions=evicted,
        hit_rate=rates,
        step_hit_ages=[round(s.time - now, 3) for s in admitted],
        step_hit_rate=[s.hit_tokens / s.query_tokens for s in admitted],
    )


def _points_to_draw(x: list[float], values: list[tuple], max_points: int = MAX_POINTS) -> list[int]:
    """Indices of the points a step-shaped chart needs: the first, the last, and each one whose values differ from
    the point before (a repeat adds nothing to an "hv" line). Past ``max_points``, the last point of each equal
    slice of the x range is kept: a browser redraws thousands of points every second otherwise."""
    keep = [i for i in range(len(x)) if i in (0, len(x) - 1) or values[i] != values[i - 1]]
    if len(keep) <= max_points:
        return keep
    width = (x[-1] - x[0]) / max_points or 1.0
    buckets: dict[int, int] = {}
    for i in keep:
        buckets[int((x[i] - x[0]) / width)] = i  # the bucket's last point wins
    return sorted({keep[0], *buckets.values(), keep[-1]})


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
