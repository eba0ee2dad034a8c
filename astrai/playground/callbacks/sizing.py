"""The cache-sizing lab in the page: the shipped traces' curves at once (precomputed), or the visitor's own
requests replayed on demand, with progress, in the request's worker thread (never the engine's loop)."""

from __future__ import annotations

import gradio as gr

from astrai.lab.record import from_requests
from astrai.lab.replay import REPLAY_POLICIES, Replay
from astrai.playground.callbacks.context import QUIET, Context, Update, session_of
from astrai.playground.state import Visitor
from astrai.playground.views import sizing

MAX_OWN_CAPACITIES = 8  # replays per policy for a visitor's own requests (each takes milliseconds)


class SizingCallbacks:
    def __init__(self, ctx: Context):
        self.ctx, self.ui = ctx, ctx.ui
        self.shipped = {curves.name: curves for curves in sizing.load()}

    def choices(self) -> list[str]:
        return [*self.shipped, sizing.MINE]

    def show(self, trace: str | None, capacity: float | None, request: gr.Request) -> Update:
        """The chosen workload's curves, with the capacity snapped to the nearest one replayed."""
        views = self.ui.sizing
        curves = self._curves(trace, self.ctx.visitors.peek(session_of(request)))
        if curves is None:
            return {
                views.note: "Press **Replay my requests** to size a cache for the requests you have run so far.",
                views.chart: None,
                views.table: [],
            }
        nearest = curves.nearest(capacity or curves.capacities[len(curves.capacities) // 2])
        slider = gr.Slider(minimum=curves.capacities[0], maximum=curves.capacities[-1], value=nearest)
        return {
            views.chart: sizing.curve_chart(curves, nearest),
            views.table: sizing.rows_at(curves, nearest),
            views.note: sizing.summary(curves, nearest),
            views.capacity: slider,
        }

    def replay_mine(
        self,
        capacity: float | None,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """The visitor's ended requests on their engine, as a trace at its page size, through every policy at a
        few capacities up to what they fill (a few hundred blocks at most: each replay takes milliseconds)."""
        session = session_of(request)
        visitor = self.ctx.visitors.act(session)
        backend = self.ctx.engines.backend(visitor.profile)
        page_size = backend.stats().page_size if backend is not None else None
        infos = backend.request_info(self.ctx.visitors.requests_of(session)) if backend is not None else []
        trace = from_requests(infos, page_size or 16)
        blocks = sum(trace.full_blocks(r) for r in trace.requests)
        if not trace.requests or blocks < 2:
            raise gr.Error("Run a few batches on your engine first: your requests fill no more than one page yet.")
        steps = MAX_OWN_CAPACITIES - 1  # capacities on a log scale from 1 block to all of them
        capacities = sorted({max(1, int(round(blocks ** (k / steps)))) for k in range(MAX_OWN_CAPACITIES)})
        prepared = Replay(trace)
        points = []
        for i, policy in enumerate(REPLAY_POLICIES):
            progress(i / len(REPLAY_POLICIES), desc=f"replaying your {len(trace.requests)} requests under {policy}")
            for capacity in capacities:
                result = prepared.run(policy, capacity)
                points.append(
                    sizing.Point(policy, capacity, result.hit_rate, result.hit_tokens, result.evictions, result.orphans)
                )
        ceiling = prepared.run("lru", None)
        visitor.sizing = sizing.Curves(
            name=f"your {len(trace.requests)} requests (pages of {trace.block_size} tokens)",
            block_size=trace.block_size,
            requests=len(trace.requests),
            input_tokens=trace.input_tokens,
            ceiling=ceiling.hit_rate,
            points=tuple(points),
        )
        return {self.ui.sizing.trace: sizing.MINE} | self.show(sizing.MINE, capacity, request)

    def _curves(self, trace: str | None, visitor: Visitor) -> sizing.Curves | None:
        if trace == sizing.MINE:
            return visitor.sizing
        return self.shipped.get(trace or "", next(iter(self.shipped.values())))

    def wire(self, demo: gr.Blocks) -> None:
        views = self.ui.sizing
        outputs = [views.chart, views.table, views.note, views.capacity]
        for trigger in (views.trace.change, views.capacity.release):
            trigger(self.show, [views.trace, views.capacity], outputs, api_visibility="private", **QUIET)
        views.replay_mine.click(
            self.replay_mine,
            [views.capacity],
            [views.trace, *outputs],
            api_name="replay_my_requests",
            concurrency_limit=2,
            show_progress_on=views.note,
        )
        demo.load(self.show, [views.trace, views.capacity], outputs, api_visibility="private", **QUIET)
