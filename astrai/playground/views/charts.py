"""Plotly figures of the cache's internals: occupancy, LRU length, hit rate and the page map."""

from __future__ import annotations

import html
import importlib
import math
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.basedatatypes import BaseTraceType
from plotly.subplots import make_subplots

from astrai.playground.views.pages import PageView
from astrai.playground.views.series import Series
from astrai.playground.views.text import RunSummary
from astrai.playground.views.tree import ROOT, Tree

PANEL_COLORS = ["#2563eb", "#16a34a", "#d97706", "#9333ea", "#db2777", "#0891b2"]
FREE_COLOR = "#e5e7eb"
OTHER_COLOR = "#6b7280"
EVICTED_COLOR = "#ef4444"
# A white background set directly: a named template ("plotly_white") is deep-copied into every figure, which cost
# ~40 ms a figure, most of a refresh.
GRID = dict(gridcolor="#e5e7eb", zerolinecolor="#d1d5db")
PLAIN = dict(paper_bgcolor="white", plot_bgcolor="white", font=dict(color="#374151"))
STATE_COLORS = {"in use": "#f59e0b", "cached (evictable)": "#60a5fa"}
# the plotly packages whose classes the views' figures use (layout properties, and the trace types of go.Scatter,
# go.Bar, go.Heatmap and go.Icicle with their properties)
PLOTLY_PACKAGES = ("layout", "scatter", "bar", "heatmap", "icicle")
TIER_LINE = "second tier: pages held (right axis)"
TIER_COLOR = "#84cc16"  # the lime of the tokens loaded from it (views/causes.py), darker to read as a line


def _layout(fig: go.Figure, title: str, y_title: str, data: Series, height: int = 230) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)),
        height=height,
        margin=dict(l=40, r=10, t=32, b=30),
        legend=dict(orientation="h", y=-0.3, font=dict(size=10)),
        yaxis_title=y_title,
        xaxis_title=data.x_title,
        **PLAIN,
        uirevision=data.x_title,
    )
    fig.update_xaxes(**GRID)
    fig.update_yaxes(**GRID)
    if data.marker is not None:
        fig.add_vline(x=data.marker, line=dict(color="#111827", width=1.5, dash="dash"))
    return fig


def occupancy_chart(data: Series) -> go.Figure:
    """Pages in use and cached, stacked; the y axis zooms to the busy range (the free rest is said in the title),
    so a few dozen pages stay visible in a pool of thousands. An engine's second tier, its pages held, is a line on
    an axis of its own: a tier is many times the pool, and on the pool's axis it would flatten it."""
    fig = go.Figure() if data.tier is None else make_subplots(specs=[[{"secondary_y": True}]])
    for name, values in (("in use", data.used), ("cached (evictable)", data.cached)):
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
    pool = (data.used[-1] or 0) + (data.cached[-1] or 0) + (data.free[-1] or 0) if data.used else 0
    busiest = max(((u or 0) + (c or 0) for u, c in zip(data.used, data.cached, strict=True)), default=0)
    if data.tier is not None:
        tier = go.Scatter(
            x=data.ages, y=data.tier, name=TIER_LINE, mode="lines", line=dict(color=TIER_COLOR, width=2, shape="hv")
        )
        fig.add_trace(tier, secondary_y=True)
        fig.update_yaxes(rangemode="tozero", showgrid=False, secondary_y=True)
    fig.update_yaxes(range=[0, max(8, busiest * 1.15)], selector=dict(overlaying=None))  # the pool's axis alone
    if data.used and data.used[-1] is None:
        title = "Pages in use: n/a (the server does not report its pool's usage)"
    elif data.used and data.cached[-1] is None:
        title = "Pages in use (cached: n/a, not reported without KV events)"
    elif data.used and data.free[-1] is None:
        title = "Pages in use and cached (pool size n/a)"
    else:
        title = f"Pages in use and cached (pool of {pool}, one point per engine step)"
    return _layout(fig, title, "pages", data)


def lru_chart(data: Series) -> go.Figure:
    """The LRU's length in pages, and the evictions counted from the chart's left edge on an axis of their own:
    on the pages axis, 101 evictions stood far above a 40-page pool, as if the LRU had held them."""
    queue = "LRU" if data.eviction in (None, "lru") else f"{data.eviction.upper()} queue"
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Scatter(
            x=data.ages,
            y=data.cached,
            mode="lines",
            name=f"{queue} length (pages)",
            line=dict(color=STATE_COLORS["cached (evictable)"], width=2, shape="hv"),
        ),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(
            x=data.ages,
            y=data.evictions,
            mode="lines",
            name="evictions since the left edge (right axis)",
            line=dict(color=EVICTED_COLOR, dash="dot", shape="hv"),
        ),
        secondary_y=True,
    )
    fig.update_yaxes(title_text="evictions", secondary_y=True, rangemode="tozero", showgrid=False)
    return _layout(fig, f"{queue} length (cached pages) and evictions", "pages", data)


def hit_rate_chart(data: Series) -> go.Figure:
    fig = go.Figure(
        [
            go.Scatter(
                x=data.ages,
                y=[None if r is None else 100 * r for r in data.hit_rate],
                name=data.hit_rate_scope,
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
    title = "Prefix hit rate (token-weighted, first admissions)"
    if not data.prefix_caching:
        title = "Prefix hit rate: none, prefix caching is off on this engine (nothing is looked up)"
    return _layout(fig, title, "% of prompt tokens", data)


MIN_ROWS = 4
# At most this many columns: the default pool's 2,048 pages made 79, cells of 5 px on a laptop, and step 1's shared
# pages were marks too small to see. Only the rows up to the last busy page are drawn, so a pool of thousands of
# pages still fits (its cells shrink only as a class fills hundreds of rows).
MAX_COLS = 32
PAGE_MAP_HEIGHT = 250
CACHED_SHADES = ["#dbeafe", "#bfdbfe", "#93c5fd", "#60a5fa", "#3b82f6", "#2563eb", "#1d4ed8", "#1e3a8a"]
PALETTE = [FREE_COLOR, OTHER_COLOR, EVICTED_COLOR, *PANEL_COLORS, *CACHED_SHADES]
FIRST_PANEL, FIRST_SHADE = 3, 3 + len(PANEL_COLORS)


def _discrete_colorscale(colors: list[str]) -> list[list]:
    """A colorscale where integer z == i paints exactly colors[i]."""
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / len(colors), color], [(i + 1) / len(colors), color]]
    return scale


NOT_REPORTED_ORDER = "the backend does not report it (vLLM: its LRU order)"


def _describe(
    p: PageView, panel_label: Callable[[int], str], cached_total: int, no_rank: str = NOT_REPORTED_ORDER
) -> tuple[int, str]:
    """The palette index and hover text of one page."""
    if p.just_evicted:
        color, state = 2, "just evicted" + (" (already reused)" if p.state == "in_use" else "")
    elif p.state == "in_use":
        color = FIRST_PANEL + p.panels[0] % len(PANEL_COLORS) if p.panels else 1
        state = "in use" + (" (shared)" if _shared(p) else "")
    elif p.state == "cached" and p.lru_rank is None:
        color, state = FIRST_SHADE + len(CACHED_SHADES) // 2, f"cached (eviction order n/a: {no_rank})"
    elif p.state == "cached":
        shade = (len(CACHED_SHADES) - 1) * (p.lru_rank or 0) // max(cached_total - 1, 1)
        color, state = FIRST_SHADE + shade, f"cached, eviction rank {p.lru_rank} (0 = evicted next)"
    else:
        color, state = 0, "free"
    owners = [panel_label(i) for i in p.panels] + ["other session"] * p.other_users
    refs = "ref count n/a (vLLM does not report it)" if p.ref_count is None else f"ref count {p.ref_count}"
    lines = [f"<b>page {p.page}</b>: {state}", refs]
    if owners:
        lines.append("used by " + ", ".join(owners))
    if p.chain_pos >= 0:
        lines.append(f"chain position {p.chain_pos}")
    if p.hits:
        lines.append(f"prefix hits served: {p.hits}")
    if p.text is not None:
        lines.append("tokens: " + html.escape(p.text.replace("\n", "⏎")[:80], quote=False))
    elif p.state != "free":
        lines.append("tokens: (hidden: not yours)")
    return color, "<br>".join(lines)


def _shared(p: PageView) -> bool:
    """Shared by several requests: by its ref count, or (unknown ref count) by the requests known to use it."""
    return p.ref_count > 1 if p.ref_count is not None else len(p.panels) + p.other_users > 1


@dataclass(frozen=True)
class PageGrid:
    """A pool's pages laid out as cells: the palette index and hover text of each, and where the x marks go."""

    z: list[list[int | None]]
    hover: list[list[str]]
    shared: tuple[list[int], list[int]]  # columns and rows of shared in-use pages
    rows: int
    cols: int
    shown: str  # which pages the grid holds, in words


def page_grid(
    pages: Sequence[PageView],
    panel_label: Callable[[int], str],
    cols: int | None = None,
    no_rank: str = NOT_REPORTED_ORDER,
) -> PageGrid:
    """Rows past the last non-free page are left out (a pool hands out its lowest free page first, so the used
    range is packed at the top)."""
    n = len(pages)
    cols = cols or min(MAX_COLS, max(8, math.ceil(math.sqrt(n * 3))))
    busy = [p.page for p in pages if p.state != "free" or p.just_evicted]
    rows = max(1, min(math.ceil(n / cols), max(MIN_ROWS, (max(busy, default=0) // cols) + 2)))
    pages = [p for p in pages if p.page < rows * cols]
    shown = f"pages 0–{min(rows * cols, n) - 1} of {n}; the rest are free" if rows * cols < n else f"{n} pages"
    z: list[list[int | None]] = [[None] * cols for _ in range(rows)]
    hover = [[""] * cols for _ in range(rows)]
    cached_total = sum(p.state == "cached" for p in pages)
    shared_x, shared_y = [], []
    for p in pages:
        r, c = divmod(p.page, cols)
        z[r][c], hover[r][c] = _describe(p, panel_label, cached_total, no_rank)
        if p.state == "in_use" and _shared(p):
            shared_x.append(c)
            shared_y.append(r)
    return PageGrid(z, hover, (shared_x, shared_y), rows, cols, shown)


def page_cells(grid: PageGrid) -> list[BaseTraceType]:
    """The grid's traces: the cells, then the x marks on shared pages."""
    return [
        go.Heatmap(
            z=grid.z,
            text=grid.hover,
            hoverinfo="text",
            zmin=-0.5,
            zmax=len(PALETTE) - 0.5,
            xgap=2,
            ygap=2,
            colorscale=_discrete_colorscale(PALETTE),
            showscale=False,
        ),
        go.Scatter(
            x=grid.shared[0],
            y=grid.shared[1],
            mode="markers",
            hoverinfo="skip",
            marker=dict(symbol="x-thin", size=8, line=dict(width=2, color="white")),
        ),
    ]


def page_map(
    pages: Sequence[PageView],
    panel_label: Callable[[int], str],
    title: str = "Page map",
    no_rank: str = NOT_REPORTED_ORDER,
) -> go.Figure:
    """Every page as a cell; shared in-use pages carry an x."""
    grid = page_grid(pages, panel_label, no_rank=no_rank)
    fig = go.Figure(page_cells(grid))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x")
    fig.update_layout(
        height=min(PAGE_MAP_HEIGHT, 60 + grid.rows * max(12, 420 // grid.cols)),
        margin=dict(l=5, r=5, t=32, b=5),
        **PLAIN,
        showlegend=False,
        title=dict(text=f"{title} ({grid.shown}; x = shared)", font=dict(size=13)),
        uirevision="keep",
    )
    return fig


def prefix_tree(tree: Tree, panel_label: Callable[[int], str], height: int = 300) -> go.Figure:
    """The cached pages as an icicle, root on the left: it branches where prompts diverge."""
    ranked = max((n.lru_rank or 0 for n in tree.nodes), default=0)
    ids, parents, labels, colors, hovers = [ROOT], [""], ["prefix cache"], ["#f3f4f6"], ["the roots of every chain"]
    for node in tree.nodes:
        if node.kind == "others":
            color, state = FREE_COLOR, "not your last run's: pages of earlier runs and other sessions"
        elif node.kind == "evicted":
            color, state = EVICTED_COLOR, "just evicted"
        elif node.kind == "in_use":
            in_use_color = PANEL_COLORS[node.panel % len(PANEL_COLORS)] if node.panel is not None else OTHER_COLOR
            color, state = in_use_color, "in use" + (f" by {panel_label(node.panel)}" if node.panel is not None else "")
        else:
            shade = (len(CACHED_SHADES) - 1) * (node.lru_rank or 0) // max(ranked, 1)
            color, state = CACHED_SHADES[shade], f"cached, eviction rank {node.lru_rank} (0 = evicted next)"
            if node.lru_rank is None:
                state = "cached (eviction order n/a)"
        ids.append(node.id)
        parents.append(node.parent)
        labels.append(html.escape(node.label, quote=False))
        colors.append(color)
        pages = ", ".join(map(str, node.pages[:8])) + (" …" if len(node.pages) > 8 else "")
        served = "n/a (not reported)" if node.hits is None else node.hits
        hovers.append(f"{state}<br>page{'s' if len(node.pages) > 1 else ''} {pages}<br>hits served: {served}")
    fig = go.Figure(
        go.Icicle(
            ids=ids,
            parents=parents,
            labels=labels,
            marker=dict(colors=colors),
            hovertext=hovers,
            hoverinfo="label+text",
            tiling=dict(orientation="h"),
            root=dict(color="#f3f4f6"),
            maxdepth=-1,
        )
    )
    title = f"Prefix tree: {tree.pages} pages ({tree.in_use} in use, {tree.cached} cached)"
    if tree.focused is not None:
        title += f"; {tree.focused} of them your last run's, {tree.others} gathered as others"
    if tree.evicted:
        title += f"; {tree.evicted} more just evicted (red)"
    fig.update_layout(
        height=height,
        margin=dict(l=5, r=5, t=32, b=5),
        title=dict(text=title, font=dict(size=13)),
        uirevision="tree",
    )
    return fig


def savings_caption(on: RunSummary | None, off: RunSummary | None) -> str:
    """The savings chart's title: its bars' own numbers in words (tests/test_lesson_truth.py reads both back)."""
    if on is None:
        return "What caching saved: run a batch, then Compare"
    if off is None:
        return f"Prefill tokens computed with caching: {on.computed_tokens:,} (Compare for the other half)"
    fewer = off.computed_tokens - on.computed_tokens
    saved = f"{fewer:,} fewer with caching" if fewer >= 0 else f"{-fewer:,} more with caching"
    return f"Prefill tokens computed: {on.computed_tokens:,} with caching, {off.computed_tokens:,} without ({saved})"


def import_plotly_classes() -> None:
    """Import, now and on this thread, every plotly class the views' figures may use (about 390 modules, 0.2 s, 25 MiB).

    plotly imports a property's class on its first use, and two threads that do so at once can fail: in CI, the
    first lesson step a class of 30 loaded in the same second gave one student ``ModuleNotFoundError: No module named
    'plotly.graph_objs.layout._title'``. app.py calls it before any thread starts; build_demo again, for other
    callers (a no-op by then)."""
    for name in PLOTLY_PACKAGES:
        package = importlib.import_module(f"plotly.graph_objs.{name}")
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            importlib.import_module(module.name)
    # and what a first figure imports (templates, validators, colour scales)
    go.Figure(go.Heatmap(z=[[0]], colorscale="Blues"), layout=PLAIN)


def savings(on: RunSummary | None, off: RunSummary | None) -> go.Figure:
    """Caching on against off: the prefill tokens each half computed (recomputation after preemptions included),
    exact counts, each bar labelled with its number. Times are left out: the halves run one after the other (on two
    engines), so their times to first token differ by what else the machine did meanwhile, and on the embedded model
    a prompt's prefill is a small part of a step: caching on read up to 8× slower in 6 of 7 presses (issue 43)."""
    fig = go.Figure()
    for name, run, color in (("caching on", on, "#16a34a"), ("caching off", off, "#9ca3af")):
        if run is None:
            continue
        fig.add_trace(
            go.Bar(
                x=[name],
                y=[run.computed_tokens],
                name=name,
                marker_color=color,
                text=[f"{run.computed_tokens:,}"],
                textposition="auto",
                hovertemplate=f"{name}: %{{y:,}} prefill tokens computed for {run.prompt_tokens:,} prompt tokens"
                "<extra></extra>",
            )
        )
    fig.update_yaxes(title_text="prefill tokens computed", rangemode="tozero", **GRID)
    fig.update_layout(
        height=230,
        margin=dict(l=45, r=10, t=40, b=20),
        **PLAIN,
        showlegend=False,
        title=dict(text=savings_caption(on, off), font=dict(size=13)),
    )
    return fig
