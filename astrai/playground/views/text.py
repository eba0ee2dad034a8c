"""What the page says in words: badges, the stats line, the request table, the savings note. Pure functions of
typed observations (no Gradio, no I/O), unit-tested directly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.observation import CacheStats, RequestInfo
from astrai.playground.backends.protocol import EngineView

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
NOT_REPORTED = "n/a (vLLM does not report it)"
HIT_RATE_CAPTION = (
    "Share of prompt tokens served from the prefix cache. Each request is counted once, at its first admission "
    "(a request preempted and re-admitted is not counted again). Line: since the engine started; dots: the "
    "requests admitted in that step."
)


def badge(info: RequestInfo | None) -> str:
    """A panel's figures. While its request runs, only those that are settled (prompt, cached, TTFT): the badge
    then changes a few times per run, not at every refresh (each change costs the streaming text browser frames)."""
    if info is None:
        return ""
    parts = [f"**{info.prompt_tokens}** prompt tokens"]
    if info.cached_tokens is not None and info.prompt_tokens:
        parts.append(f"**{info.cached_tokens}** cached ({100 * info.cached_tokens / info.prompt_tokens:.0f}%)")
    if info.ttft is not None:
        parts.append(f"TTFT {info.ttft:.2f} s")
    if info.status in ("waiting", "running"):
        parts.append("streaming…" if info.ttft is not None else "waiting…")
    elif info.tokens_per_s:
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


def _short(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def engine_line(view: EngineView, model_label: str) -> str:
    """Which engine the visitor is on, first, in words: its profile, pool, page size and batch, and who shares it."""
    others = view.visitors - 1
    sharing = f"shared with {others} other visitor{'s' if others != 1 else ''}" if others else "only you on it now"
    return f"**Your engine:** {view.name} · {view.description} · {sharing} · model: {model_label}"


def stats_line(stats: CacheStats, derived: frozenset[str] = frozenset(), caveat: str | None = None) -> str:
    """What the cache holds now and what it saved so far, in plain words first. A quantity the backend does not
    report reads "n/a (...)", and one it only derives (a field name in ``derived``) is marked "(derived)";
    ``caveat`` (the backend's, e.g. a page map that may be incomplete) ends it, as a warning."""

    def pages(value: int | None, name: str, what: str) -> str:
        if value is None:
            return f"{NOT_REPORTED} {what}"
        return f"**{value}** {what}" + (" (derived)" if name in derived else "")

    cached, free = pages(stats.cached_pages, "cached_pages", "cached"), pages(stats.free_pages, "free_pages", "free")
    used = "n/a" if stats.used_pages is None else f"**{stats.used_pages}**"
    now = (
        f"**Now:** {used} pages in use by running requests · {cached} (kept for reuse) · {free}, "
        f"of {_short(stats.n_pages)} pages × {_short(stats.page_size)} tokens"
    )
    if not stats.prefix_caching:
        reuse = "**Reuse:** prefix caching is off on this engine, so nothing is looked up"
    elif stats.query_tokens is None or stats.hit_tokens is None or stats.hit_rate is None:
        reuse = f"**Reuse so far:** {NOT_REPORTED}"
    elif not stats.query_tokens:
        reuse = "**Reuse so far:** no prompt has been looked up yet"
    else:
        reuse = (
            f"**Reuse so far:** **{stats.hit_tokens}** of {stats.query_tokens} prompt tokens came from the cache "
            f"({stats.hit_rate:.0%})"
        )
    if stats.readmitted_query_tokens:
        reuse += (
            f" · preempted requests, re-admitted, found {stats.readmitted_hit_tokens} of their "
            f"{stats.readmitted_query_tokens} tokens again (counted apart)"
        )
    line = f"{now}  \n{reuse} · {_count(stats.evictions)} evictions · {_count(stats.preemptions)} preemptions"
    return f"{line}  \n⚠️ {caveat}" if caveat else line


def unreachable_line(model_label: str, reason: str) -> str:
    """The stats line while the backend cannot be reached (the app keeps serving and retries)."""
    return f"⚠️ **backend unreachable**: {reason} · retrying every second · model: {model_label}"


@dataclass(frozen=True)
class RunSummary:
    """What one run cost: prefill tokens computed against submitted, and its times as the visitor saw them."""

    prompt_tokens: int
    computed_tokens: int  # prompt tokens not served from the cache (counted at each request's first admission)
    ttft_s: float  # median over the panels
    total_s: float  # submit to the last token


def run_summary(infos: Sequence[RequestInfo | None], total_s: float) -> RunSummary | None:
    """None when any request is unknown (its engine stopped, or forgotten it) or never started: nothing to
    compare."""
    if not infos or any(i is None or i.cached_tokens is None or i.ttft is None for i in infos):
        return None
    known = [i for i in infos if i is not None]
    ttfts = sorted(i.ttft or 0.0 for i in known)
    return RunSummary(
        prompt_tokens=sum(i.prompt_tokens for i in known),
        computed_tokens=sum(i.prompt_tokens - (i.cached_tokens or 0) for i in known),
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
