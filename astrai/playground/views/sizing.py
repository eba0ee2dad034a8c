"""The cache-sizing lab's view: how much of a workload's prompt tokens a prefix cache of a given size serves, under
each eviction policy, beside the optimum (Belady's MIN, which knows the future) and a cache that never evicts.
Pure: curves in (``astrai.lab``'s replay results, or the shipped ``assets/traces/curves.json``), figures and words
out.

Every number here is a replay's (``python -m astrai.lab``): requests one at a time through the engine's own page
pool and cache manager, a hit the longest cached run of leading blocks, the last prompt token always computed. A
capacity means what the curves' ``semantics`` says (``astrai.lab.replay``): the shipped curves and a visitor's own
are an engine's pool of that many pages (``"engine"``), which is what the lesson compares with a pool's size.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go

from astrai.lab.replay import CAPACITY_MEANING, Semantics
from astrai.lab.trace import Trace

SHIPPED = Path(__file__).resolve().parents[3] / "assets" / "traces" / "curves.json"
MINE = "your requests"  # the choice of workload that replays the visitor's own
REPLAY_MINE = "Replay my requests"
MIN_BLOCKS = 2  # full pages the visitor's requests must fill for a replay of them to say anything
DEFAULT_BLOCK = 16  # tokens per block of an empty trace (no engine to ask)
OPTIMUM = "belady"
POLICY_NAMES = {
    "lru": "LRU",
    "fifo": "FIFO",
    "lfu": "LFU",
    "arc": "ARC",
    OPTIMUM: "Belady's MIN (the optimum: knows the future)",
}
POLICY_COLORS = {"lru": "#2563eb", "fifo": "#9333ea", "lfu": "#d97706", "arc": "#16a34a", OPTIMUM: "#111827"}
TRACE_NAMES = {
    "conversation_trace.jsonl": "Kimi's conversation traffic (Mooncake, 1 hour, 12,031 requests)",
    "synthetic_trace.jsonl": "synthetic traffic (Mooncake: ShareGPT, LEval, LooGLE; 3,993 requests)",
}


@dataclass(frozen=True)
class Point:
    """One replay: a policy at a capacity (cached blocks)."""

    policy: str
    capacity: int
    hit_rate: float  # hit tokens / prompt tokens
    hit_tokens: int
    evictions: int
    orphans: int  # cached blocks whose parent is gone: they can never hit again
    refused: int  # requests a pool this small refuses (served nothing): "engine" semantics only


@dataclass(frozen=True)
class Curves:
    """A workload's hit rate against capacity, every policy, and the ceiling of a cache that never evicts."""

    name: str
    block_size: int  # tokens per block
    requests: int
    input_tokens: int
    ceiling: float
    points: tuple[Point, ...]
    semantics: Semantics  # what a capacity means (``astrai.lab.replay.CAPACITY_MEANING``)

    @property
    def capacities(self) -> list[int]:
        return sorted({p.capacity for p in self.points})

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(p.policy for p in self.points))

    def nearest(self, capacity: float) -> int:
        """The replayed capacity nearest ``capacity`` on a log scale (the chart's), shifted by one so that a
        capacity of 0 (which the lab accepts) has a place on it."""
        return min(self.capacities, key=lambda c: abs(math.log1p(c) - math.log1p(max(capacity, 0))))

    def at(self, capacity: int) -> list[Point]:
        return [p for p in self.points if p.capacity == capacity]


def load(path: Path = SHIPPED) -> list[Curves]:
    """The curves ``python -m astrai.lab --json`` wrote (``assets/traces/NOTICE.md`` names the command)."""
    data = json.loads(path.read_text())
    return [
        Curves(
            name=TRACE_NAMES.get(trace["trace"], trace["trace"]),
            block_size=trace["block_size"],
            requests=trace["requests"],
            input_tokens=trace["input_tokens"],
            ceiling=trace["ceiling"]["hit_rate"],
            points=tuple(
                Point(**{field.name: r[field.name] for field in dataclasses.fields(Point)}) for r in trace["rows"]
            ),
            semantics=trace["semantics"],
        )
        for trace in data["traces"]
    ]


def step_ratio(curves: Curves) -> float:
    """How much larger each replayed capacity is than the one before (the grid is log-spaced: about 1.5× on the
    shipped curves), as the geometric mean over the grid's capacities above 0."""
    grid = [c for c in curves.capacities if c > 0]
    if not grid:
        return 1.0
    low, high, n = grid[0], grid[-1], len(grid)
    return float((high / low) ** (1 / max(n - 1, 1)))


def capacity_choices(curves: Curves) -> list[tuple[str, int]]:
    """The capacity control's choices: the replayed capacities, log-spaced, each written with separators."""
    return [(f"{c:,}", c) for c in curves.capacities]


def full_blocks(trace: Trace) -> int:
    """The full blocks (pages) a trace's prompts fill: what a cache could hold of them."""
    return sum(trace.full_blocks(r) for r in trace.requests)


def not_yet(blocks: int) -> str | None:
    """Why Replay my requests cannot answer yet, for requests that fill ``blocks`` full pages; None: it can."""
    if blocks >= MIN_BLOCKS:
        return None
    return (
        f"your requests on this engine fill {blocks} full page{'s' if blocks != 1 else ''}, and a replay needs "
        f"{MIN_BLOCKS}: run prompts longer than a page first"
    )


def tokens(blocks: int, block_size: int) -> str:
    """A capacity in tokens, in words: "2.9M tokens"."""
    n = blocks * block_size
    return f"{n / 1e6:.1f}M tokens" if n >= 1e6 else f"{n / 1e3:.0f}k tokens" if n >= 1e4 else f"{n:,} tokens"


def best_online(points: Sequence[Point]) -> Point:
    return max((p for p in points if p.policy != OPTIMUM), key=lambda p: p.hit_rate)


def summary(curves: Curves, capacity: int) -> str:
    """What the chart says at ``capacity``, in words (the lesson steps' claims are this): LRU, the default; ARC, the
    policy the lesson compares it with; any other online policy only where it serves the most. The best online policy
    is named so where it serves more than LRU."""
    points = {p.policy: p for p in curves.at(capacity)}
    top = best_online(list(points.values())).hit_rate
    lru = points["lru"].hit_rate if "lru" in points else None
    parts = [f"**{capacity:,} blocks** ({tokens(capacity, curves.block_size)}): LRU serves "]
    parts.append(f"**{lru:.1%}** of the prompt tokens" if lru is not None else "n/a")
    shown = [points["arc"]] if "arc" in points else []
    if not shown or shown[0].hit_rate < top:  # another policy serves the most: it is named too (the first, on a tie)
        shown += [p for p in points.values() if p.policy not in ("lru", "arc", OPTIMUM) and p.hit_rate == top][:1]
    for p in shown:
        best = " (the best online policy here)" if p.hit_rate == top and (lru is None or top > lru) else ""
        parts.append(f", {POLICY_NAMES[p.policy]}{best} {p.hit_rate:.1%}")
    if OPTIMUM in points:
        parts.append(f", the optimum {points[OPTIMUM].hit_rate:.1%}")
    parts.append(f"; a cache that never evicts serves {curves.ceiling:.1%}.")
    refused = max((p.refused for p in points.values()), default=0)  # the same for every policy: a prompt's length
    if refused:
        parts.append(
            f" {refused:,} of the {curves.requests:,} requests need more than the whole pool: an engine this small "
            "refuses them, so they are served nothing."
        )
    return "".join(parts)


def curve_chart(curves: Curves, capacity: int) -> go.Figure:
    """Hit rate against capacity (log scale), a line per policy, the ceiling dashed, a marker at ``capacity``. A log
    axis has no place for a capacity of 0 (which serves nothing): its points are in the table only."""
    fig = go.Figure()
    for policy in curves.policies:
        points = sorted((p for p in curves.points if p.policy == policy and p.capacity > 0), key=lambda p: p.capacity)
        fig.add_trace(
            go.Scatter(
                x=[p.capacity for p in points],
                y=[100 * p.hit_rate for p in points],
                mode="lines+markers",
                name=POLICY_NAMES.get(policy, policy),
                line=dict(color=POLICY_COLORS.get(policy), width=2, dash="dot" if policy == OPTIMUM else "solid"),
                hovertemplate="%{x:,} blocks: %{y:.1f}%<extra>" + POLICY_NAMES.get(policy, policy) + "</extra>",
            )
        )
    fig.add_hline(y=100 * curves.ceiling, line=dict(color="#6b7280", dash="dash"))
    fig.add_annotation(
        x=1, xref="paper", y=100 * curves.ceiling, text="never evicts", showarrow=False, yshift=8, xanchor="right"
    )
    fig.add_vline(x=capacity, line=dict(color="#111827", width=1.5, dash="dash"))
    fig.update_xaxes(
        type="log",
        title_text=f"capacity: {CAPACITY_MEANING[curves.semantics]}, of {curves.block_size} tokens each",
        gridcolor="#e5e7eb",
    )
    fig.update_yaxes(title_text="% of prompt tokens served", range=[0, 105 * max(curves.ceiling, 0.01)])
    fig.update_layout(
        title=dict(text=f"Hit rate against capacity: {curves.name}", font=dict(size=13)),
        height=300,
        margin=dict(l=45, r=10, t=32, b=40),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.3, font=dict(size=10)),
        uirevision=curves.name,
    )
    return fig


TABLE_COLUMNS = ["policy", "hit rate %", "prompt tokens served", "evictions", "orphaned blocks"]


def rows_at(curves: Curves, capacity: int) -> list[list[object]]:
    """What each policy keeps at ``capacity``: one row each, in ``TABLE_COLUMNS`` order, best first; counts written
    with thousands separators ("1,234,567"), as every number of the lab's view."""
    points = sorted(curves.at(capacity), key=lambda p: -p.hit_rate)
    return [
        [
            POLICY_NAMES.get(p.policy, p.policy),
            round(100 * p.hit_rate, 2),
            f"{p.hit_tokens:,}",
            f"{p.evictions:,}",
            f"{p.orphans:,}",
        ]
        for p in points
    ]
