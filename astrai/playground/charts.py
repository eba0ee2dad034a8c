"""Plotly figures of the cache's internals: occupancy, LRU length, hit rate and the page map."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

import plotly.graph_objects as go

from astrai.playground.views import PageView, Series

PANEL_COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#db2777", "#0891b2"]
FREE_COLOR = "#e5e7eb"
OTHER_COLOR = "#6b7280"
EVICTED_COLOR = "#ef4444"
STATE_COLORS = {"in use": "#f59e0b", "cached (evictable)": "#60a5fa", "free": "#d1d5db"}


def _layout(fig: go.Figure, title: str, y_title: str, height: int = 240) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)),
        height=height,
        margin=dict(l=40, r=10, t=32, b=30),
        legend=dict(orientation="h", y=-0.25, font=dict(size=10)),
        yaxis_title=y_title,
        xaxis_title="seconds ago",
        template="plotly_white",
        uirevision="keep",
    )
    return fig


def occupancy_chart(data: Series) -> go.Figure:
    fig = go.Figure()
    for name, values in (("in use", data.used), ("cached (evictable)", data.cached), ("free", data.free)):
        fig.add_trace(
            go.Scatter(
                x=data.ages,
                y=values,
                name=name,
                stackgroup="pages",
                mode="lines",
                line=dict(width=0.5, color=STATE_COLORS[name], shape="hv"),
            )
        )
    return _layout(fig, "Page-pool occupancy (one point per engine step)", "pages")


def lru_chart(data: Series) -> go.Figure:
    fig = go.Figure(
        [
            go.Scatter(
                x=data.ages,
                y=data.cached,
                mode="lines",
                name="LRU length",
                line=dict(color=STATE_COLORS["cached (evictable)"], width=2, shape="hv"),
            ),
            go.Scatter(
                x=data.ages,
                y=data.evictions,
                mode="lines",
                name="evictions (since left edge)",
                line=dict(color=EVICTED_COLOR, dash="dot", shape="hv"),
            ),
        ]
    )
    return _layout(fig, "LRU length (cached pages)", "pages")


def hit_rate_chart(data: Series) -> go.Figure:
    fig = go.Figure(
        [
            go.Scatter(
                x=data.ages,
                y=[None if r is None else 100 * r for r in data.hit_rate],
                name="since start",
                mode="lines",
                line=dict(color="#16a34a", width=2, shape="hv"),
            ),
            go.Scatter(
                x=data.step_hit_ages,
                y=[100 * r for r in data.step_hit_rate],
                name="requests admitted in a step",
                mode="markers",
                marker=dict(color="#84cc16", size=7),
            ),
        ]
    )
    fig.update_yaxes(range=[0, 105])
    return _layout(fig, "Prefix hit rate (token-weighted, first admissions)", "% of prompt tokens")


CACHED_SHADES = ["#dbeafe", "#bfdbfe", "#93c5fd", "#60a5fa", "#3b82f6", "#2563eb", "#1d4ed8", "#1e3a8a"]
PALETTE = [FREE_COLOR, OTHER_COLOR, EVICTED_COLOR, *PANEL_COLORS, *CACHED_SHADES]
FIRST_PANEL, FIRST_SHADE = 3, 3 + len(PANEL_COLORS)


def _discrete_colorscale(colors: list[str]) -> list[list]:
    """A colorscale where integer z == i paints exactly colors[i]."""
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / len(colors), color], [(i + 1) / len(colors), color]]
    return scale


def _describe(p: PageView, panel_label: Callable[[int], str], cached_total: int) -> tuple[int, str]:
    """The palette index and hover text of one page."""
    if p.just_evicted:
        color, state = 2, "just evicted" + (" (already reused)" if p.state == "in_use" else "")
    elif p.state == "in_use":
        color = FIRST_PANEL + p.panels[0] % len(PANEL_COLORS) if p.panels else 1
        state = "in use" + (" (shared)" if p.ref_count > 1 else "")
    elif p.state == "cached":
        shade = (len(CACHED_SHADES) - 1) * (p.lru_rank or 0) // max(cached_total - 1, 1)
        color, state = FIRST_SHADE + shade, f"cached, LRU rank {p.lru_rank} (0 = evicted next)"
    else:
        color, state = 0, "free"
    owners = [panel_label(i) for i in p.panels] + ["other session"] * p.other_users
    lines = [f"<b>page {p.page}</b>: {state}", f"ref count {p.ref_count}"]
    if owners:
        lines.append("used by " + ", ".join(owners))
    if p.chain_pos >= 0:
        lines.append(f"chain position {p.chain_pos}")
    if p.text is not None:
        lines.append("tokens: " + html.escape(p.text.replace("\n", "⏎"))[:80])
    elif p.state != "free":
        lines.append("tokens: (hidden: not yours)")
    return color, "<br>".join(lines)


def page_map(pages: Sequence[PageView], panel_label: Callable[[int], str]) -> go.Figure:
    """Every page as a cell; shared in-use pages carry an x."""
    n = len(pages)
    cols = max(8, math.ceil(math.sqrt(n * 3)))
    rows = math.ceil(n / cols)
    z = [[None] * cols for _ in range(rows)]
    hover = [[""] * cols for _ in range(rows)]
    cached_total = sum(p.state == "cached" for p in pages)
    shared_x, shared_y = [], []
    for p in pages:
        r, c = divmod(p.page, cols)
        z[r][c], hover[r][c] = _describe(p, panel_label, cached_total)
        if p.state == "in_use" and p.ref_count > 1:
            shared_x.append(c)
            shared_y.append(r)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            text=hover,
            hoverinfo="text",
            zmin=-0.5,
            zmax=len(PALETTE) - 0.5,
            xgap=2,
            ygap=2,
            colorscale=_discrete_colorscale(PALETTE),
            showscale=False,
        )
    )
    fig.add_trace(
        go.Scatter(
            x=shared_x,
            y=shared_y,
            mode="markers",
            hoverinfo="skip",
            marker=dict(symbol="x-thin", size=8, line=dict(width=2, color="white")),
        )
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x")
    fig.update_layout(
        height=280,
        margin=dict(l=5, r=5, t=32, b=5),
        template="plotly_white",
        showlegend=False,
        title=dict(text=f"Page map ({n} pages; x = shared)", font=dict(size=13)),
        uirevision="keep",
    )
    return fig
