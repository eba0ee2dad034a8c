"""The hit-rate ladder's view, "Why is my hit rate low?": a ``Ladder`` (``astrai.lab.ladder``) as a chart and the
caption that says what it counts. Pure: a ladder in, a figure and words out.

Every number is the ladder's own: a rung's bar is its ``share`` of the prompt tokens, a gap's segment its ``share``
and its label its ``tokens``, and hovering a gap lists its ``causes``, which sum to it (the lab checks that). The
sources a visitor can ask for are named here, once, for the layout, the callbacks and the tests.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from astrai.lab.ladder import Gap, Ladder, tier_rung
from astrai.lab.replay import CAPACITY_MEANING
from astrai.playground.views.sizing import TRACE_NAMES

LAST_RUN = "your last run"
ENGINE = "your engine since it started"
TRACES = Path(__file__).resolve().parents[3] / "assets" / "traces"
TRACE_FILES = {words: TRACES / file for file, words in TRACE_NAMES.items()}  # a shipped trace's choice -> its file
SOURCES = (LAST_RUN, ENGINE, *TRACE_FILES)
RUNG_COLOUR, LOSS_COLOUR, GAIN_COLOUR = "#2563eb", "#f59e0b", "#16a34a"
WAITING = (
    "Pick what to count and press **Why is my hit rate low?**: a ladder from every prompt token down to the hits "
    "served, each gap between two rungs split into its causes."
)


def causes_text(gap: Gap) -> str:
    """A gap's hover: its causes, one a line, in tokens (they sum to the gap's tokens)."""
    lines = [f"{cause.replace('_', ' ')}: {tokens:,} tokens" for cause, tokens in gap.causes]
    return f"<b>{gap.name.replace('_', ' ')}</b>: {gap.tokens:,} tokens ({gap.share:.1%})<br>" + "<br>".join(lines)


def ladder_chart(ladder: Ladder) -> go.Figure:
    """One horizontal bar per rung, top to bottom, its length the rung's share of the prompt tokens; beside each
    rung, the gap from the rung above: a segment from the rung's share to the one above's (amber where tokens were
    lost, green where this rung served more: ``delivered`` and a fleet's replicas can), labelled with its name and
    tokens, its hover listing its causes."""
    names = [r.name for r in ladder.rungs]
    gaps = {g.below: g for g in ladder.gaps}
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            y=names,
            x=[100 * r.share for r in ladder.rungs],
            orientation="h",
            name="rung",
            marker_color=RUNG_COLOUR,
            text=[f"{r.share:.1%}" for r in ladder.rungs],
            textposition="inside",
            customdata=[[f"{r.tokens:,}"] for r in ladder.rungs],
            hovertemplate="<b>%{y}</b>: %{customdata[0]} prompt tokens (%{x:.1f}%)<extra></extra>",
        )
    )
    shown = [(rung, gaps[rung.name]) for rung in ladder.rungs if rung.name in gaps]
    fig.add_trace(
        go.Bar(
            y=[rung.name for rung, _ in shown],
            x=[100 * abs(gap.share) for _, gap in shown],
            base=[100 * min(rung.share, rung.share + gap.share) for rung, gap in shown],
            orientation="h",
            name="gap from the rung above",
            marker=dict(
                color=[LOSS_COLOUR if gap.tokens >= 0 else GAIN_COLOUR for _, gap in shown],
                pattern=dict(shape="/"),
            ),
            text=[f"{gap.name.replace('_', ' ')} {gap.tokens:,}" for _, gap in shown],
            textposition="outside",
            cliponaxis=False,
            customdata=[[causes_text(gap)] for _, gap in shown],
            hovertemplate="%{customdata[0]}<extra></extra>",
        )
    )
    top = max(max(r.share for r in ladder.rungs), 1.0)
    fig.update_layout(
        barmode="overlay",
        title=dict(text=f"Why is my hit rate low? {ladder.trace}", font=dict(size=13)),
        height=80 + 42 * len(names),
        margin=dict(l=10, r=10, t=32, b=36),
        paper_bgcolor="white",
        plot_bgcolor="white",
        showlegend=False,
        uirevision=ladder.trace,
    )
    fig.update_yaxes(categoryorder="array", categoryarray=names[::-1], automargin=True)
    fig.update_xaxes(range=[0, 100 * top * 1.35], title_text="% of prompt tokens", gridcolor="#e5e7eb")
    return fig


def caption(ladder: Ladder, source: str, notes: tuple[str, ...] = ()) -> str:
    """What the ladder counts, exactly: the source, its requests, the page size, the capacity and what a capacity
    means under the replay's rules, the policy, a second tier where the ladder has one, and the sources' own caveats
    (``notes``)."""
    fleet = f" on {ladder.replicas} replicas" if ladder.replicas > 1 else ""
    each = " each" if ladder.replicas > 1 else ""
    prompt = ladder.rungs[0].tokens
    parts = [
        f"**{source}**: {ladder.requests:,} requests{fleet}, {prompt:,} prompt tokens, pages of "
        f"{ladder.block_size} tokens; replayed one at a time through the engine's page pool at "
        f"**{ladder.capacity:,} pages**{each} ({CAPACITY_MEANING[ladder.semantics]}; replay rules "
        f"'{ladder.semantics}'), policy **{ladder.policy}**{_tier(ladder)}. Each bar is a rung's prompt tokens as "
        "a share of all of them; beside it, the gap from the rung above (hover it for its causes, in tokens)."
    ]
    return " ".join([*parts, *notes])


def _tier(ladder: Ladder) -> str:
    if ladder.tier2 is None:
        return ""
    return (
        f", behind it a second tier of **{ladder.tier2:,} blocks** (LRU) written {ladder.write}; "
        f"'{tier_rung(ladder.policy)}' counts both tiers' hits"
    )
