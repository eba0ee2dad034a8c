"""What the page says in words: badges, the stats line, the request table, the savings note. Pure functions of
typed observations (no Gradio, no I/O), unit-tested directly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.explain import Cause, Explanation
from astrai.observation import CacheStats, Forward, RequestInfo, TierStats
from astrai.playground.backends.protocol import EngineView
from astrai.playground.views import causes

MAX_HIGHLIGHT_TOKENS = 300
# How a special token (the start-of-text token every prompt begins with) is written: "<s>", as SentencePiece names the
# start token; "⟨s⟩" read as "(s)" in the page's font. Every view escapes it (it is text, never markup).
SPECIAL_TOKEN_TEXT = "<s>"
# then one column per cause of ``causes.TABLE_CAUSES`` (the first, "cached", is the engine's own cached tokens),
# the tokens recomputed after preemptions (counted apart), and the run's figures
TABLE_COLUMNS = [
    "panel",
    "prompt",
    "status",
    "prompt tokens",
    *(causes.CAUSES[cause][0] for cause in causes.TABLE_CAUSES),
    "recomputed (apart)",
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


def badge(info: RequestInfo | None, caching: bool = True, why: Explanation | None = None) -> str:
    """A panel's figures. While its request runs, only those that are settled (prompt, cached, TTFT): the badge
    then changes a few times per run, not at every refresh (each change costs the streaming text browser frames).
    ``caching``: its engine looks prompts up; off, the badge says so rather than "0 cached". ``why``: its prompt's
    tokens by cause, once looked up ("48 cached · 13 new · 7 partial page · 1 last token")."""
    if info is None:
        return ""
    parts = [f"**{info.prompt_tokens}** prompt tokens"]
    if not caching:
        parts.append("prefix caching off")
    elif info.cached_tokens is not None and info.prompt_tokens:
        cached = f"**{info.cached_tokens}** cached ({100 * info.cached_tokens / info.prompt_tokens:.0f}%)"
        # the engine's cached count includes the tokens loaded from the second tier: said as a part of it, not beside
        if loaded := (why.counts.get(Cause.LOADED, 0) if why is not None else 0):
            cached += f", {loaded} of them {causes.CAUSES[Cause.LOADED][0]}"
        parts.append(cached)
        if why is not None and (rest := causes.summary(why, skip=(Cause.CACHED, Cause.LOADED))):
            parts.append(rest)
    if info.ttft is not None:
        parts.append(f"TTFT {info.ttft:.2f} s")
    if info.status in ("waiting", "running"):
        parts.append("streaming…" if info.ttft is not None else "waiting…")
    elif info.tokens_per_s:
        parts.append(f"{info.tokens_per_s:.1f} tok/s")
    if info.preemptions:
        again = f", {info.recomputed_tokens} tokens computed again (apart)" if info.recomputed_tokens else ""
        parts.append(f"preempted ×{info.preemptions}{again}")
    if info.status == "failed" and info.error:
        parts.append(f"failed: {info.error}")
    elif info.status in ("cancelled", "failed"):
        parts.append(info.status)
    return " · ".join(parts)


HALVES = ("caching on", "caching off")  # a Compare's two halves, as the badges and the table label them


def compared_badge(on: str, off: str) -> str:
    """A panel's badge after a Compare: each half's figures, each labelled (a half with no request says nothing)."""
    halves = zip(HALVES, (on, off), strict=True)
    return "  \n".join(f"**{half.capitalize()}:** {badge}" for half, badge in halves if badge)


Decode = Callable[[Sequence[int]], str]


def readable(decode: Decode, special_ids: set[int]) -> Decode:
    """``decode`` with special tokens shown as ``SPECIAL_TOKEN_TEXT``: the one way every view (token colouring, page
    hovers, the prefix tree, replay) writes tokens, so a start-of-text token reads the same everywhere."""

    def shown(token_ids: Sequence[int]) -> str:
        out: list[str] = []
        run: list[int] = []
        for token in token_ids:
            if token in special_ids:
                if run:
                    out.append(decode(run))
                    run = []
                out.append(SPECIAL_TOKEN_TEXT)
            else:
                run.append(token)
        if run:
            out.append(decode(run))
        return "".join(out)

    return shown


def request_rows(
    infos: Sequence[RequestInfo | None],
    prompts: Sequence[str],
    caching: bool = True,
    whys: Sequence[Explanation | None] = (),
    half: str = "",
) -> list[list]:
    """One table row per panel that has a request, in ``TABLE_COLUMNS`` order: its tokens by cause (``whys``, where
    explained; else the cached tokens alone), "off" for cached where its engine does not cache. ``half``: which half
    of a Compare the rows are (``HALVES``), said beside each panel's number ("1 (caching on)")."""
    rows = []
    for i, info in enumerate(infos):
        if info is None:
            continue
        why = whys[i] if i < len(whys) else None
        by_cause: list[int | str | None] = list(causes.columns(why))
        by_cause[0] = (info.cached_tokens if why is None else by_cause[0]) if caching else "off"
        panel: int | str = f"{i + 1} ({half})" if half else i + 1
        row: list[int | float | str | None] = [panel, prompts[i][:40], info.status, info.prompt_tokens, *by_cause]
        row += [info.generated_tokens, round(info.ttft, 3) if info.ttft is not None else None]
        row += [round(info.tokens_per_s, 1) if info.tokens_per_s else None, info.preemptions]
        rows.append(row)
    return rows


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
    if stats.forward is not None:
        line += f" · forward: {FORWARDS[stats.forward]}"
    if stats.second_tier is not None:
        line += f"  \n{tier_line(stats.second_tier)}"
    return f"{line}  \n⚠️ {caveat}" if caveat else line


def tier_line(tier: TierStats) -> str:
    """The second tier in words: where it lives, how full it is, what it served and what moving pages cost.
    Its hit tokens are a part of the reuse the stats line counts (the pool's own hits are the rest). What the
    backend does not report (None: a vLLM server's tier, seen through its KV events) is named as "n/a", never 0."""
    if not tier.enabled:
        return f"**Second tier** ({tier.medium}): switched off after an error: {tier.error or 'unknown'}"
    policy = tier.write_policy
    how = "" if policy is None else f", written {WRITE_POLICIES.get(policy, policy)}"
    held = f"**{tier.pages}** of {tier.capacity_pages}" if tier.capacity_pages is not None else f"**{tier.pages}**"
    parts = [f"**Second tier** ({tier.medium}{how}): {held} pages held"]
    if tier.hit_tokens is not None:
        parts.append(f"**{tier.hit_tokens}** of the reused prompt tokens loaded from it")
    if tier.loaded_pages is not None and tier.bytes_loaded is not None and tier.load_seconds is not None:
        ms = 1000 * tier.load_seconds
        parts.append(f"{tier.loaded_pages} pages loaded ({_megabytes(tier.bytes_loaded)}) in {ms:.1f} ms")
    written = "" if tier.bytes_written is None else f" ({_megabytes(tier.bytes_written)})"
    parts += [f"{tier.written_pages} written{written}", f"{tier.evictions} evicted from it"]
    shown = {
        "write policy": policy,
        "capacity": tier.capacity_pages,
        "tokens loaded from it": tier.hit_tokens,
        "pages loaded": tier.loaded_pages,
        "bytes loaded": tier.bytes_loaded,
        "load time": tier.load_seconds,
        "bytes written": tier.bytes_written,
    }
    if unreported := [what for what, value in shown.items() if value is None]:
        parts.append(f"{', '.join(unreported)}: {NOT_REPORTED}")
    return " · ".join(parts)


# the tier's write policies (``TierStats.write_policy``), in words
WRITE_POLICIES = {"through": "through: every page the pool stores", "on_evict": "on eviction from the pool"}


def _megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


# which forward serves, in words (``CacheStats.forward``; a backend without one, vLLM, says nothing)
FORWARDS: dict[Forward, str] = {
    "eager": "**eager**",
    "compiling": "**eager** while the compiled one is built",
    "compiled": "**compiled**",
    "failed": "**eager** (the compiled one could not be built: the log says why)",
}


def unreachable_line(model_label: str, reason: str) -> str:
    """The stats line while the backend cannot be reached (the app keeps serving and retries)."""
    return f"⚠️ **backend unreachable**: {reason} · retrying every second · model: {model_label}"


@dataclass(frozen=True)
class RunSummary:
    """What one run cost: prefill tokens computed against submitted, and how soon its first tokens came."""

    prompt_tokens: int
    computed_tokens: int  # prefill tokens the engine ran: prompt tokens the cache did not serve, and recomputation
    recomputed_tokens: int | None  # of those, computed again after preemptions (None: not reported, vLLM)
    ttft_s: float  # median over the panels


def run_summary(infos: Sequence[RequestInfo | None]) -> RunSummary | None:
    """None when any request is unknown (its engine stopped, or forgotten it) or never started: nothing to
    compare."""
    if not infos or any(i is None or i.cached_tokens is None or i.ttft is None for i in infos):
        return None
    known = [i for i in infos if i is not None]
    ttfts = sorted(i.ttft or 0.0 for i in known)
    again = None if any(i.recomputed_tokens is None for i in known) else sum(i.recomputed_tokens or 0 for i in known)
    return RunSummary(
        prompt_tokens=sum(i.prompt_tokens for i in known),
        computed_tokens=sum(i.prompt_tokens - (i.cached_tokens or 0) for i in known) + (again or 0),
        recomputed_tokens=again,
        ttft_s=ttfts[len(ttfts) // 2],
    )


def savings_note(on: RunSummary | None, off: RunSummary | None, small_model: bool) -> str:
    """The sentence under the savings chart: the token counts the chart draws, and why no time is compared."""
    if on is None:
        return "Run a batch, then press **Compare with caching off** to run the same prompts without the cache."
    served = on.prompt_tokens - on.computed_tokens + (on.recomputed_tokens or 0)
    line = (
        f"With caching, **{on.computed_tokens}** prefill tokens were computed for {on.prompt_tokens} prompt tokens: "
        f"{served} ({served / on.prompt_tokens:.0%}) came from the cache"
    )
    line += f", and {on.recomputed_tokens} were computed again after preemptions." if on.recomputed_tokens else "."
    if off is None:
        return line + " Press **Compare with caching off** for the other side."
    line += f" Without it, **{off.computed_tokens}** were computed."
    line += (
        " Times are not compared: the two halves ran one after the other, so each panel's time to first token (in "
        "the badges) also says what else the machine was doing then; total time is mostly decoding, which caching "
        "does not change."
    )
    if small_model:
        line += " On the tiny embedded model a prompt's prefill is a small part of a step: the token count is the "
        line += "work saved."
    return line
