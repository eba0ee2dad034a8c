"""Why each prompt token was or was not served from the cache, as a visitor reads it: the colours of the prompt's
tokens with a hover text per run of tokens, a one-line summary for each panel's badge, the request table's columns,
and the words the replay says. Pure: ``astrai.explain``'s records in, text and HTML out.

Whose page a cause names is said as the visitor may know it: a panel of the run shown, an earlier run of theirs, or
another session (never its text), and in a fleet the replica.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from astrai.explain import Cause, Explanation, PageLife, Segment, Unknown

# The causes in the order a reader meets them (cached first), with their words and colours.
CAUSES: dict[Cause, tuple[str, str]] = {
    Cause.CACHED: ("cached", "#86efac"),
    Cause.LOADED: ("loaded from the second tier", "#bef264"),
    Cause.NEW: ("new", "#fdba74"),
    Cause.EVICTED: ("evicted", "#fca5a5"),
    Cause.EVICTED_BOTH: ("evicted from both", "#f87171"),
    Cause.CLEARED: ("cleared", "#f9a8d4"),
    Cause.DIVERGED: ("diverged", "#c4b5fd"),
    Cause.PARTIAL_PAGE: ("partial page", "#e5e7eb"),
    Cause.LAST_TOKEN: ("last token", "#fde68a"),
    Cause.OTHER_NAMESPACE: ("another namespace", "#a5f3fc"),
    Cause.OTHER_REPLICA: ("another replica", "#99f6e4"),
    Cause.CACHING_OFF: ("caching off", "#d1d5db"),
    Cause.NOT_ADMITTED: ("not looked up yet", "#f3f4f6"),
    Cause.IN_PROGRESS: ("in progress", "#e0e7ff"),
    Cause.UNKNOWN: ("unknown", "#cbd5e1"),
}
TABLE_CAUSES = list(CAUSES)  # the request table's columns, in order: they add up to the prompt
NO_SALTS = (
    "A vLLM server sends no salts: whether these tokens were cached under another namespace cannot be known here."
)
UNKNOWN_WORDS = {
    Unknown.FORGOTTEN: "older than the history the app keeps",
    Unknown.EVENTS_LOST: "events were lost while it was looked up",
    Unknown.NO_ADMISSION: "its lookup is not in the kept history",
    Unknown.CONFLICT: "the history and the server disagree (a server sends no salts)",
}


@dataclass(frozen=True)
class Whose:
    """How the viewer names a request: a panel of the run shown, an earlier run of theirs, or another session."""

    panels: Mapping[int, int]  # request -> panel index, for the run shown
    own: Collection[int]  # every request of the viewer's still remembered
    replicas: Sequence[str] = ()  # replica names of a fleet, by index (empty for one cache)

    def request(self, request: int | None) -> str:
        if request is None:
            return "a request the app does not know"
        if request in self.panels:
            return f"panel {self.panels[request] + 1} of this run"
        return "an earlier run of yours" if request in self.own else "another session"

    def replica(self, index: int) -> str:
        return self.replicas[index] if 0 <= index < len(self.replicas) else f"replica {index + 1}"


def hover(segment: Segment, whose: Whose, shown: Callable[[Sequence[int]], str] | None = None) -> str:
    """What one run of tokens says when hovered: its cause, and the facts the cause names (tokens written with
    ``shown``, as the token view writes them; without it, as ids)."""
    size = segment.end - segment.start
    tokens = f"{size} token{'s' if size != 1 else ''}"
    page = segment.page
    cause = segment.cause
    if cause is Cause.CACHED:
        where = f" on {whose.replica(page.replica)}" if page is not None and whose.replicas else ""
        stored = _stored(page, whose) if page is not None else "a page the history no longer holds"
        line = f"{tokens} served from the cache{where}: {stored}"
    elif cause is Cause.NEW:
        line = (
            f"{tokens} computed: no page with these tokens after this prefix was stored here, as far as the app's "
            "history goes back"
        )
    elif cause is Cause.LOADED:
        line = f"{tokens} loaded from the second tier into the pool for this request, not computed"
    elif cause in (Cause.EVICTED, Cause.CLEARED) and page is not None:
        line = f"{tokens} computed again: {_ended(page, whose)}"
    elif cause is Cause.EVICTED_BOTH and page is not None:
        line = f"{tokens} computed again: {_ended(page, whose)}, then evicted from the second tier too"
    elif cause is Cause.DIVERGED and segment.divergence is not None:
        d = segment.divergence
        yours, this = (_written(t, shown) for t in (d.cached_tokens[d.at :], d.prompt_tokens[d.at :]))
        line = (
            f"{tokens} computed: your cached page after the same prefix differs from its token {d.at + 1} on "
            f"(yours cached: {yours}; this prompt: {this})"
        )
    elif cause is Cause.PARTIAL_PAGE:
        line = f"{tokens} after the last full page: only full pages are cached"
    elif cause is Cause.LAST_TOKEN:
        line = "the last prompt token is always computed, for the first output's logits"
        if segment.costs_page:
            line = (
                f"{tokens}: a whole cached page unused, since the last token is always computed (hits stop at len - 1)"
            )
    elif cause is Cause.OTHER_NAMESPACE:
        line = f"{tokens} computed: the same tokens are cached under another namespace (another salt)"
    elif cause is Cause.OTHER_REPLICA and page is not None:
        line = (
            f"{tokens} computed: {whose.replica(page.replica)} holds them, and the router sent this request elsewhere"
        )
    elif cause is Cause.CACHING_OFF:
        line = f"{tokens} computed: prefix caching is off on this engine"
    elif cause is Cause.NOT_ADMITTED:
        line = f"{tokens}: not looked up yet"
    elif cause is Cause.IN_PROGRESS:
        line = f"{tokens}: looked up in the step still running; the causes are told when it ends"
    else:
        line = (
            f"{tokens}: cannot tell ({UNKNOWN_WORDS.get(segment.unknown, 'unknown') if segment.unknown else 'unknown'})"
        )
    if segment.stranded_behind is not None and cause is not Cause.CACHED:
        line += f"; these pages were still cached, but token {segment.stranded_behind + 1} missed first"
    return line


def _written(token_ids: Sequence[int], shown: Callable[[Sequence[int]], str] | None) -> str:
    """Tokens in a hover: their text, quoted (a newline as ⏎, as the token view writes it); without ``shown``, ids."""
    if shown is None:
        return str(list(token_ids))
    text = shown(token_ids).replace("\n", "⏎")
    return f"“{text}”"


def _stored(page: PageLife, whose: Whose) -> str:
    by = whose.request(page.request)
    if page.same_step:
        return f"computed in the same step by {by}"
    return f"stored by {by}" + (f" at step {page.stored_step}" if page.stored_step is not None else "")


def _ended(page: PageLife, whose: Whose) -> str:
    stored = f"stored by {whose.request(page.request)}" + (
        f" at step {page.stored_step}" if page.stored_step is not None else ""
    )
    if page.cleared:
        return f"{stored}, dropped by Clear cache at step {page.ended_step}"
    ranked = f" (the next to go of {page.evictable} cached pages)" if page.evictable else ""
    return f"{stored}, evicted at step {page.ended_step} to make room for {whose.request(page.evicted_for)}{ranked}"


def summary(explanation: Explanation, skip: Collection[Cause] = ()) -> str:
    """A badge's line: "48 cached · 13 new · 16 evicted at step 41 · 7 partial page · 1 last token" (without the
    causes in ``skip``); for a request looked up in the step still running, "causes told when its step ends"."""
    parts = []
    for cause, (words, _) in CAUSES.items():
        count = explanation.counts.get(cause, 0)
        if not count or cause is Cause.NOT_ADMITTED or cause in skip:
            continue
        if cause is Cause.IN_PROGRESS:  # the whole prompt: a count would read as a cause
            parts.append("causes told when its step ends")
            continue
        when = ""
        if cause is Cause.EVICTED:
            steps = sorted(
                {s.page.ended_step for s in explanation.segments if s.cause is cause and s.page and s.page.ended_step}
            )
            when = f" at step {', '.join(map(str, steps[:3]))}" if steps else ""
        parts.append(f"{count} {words}{when}")
    if explanation.recomputed_tokens:
        parts.append(f"{explanation.recomputed_tokens} recomputed after preemption (counted apart)")
    return " · ".join(parts)


def eviction_notes(step: int, whys: Sequence[Explanation | None], whose: Whose) -> list[str]:
    """What an engine step did that a panel of the run later paid for: an eviction in ``step`` that cost a panel
    tokens ("a page evicted here for panel 2 → panel 1 recomputes 16 tokens at step 52"), and at a panel's admission
    in ``step``, the evictions and clears that cost it ("panel 1 recomputes 16 tokens: evicted at step 41 for
    another session")."""
    notes = []
    for why in whys:
        if why is None:
            continue
        panel = whose.request(why.request).replace(" of this run", "")
        for segment in why.segments:
            page = segment.page
            if segment.cause not in (Cause.EVICTED, Cause.CLEARED) or page is None or page.ended_step is None:
                continue
            size = segment.end - segment.start
            if page.ended_step == step and why.admitted_step != step:
                how = "cleared" if page.cleared else f"evicted for {whose.request(page.evicted_for)}"
                notes.append(f"a page {how} here → {panel} recomputes {size} tokens at step {why.admitted_step}")
            elif why.admitted_step == step:
                how = "Clear cache" if page.cleared else f"evicted for {whose.request(page.evicted_for)}"
                notes.append(f"{panel} recomputes {size} tokens: {how} at step {page.ended_step}")
    return notes


def columns(explanation: Explanation | None) -> list[int | None]:
    """The request table's cause columns (``TABLE_CAUSES``), then the recomputed tokens counted apart."""
    if explanation is None:
        return [None] * (len(TABLE_CAUSES) + 1)
    return [explanation.counts.get(c, 0) for c in TABLE_CAUSES] + [explanation.recomputed_tokens]


def token_html(
    explanation: Explanation,
    prompt_ids: Sequence[int],
    shown: Callable[[Sequence[int]], str],
    whose: Whose,
    max_tokens: int,
) -> str:
    """The prompt's tokens coloured by cause, each run of one cause a span whose hover text (``title``) says why;
    a legend with the counts first. Capped at ``max_tokens`` tokens for the page's sake (the legend counts all).
    Each span carries ``data-cause`` and ``data-tokens``, which tests and scripts read."""
    legend = " ".join(
        f'<span style="background:{color};padding:0 4px;border-radius:3px">{words} {explanation.counts[cause]}</span>'
        for cause, (words, color) in CAUSES.items()
        if explanation.counts.get(cause)
    )
    spans = []
    for segment in explanation.segments:
        end = min(segment.end, max_tokens)
        if segment.start >= end:
            break
        words, color = CAUSES[segment.cause]
        text = html.escape(shown(prompt_ids[segment.start : end]).replace("\n", "⏎"), quote=False)
        title = html.escape(hover(segment, whose, shown), quote=True)
        spans.append(
            f'<span data-cause="{segment.cause.value}" data-tokens="{end - segment.start}" title="{title}" '
            f'style="background:{color};white-space:pre-wrap;border-bottom:1px solid #9ca3af">{text}</span>'
        )
    more = (
        f" <i>(first {max_tokens} of {explanation.prompt_tokens} tokens)</i>"
        if explanation.prompt_tokens > max_tokens
        else ""
    )
    note = "" if explanation.namespaces_known else f"<br><small>{NO_SALTS}</small>"
    return (
        f'<div class="causes"><div>{legend}</div><div style="line-height:1.7">{"".join(spans)}{more}</div>{note}</div>'
    )


# The five reasons a prompt token is computed on an engine of the lesson, as the lesson's end says them (the other
# causes are a visitor's or an operator's choices: a Clear cache, another namespace, caching off, another replica).
COMPUTED_BECAUSE: dict[Cause, str] = {
    Cause.NEW: "no page with these tokens after this prefix was ever stored: the first prompt to say it computes it",
    Cause.EVICTED: "its page was stored, then evicted to make room for another request before this one looked",
    Cause.DIVERGED: "a cached page after the same prefix differs from this one: a page is reused only whole, so from "
    "the first different token on, its tokens are computed",
    Cause.PARTIAL_PAGE: "after the prompt's last full page: only full pages are cached",
    Cause.LAST_TOKEN: "the last prompt token is always computed, for the logits of the first output token",
}


@dataclass(frozen=True)
class Tally:
    """A visitor's runs, their prompt tokens counted by cause (each prompt's ``Explanation.counts``, summed)."""

    runs: int = 0
    prompts: int = 0  # whose causes were read
    unexplained: int = 0  # prompts whose causes their engine could not say
    counts: Mapping[Cause, int] = field(default_factory=dict)  # only the causes that occurred
    recomputed: int = 0  # computed again after preemptions, counted apart (as the stats line counts re-admissions)

    def add(self, run: Sequence[Explanation | None]) -> Tally:
        """This tally and one more run (its prompts' explanations, None where there is none)."""
        known = [why for why in run if why is not None]
        counts = dict(self.counts)
        for why in known:
            for cause, count in why.counts.items():
                if count:
                    counts[cause] = counts.get(cause, 0) + count
        recomputed = self.recomputed + sum(why.recomputed_tokens or 0 for why in known)
        return Tally(
            self.runs + 1, self.prompts + len(known), self.unexplained + len(run) - len(known), counts, recomputed
        )


def what_you_saw(seen: Tally) -> str:
    """The lesson's end: the visitor's prompt tokens by cause (cached and the five reasons always, the other causes
    where they occurred), then the five reasons."""
    reasons = "\n".join(
        f"{i}. **{CAUSES[cause][0]}**: {why}." for i, (cause, why) in enumerate(COMPUTED_BECAUSE.items(), start=1)
    )
    reasons = f"**The five reasons a prompt token is computed**\n\n{reasons}"
    if not seen.runs:
        return (
            "You have run no batch to its end since you opened the page (or restarted the lesson): press **Restart "
            f"lesson**, then Run at each step.\n\n{reasons}"
        )
    total = sum(seen.counts.values())
    runs = f"{seen.runs} run{'s' * (seen.runs > 1)}"
    lines = [
        f"Every prompt token of your {runs} (Run and Compare) since you opened the page (or restarted the lesson), a "
        f"stopped run not counted: {seen.prompts} prompts, **{total:,}** prompt tokens, each counted once, as its "
        "prompt was first looked up.\n",
        "| why | tokens | share |",
        "|---|---:|---:|",
    ]
    for cause, (words, _) in CAUSES.items():
        count = seen.counts.get(cause, 0)
        if count or cause is Cause.CACHED or cause in COMPUTED_BECAUSE:
            lines.append(f"| {words} | {count:,} | {count / total:.0%} |" if total else f"| {words} | 0 | – |")
    notes = []
    if seen.recomputed:
        notes.append(f"{seen.recomputed:,} more were computed again after preemptions (counted apart).")
    if seen.unexplained:
        notes.append(f"{seen.unexplained} prompt(s) not counted: their engine could not say why (a server away).")
    return "\n".join(lines) + ("\n\n" + " ".join(notes) if notes else "") + f"\n\n{reasons}"
