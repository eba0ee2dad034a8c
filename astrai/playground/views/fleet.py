"""A fleet at a glance: each replica's page map, occupancy and hit rate side by side, the fleet line, and the
routing comparison. Pure functions of typed observations (no Gradio, no I/O).

Counting rules: the fleet's hit rate is the replicas' reported hits over their reported queries (``/metrics``, in
tokens); a replica's line in the routing comparison counts only the comparison's own requests, by the usage each
request reported (``cached_tokens`` of ``prompt_tokens``), grouped by the replica whose KV events named it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from astrai.observation import CacheStats, PageRecord, RequestInfo
from astrai.playground.backends.protocol import RouterMetrics, Served, replica_of
from astrai.playground.views.charts import GRID, PLAIN, page_cells, page_grid
from astrai.playground.views.pages import PageView
from astrai.playground.views.series import Series

REPLICA_COLORS = ["#2563eb", "#d97706", "#16a34a", "#9333ea", "#db2777", "#0891b2"]
FLEET_MAP_HEIGHT = 250


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the live view draws it: its name, its stats (None while it cannot be reached, with why)."""

    name: str
    label: str
    stats: CacheStats | None
    unreachable: str | None = None


def served_text(served: Served | None) -> str:
    """A badge's last words on a fleet: the replica that served the panel, and how that is known."""
    if served is None:
        return "replica: not seen yet (its KV events name it once a block is full)"
    return f"served by {served.replica.split(' (')[0]} (from {served.source})"


def _rate(stats: CacheStats | None) -> str:
    if stats is None or stats.hit_tokens is None or not stats.query_tokens:
        return "no lookups yet" if stats is not None and stats.query_tokens == 0 else "hit rate n/a"
    return f"hit {stats.hit_tokens / stats.query_tokens:.0%} of {stats.query_tokens} tokens"


def fleet_line(replicas: Sequence[ReplicaState], routers: Sequence[tuple[str, RouterMetrics | None]]) -> str:
    """The fleet in words, after the stats line (which sums the replicas): each replica's load and reuse, and what
    each router decided."""
    parts = []
    for replica in replicas:
        s = replica.stats
        if s is None:
            parts.append(f"{replica.name}: ⚠️ unreachable")
            continue
        load = f"{_n(s.running)} running, {_n(s.waiting)} waiting, {_n(s.used_pages)} pages in use"
        parts.append(f"{replica.name}: {load}, {_rate(s)}")
    lines = [f"**Each replica:** {' · '.join(parts)}"]
    for policy, metrics in routers:
        lines.append(f"**Router ({policy}):** " + router_text(metrics, replicas))
    return "  \n".join(lines)


def router_text(metrics: RouterMetrics | None, replicas: Sequence[ReplicaState]) -> str:
    if metrics is None:
        return "metrics n/a (give --router-metrics)"
    names = {r.label.split(" (")[-1].rstrip(")"): r.name for r in replicas}  # "127.0.0.1:8041" -> "replica 1"

    def name(url: str) -> str:
        return names.get(url.split("://", 1)[-1], url)

    routed = ", ".join(f"{n} → {name(url)}" for url, n in sorted(metrics.decisions.items())) or "nothing routed yet"
    text = f"routed {routed}"
    if metrics.prefix_outcomes:
        text += " · prefix decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(metrics.prefix_outcomes.items()))
    down = [name(url) for url, ok in metrics.healthy.items() if not ok]
    return text + (f" · ⚠️ it marks {', '.join(down)} unhealthy" if down else "")


def _n(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def replica_map_title(replica: ReplicaState, pages: Sequence[PageView] | None) -> str:
    """A replica's page map title: its load, or that it cannot be reached."""
    if pages is None or replica.stats is None:
        return f"{replica.name}: unreachable"
    held = sum(p.state != "free" for p in pages)
    return f"{replica.name}: {held} blocks held, {_n(replica.stats.used_pages)} in use"


def split_pages(records: Sequence[PageRecord], replicas: int) -> list[list[PageRecord]]:
    """A fleet's pages, seen as one pool (``protocol.fleet_page``), back into each replica's own."""
    split: list[list[PageRecord]] = [[] for _ in range(replicas)]
    for record in records:
        replica, page = replica_of(record.page, replicas)
        split[replica].append(dataclasses.replace(record, page=page))
    return split


def replica_page_maps(
    maps: Sequence[tuple[str, Sequence[PageView] | None]],
    panel_label: Callable[[int], str],
    title: str = "Page map per replica",
) -> go.Figure:
    """Each replica's page map, side by side, under its own title (None pages: an empty map)."""
    fig = make_subplots(rows=1, cols=len(maps), subplot_titles=[t for t, _ in maps], horizontal_spacing=0.04)
    rows = 1
    for col, (_, pages) in enumerate(maps, start=1):
        grid = page_grid(pages or [], panel_label, cols=24)
        rows = max(rows, grid.rows)
        for trace in page_cells(grid):
            fig.add_trace(trace, row=1, col=col)
        fig.update_xaxes(visible=False, range=[-0.5, grid.cols - 0.5], row=1, col=col)
        fig.update_yaxes(visible=False, autorange="reversed", row=1, col=col)
    fig.update_annotations(font=dict(size=11))
    fig.update_layout(
        height=min(FLEET_MAP_HEIGHT, 70 + rows * 12),
        margin=dict(l=5, r=5, t=40, b=5),
        **PLAIN,
        showlegend=False,
        title=dict(text=f"{title} (x = shared)", font=dict(size=13), y=0.98),
        uirevision="keep",
    )
    return fig


def _replica_lines(
    per_replica: Sequence[tuple[str, Series]], value: Callable[[Series], list], title: str, y_title: str
) -> go.Figure:
    fig = go.Figure()
    for i, (name, data) in enumerate(per_replica):
        fig.add_trace(
            go.Scatter(
                x=data.ages,
                y=value(data),
                name=name,
                mode="lines",
                line=dict(color=REPLICA_COLORS[i % len(REPLICA_COLORS)], width=2, shape="hv"),
            )
        )
    fig.update_layout(
        title=dict(text=title, font=dict(size=13)),
        height=230,
        margin=dict(l=40, r=10, t=32, b=30),
        legend=dict(orientation="h", y=-0.3, font=dict(size=10)),
        yaxis_title=y_title,
        xaxis_title="seconds ago",
        **PLAIN,
        uirevision="fleet",
    )
    fig.update_xaxes(**GRID)
    fig.update_yaxes(**GRID)
    return fig


def replica_occupancy(per_replica: Sequence[tuple[str, Series]]) -> go.Figure:
    """Pages each replica holds (in use + cached, by its metrics and events), one line per replica."""

    def held(data: Series) -> list[int | None]:
        return [None if u is None or c is None else u + c for u, c in zip(data.used, data.cached, strict=True)]

    fig = _replica_lines(per_replica, held, "Pages held per replica (in use + cached)", "pages")
    fig.update_traces(line=dict(dash="solid"))
    return fig


def replica_cached(per_replica: Sequence[tuple[str, Series]]) -> go.Figure:
    """Cached blocks per replica (derived: held by the events − in use by ``/metrics``): vLLM keeps them in its
    LRU, whose order it does not publish."""
    title = "Cached blocks per replica (derived; vLLM's LRU order: n/a)"
    return _replica_lines(per_replica, lambda data: list(data.cached), title, "blocks")


def replica_hit_rates(per_replica: Sequence[tuple[str, Series]]) -> go.Figure:
    def percent(data: Series) -> list[float | None]:
        return [None if r is None else 100 * r for r in data.hit_rate]

    fig = _replica_lines(per_replica, percent, "Prefix hit rate per replica (token-weighted, /metrics)", "%")
    fig.update_yaxes(range=[0, 105])
    return fig


@dataclass(frozen=True)
class PolicyResult:
    """One routing policy's pass of the comparison: what its requests reported, and where they ran."""

    policy: str
    infos: tuple[RequestInfo, ...]
    served: tuple[str | None, ...]  # each request's replica name (None: not seen in the events)
    tenants: tuple[int, ...]  # each request's tenant

    def tenant_replicas(self) -> dict[int, set[str]]:
        """Tenant -> the replicas that served its requests (as far as the events tell)."""
        out: dict[int, set[str]] = {}
        for tenant, replica in zip(self.tenants, self.served, strict=True):
            out.setdefault(tenant, set()).update([replica] if replica else [])
        return out

    @property
    def computed_tokens(self) -> int:
        return sum(i.prompt_tokens - (i.cached_tokens or 0) for i in self.infos)

    @property
    def prompt_tokens(self) -> int:
        return sum(i.prompt_tokens for i in self.infos)

    @property
    def ttft_s(self) -> float | None:
        ttfts = sorted(i.ttft for i in self.infos if i.ttft is not None)
        return ttfts[len(ttfts) // 2] if ttfts else None

    def per_replica(self) -> dict[str, tuple[int, int]]:
        """Replica name -> (cached, prompt) tokens of this pass's requests it served."""
        out: dict[str, tuple[int, int]] = {}
        for info, replica in zip(self.infos, self.served, strict=True):
            cached, prompt = out.get(replica or "not seen", (0, 0))
            out[replica or "not seen"] = (cached + (info.cached_tokens or 0), prompt + info.prompt_tokens)
        return out


def routing_chart(results: Sequence[PolicyResult]) -> go.Figure:
    """Policies side by side: prefill tokens computed, hit rate per replica, median TTFT."""
    fig = make_subplots(
        rows=1, cols=3, subplot_titles=("prefill tokens computed", "hit rate per replica %", "TTFT s (median)")
    )
    replicas = sorted({name for r in results for name in r.per_replica()})
    for i, result in enumerate(results):
        color = REPLICA_COLORS[(i + 2) % len(REPLICA_COLORS)]
        fig.add_trace(go.Bar(x=[result.policy], y=[result.computed_tokens], marker_color=color), row=1, col=1)
        fig.add_trace(go.Bar(x=[result.policy], y=[result.ttft_s], marker_color=color), row=1, col=3)
    for j, name in enumerate(replicas):
        rates = []
        for result in results:
            cached, prompt = result.per_replica().get(name, (0, 0))
            rates.append(100 * cached / prompt if prompt else None)
        color = REPLICA_COLORS[j % len(REPLICA_COLORS)]
        fig.add_trace(go.Bar(x=[r.policy for r in results], y=rates, name=name, marker_color=color), row=1, col=2)
    fig.update_layout(
        height=250,
        margin=dict(l=30, r=10, t=40, b=20),
        **PLAIN,
        barmode="group",
        showlegend=False,
        title=dict(text="Routing policies on the same tenants (each pass on a cold cache)", font=dict(size=13)),
    )
    return fig


def routing_note(results: Sequence[PolicyResult]) -> str:
    """The comparison in words, each policy's figures as the servers reported them."""
    if not results:
        return "Press **Compare routing** to send the tenants' waves through each router."
    lines = []
    for r in results:
        where = "; ".join(
            f"{name}: {cached} of {prompt} cached" for name, (cached, prompt) in sorted(r.per_replica().items())
        )
        ttft = "n/a" if r.ttft_s is None else f"{r.ttft_s:.2f} s"
        spread = sum(len(replicas) > 1 for replicas in r.tenant_replicas().values())
        tenants = len(r.tenant_replicas())
        kept = f"{spread} of {tenants} tenants ran on more than one replica" if spread else "each tenant on one replica"
        lines.append(
            f"**{r.policy}:** {r.computed_tokens} of {r.prompt_tokens} prompt tokens computed ({where}); "
            f"{kept}; median TTFT {ttft}"
        )
    best = min(results, key=lambda r: r.computed_tokens)
    worst = max(results, key=lambda r: r.computed_tokens)
    if best.computed_tokens < worst.computed_tokens:
        lines.append(
            f"**{best.policy}** computed {worst.computed_tokens - best.computed_tokens} fewer prefill tokens than "
            f"**{worst.policy}**: a tenant whose requests land on another replica computes its system prompt there "
            "again."
        )
    return "  \n".join(lines)
