"""How a visitor reads why each prompt token was cached or computed (astrai/playground/views/causes.py): the coloured
runs of tokens with their hover text, the badge's line and the table's columns."""

from __future__ import annotations

import re
from html import escape as html_escape

from astrai.explain import Cause, Divergence, Explanation, PageLife, Segment
from astrai.observation import RequestInfo
from astrai.playground.views import causes
from astrai.playground.views import text as views

WHOSE = causes.Whose(panels={10: 0, 11: 1}, own={10, 11, 5})


def life(request: int | None, **changes: object) -> PageLife:
    fields = dict(
        request=request, replica=0, stored_step=3, same_step=False, ended_step=None, cleared=False,
        evicted_for=None, evictable=None,
    )  # fmt: skip
    return PageLife(**(fields | changes))  # type: ignore[arg-type]


def explanation(segments: list[Segment], prompt_tokens: int, recomputed: int | None = 0) -> Explanation:
    counts = dict.fromkeys(Cause, 0)
    for s in segments:
        counts[s.cause] += s.end - s.start
    return Explanation(
        request=11, prompt_tokens=prompt_tokens, cached_tokens=counts[Cause.CACHED], replica=0, admitted_step=7,
        segments=tuple(segments), counts=counts, recomputed_tokens=recomputed, readmissions=0,
        readmitted_cached_tokens=0, namespaces_known=True,
    )  # fmt: skip


SEGMENTS = [
    Segment(0, 8, Cause.CACHED, page=life(10)),
    Segment(8, 12, Cause.EVICTED, page=life(99, ended_step=41, evicted_for=10, evictable=12)),
    Segment(12, 16, Cause.DIVERGED, divergence=Divergence(1, (1, 2, 3, 4), (1, 9, 9, 9), life(5))),
    Segment(16, 19, Cause.PARTIAL_PAGE),
    Segment(19, 20, Cause.LAST_TOKEN),
]


def test_the_badge_line_names_each_cause_and_when_an_eviction_happened():
    why = explanation(SEGMENTS, 20, recomputed=6)
    assert causes.summary(why) == (
        "8 cached · 4 evicted at step 41 · 4 diverged · 3 partial page · 1 last token · 6 recomputed after preemption "
        "(counted apart)"
    )
    assert causes.summary(why, skip=(Cause.CACHED,)).startswith("4 evicted")


def test_every_run_of_tokens_is_coloured_by_its_cause_and_says_why():
    why = explanation(SEGMENTS, 20)
    shown = views.readable(lambda ids: "".join("\n" if t == 7 else f"<{t}>" for t in ids), {0})
    html = causes.token_html(why, [0, *range(1, 7), 7, *range(8, 20)], shown, WHOSE, max_tokens=300)
    runs = re.findall(r'data-cause="(\w+)" data-tokens="(\d+)" title="([^"]*)"', html)
    assert [(c, int(n)) for c, n, _ in runs] == [
        ("cached", 8),
        ("evicted", 4),
        ("diverged", 4),
        ("partial_page", 3),
        ("last_token", 1),
    ]
    hovers = [t for _, _, t in runs]
    assert "stored by panel 1 of this run" in hovers[0]
    assert "stored by another session at step 3, evicted at step 41 to make room for panel 1 of this run" in hovers[1]
    assert "the next to go of 12 cached pages" in hovers[1]
    assert "differs from its token 2 on" in hovers[2] and "only full pages are cached" in hovers[3]
    # issue 43: the hover showed raw token ids ("yours cached: [9, 9, 9]"); it shows their text, as the tokens read
    assert "(yours cached: “&lt;9&gt;&lt;9&gt;&lt;9&gt;”; this prompt: “&lt;2&gt;&lt;3&gt;&lt;4&gt;”)" in hovers[2]
    assert "⏎" in html and html_escape(views.SPECIAL_TOKEN_TEXT) in html, "a newline and a special token are drawn"


def test_the_cap_counts_the_tokens_shown_and_the_legend_counts_all():
    why = explanation([Segment(0, 400, Cause.NEW), Segment(400, 401, Cause.LAST_TOKEN)], 401)
    html = causes.token_html(why, list(range(401)), lambda ids: "x" * len(ids), WHOSE, max_tokens=300)
    assert sum(int(n) for n in re.findall(r'data-tokens="(\d+)"', html)) == 300 and "new 400" in html
    assert "first 300 of 401 tokens" in html


def test_the_table_has_a_column_per_cause_that_adds_up_to_the_prompt():
    why = explanation(SEGMENTS, 20)
    row = views.request_rows([_info()], ["prompt"], True, [why])[0]
    first = views.TABLE_COLUMNS.index("cached")
    by_cause = row[first : first + len(causes.TABLE_CAUSES)]
    assert sum(by_cause) == 20 and row[first] == 8
    assert views.TABLE_COLUMNS[first + len(causes.TABLE_CAUSES)] == "recomputed (apart)"


def _info():
    from astrai.observation import RequestInfo

    return RequestInfo(11, "finished", 20, 8, 3, 0, tuple(range(20)), (1, 2, 3), 0.1, 10.0, None, 0)


def test_a_badge_counts_the_tokens_loaded_from_the_second_tier_as_part_of_the_cached_ones():
    """The engine's cached count includes the tier's loads: the badge says how many of them, never beside them."""
    why = explanation(
        [
            Segment(0, 8, Cause.CACHED, page=life(10)),
            Segment(8, 24, Cause.LOADED, page=life(5)),
            Segment(24, 30, Cause.NEW),
            Segment(30, 31, Cause.LAST_TOKEN),
        ],
        31,
    )
    info = RequestInfo(
        id=11, status="finished", prompt_tokens=31, cached_tokens=24, generated_tokens=4, preemptions=0,
        prompt_ids=(), output_ids=(), ttft=None, tokens_per_s=None, error=None,
    )  # fmt: skip
    assert views.badge(info, why=why) == (
        "**31** prompt tokens · **24** cached (77%), 16 of them loaded from the second tier · 6 new · 1 last token"
    )
