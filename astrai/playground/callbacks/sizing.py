"""The cache-sizing lab in the page: the shipped traces' curves at once (precomputed), or the visitor's own
requests replayed on demand, with progress, in the request's worker thread (never the engine's loop).

**Replay my requests** is offered only while it can answer: the visitor's requests on their engine must fill
``sizing.MIN_BLOCKS`` full pages. Until then the button is disabled and says why (it is updated after each run and
each move to a lesson step), and a press that races it gets the same words in the note, never an error.
"""

from __future__ import annotations

import gradio as gr

from astrai.lab.record import from_requests
from astrai.lab.replay import REPLAY_POLICIES, Replay, Semantics
from astrai.lab.trace import Trace
from astrai.playground.backends.protocol import BackendError
from astrai.playground.callbacks.context import QUIET, Context, Update, session_of
from astrai.playground.state import Visitor
from astrai.playground.views import sizing

MAX_OWN_CAPACITIES = 8  # replays per policy for a visitor's own requests (each takes milliseconds)
OWN_SEMANTICS: Semantics = "engine"  # a capacity is a pool of that many pages, as the visitor's engine has


def own_requests(ctx: Context, session: str) -> tuple[Trace, int | None]:
    """The visitor's ended requests on the engine they are on, as a trace at its page size, and its pool's pages
    (None where the engine is not running or cannot be reached: then the trace is empty)."""
    backend = ctx.engines.backend(ctx.visitors.peek(session).profile)
    if backend is None:
        return Trace((), sizing.DEFAULT_BLOCK, sizing.MINE), None
    try:
        stats = backend.stats()
        infos = backend.request_info(ctx.visitors.requests_of(session))
    except BackendError:
        return Trace((), sizing.DEFAULT_BLOCK, sizing.MINE), None
    return from_requests(infos, stats.page_size or sizing.DEFAULT_BLOCK), stats.n_pages


def replay_button(blocks: int) -> gr.Button:
    """Replay my requests for requests that fill ``blocks`` full pages: enabled, or disabled and saying why."""
    reason = sizing.not_yet(blocks)
    if reason is None:
        return gr.Button(value=sizing.REPLAY_MINE, interactive=True)
    return gr.Button(value=f"{sizing.REPLAY_MINE} ({reason})", interactive=False)


def replay_button_of(ctx: Context, session: str) -> Update:
    """The button as it stands for the requests the visitor has on their engine (after a run, after a move)."""
    trace, _ = own_requests(ctx, session)
    return {ctx.ui.sizing.replay_mine: replay_button(sizing.full_blocks(trace))}


class SizingCallbacks:
    def __init__(self, ctx: Context):
        self.ctx, self.ui = ctx, ctx.ui
        self.shipped = {curves.name: curves for curves in sizing.load()}

    def choices(self) -> list[str]:
        return [*self.shipped, sizing.MINE]

    def show(self, trace: str | None, capacity: float | None, request: gr.Request) -> Update:
        """The chosen workload's curves at the replayed capacity nearest ``capacity``; the capacity control offers
        that workload's capacities."""
        views = self.ui.sizing
        curves = self._curves(trace, self.ctx.visitors.peek(session_of(request)))
        if curves is None:
            return {
                views.note: "Press **Replay my requests** to size a cache for the requests you have run so far.",
                views.chart: None,
                views.table: [],
            }
        nearest = curves.nearest(capacity or curves.capacities[len(curves.capacities) // 2])
        return {
            views.chart: sizing.curve_chart(curves, nearest),
            views.table: sizing.rows_at(curves, nearest),
            views.note: sizing.summary(curves, nearest),
            views.capacity: gr.Radio(choices=sizing.capacity_choices(curves), value=nearest),
        }

    def replay_mine(
        self,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """The visitor's ended requests on their engine, as a trace at its page size, through every policy at a
        few capacities up to what they fill (a few hundred blocks at most: each replay takes milliseconds), and at
        their pool's size, which is shown first."""
        session = session_of(request)
        visitor = self.ctx.visitors.act(session)
        trace, pool = own_requests(self.ctx, session)
        blocks = sizing.full_blocks(trace)
        button = replay_button(blocks)
        reason = sizing.not_yet(blocks)
        if reason is not None:  # a press that raced the button's update: the same words, no error
            return {self.ui.sizing.note: f"**{sizing.REPLAY_MINE}**: {reason}.", self.ui.sizing.replay_mine: button}
        steps = MAX_OWN_CAPACITIES - 1  # capacities on a log scale from 1 block to all of them, and the pool's
        capacities = {max(1, int(round(blocks ** (k / steps)))) for k in range(MAX_OWN_CAPACITIES)}
        shown = min(pool or blocks, blocks)
        prepared = Replay(trace)
        points = []
        for i, policy in enumerate(REPLAY_POLICIES):
            progress(i / len(REPLAY_POLICIES), desc=f"replaying your {len(trace.requests)} requests under {policy}")
            for at in sorted(capacities | {shown}):
                result = prepared.run(policy, at, OWN_SEMANTICS)
                points.append(
                    sizing.Point(
                        policy, at, result.hit_rate, result.hit_tokens, result.evictions, result.orphans, result.refused
                    )
                )
        ceiling = prepared.run("lru", None)
        visitor.sizing = sizing.Curves(
            name=f"your {len(trace.requests)} requests (pages of {trace.block_size} tokens)",
            block_size=trace.block_size,
            requests=len(trace.requests),
            input_tokens=trace.input_tokens,
            ceiling=ceiling.hit_rate,
            points=tuple(points),
            semantics=OWN_SEMANTICS,
        )
        update = {self.ui.sizing.trace: sizing.MINE, self.ui.sizing.replay_mine: button}
        return update | self.show(sizing.MINE, shown, request)

    def _curves(self, trace: str | None, visitor: Visitor) -> sizing.Curves | None:
        if trace == sizing.MINE:
            return visitor.sizing
        return self.shipped.get(trace or "", next(iter(self.shipped.values())))

    def wire(self, demo: gr.Blocks) -> None:
        views = self.ui.sizing
        outputs = [views.chart, views.table, views.note, views.capacity]
        for trigger in (views.trace.input, views.capacity.input):  # a visitor's choice, not a replay's update
            trigger(self.show, [views.trace, views.capacity], outputs, api_visibility="private", **QUIET)
        views.replay_mine.click(
            self.replay_mine,
            None,
            [views.trace, views.replay_mine, *outputs],
            api_name="replay_my_requests",
            concurrency_limit=2,
            show_progress_on=views.note,
        )
        demo.load(self.show, [views.trace, views.capacity], outputs, api_visibility="private", **QUIET)
