"""The live view: each second, the page map, the charts, the tree and the stats line of the visitor's engine.

A poll never counts as activity (``Visitors.peek``): hundreds of open tabs cannot push an active visitor's state
out. While the visitor's own run streams, the badges fill in here too (TTFT as soon as it is known).

An open page with nothing changing costs the app almost nothing (a class keeps thirty open on a Space's 2 vCPUs):

- A tick whose tab has drawn everything (its cursor settled, no badges of a run showing) and whose engine has not
  stepped since (``Backend.steps``, read without the engine's lock) waits for a change (looked for every
  ``CHECK_EVERY_S``, on a worker thread: finding the engine may retire an idle one) or for ``IDLE_WAIT_S``, then
  answers; the timer's next tick is not sent while one is pending (``trigger_mode="once"``). So an idle page costs
  one request every ``IDLE_WAIT_S`` instead of one a second, and a change (a run by anyone on the engine, a vLLM
  server's activity, the visitor's own Run, Live or another engine) is drawn within ``CHECK_EVERY_S`` plus a draw,
  as before. What no step shows (another visitor arriving, a server going away) waits for the next answer.
- A hidden tab sends no tick at all: Gradio 6.31's Timer dispatches a tick only while
  ``document.visibilityState`` is "visible" (the Page Visibility API), so the timer needs no hook of ours.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import anyio
import gradio as gr
from gradio.blocks import Block

from astrai.observation import CacheStats, PageEvicted, PageRecord
from astrai.playground.backends.profiles import Profile
from astrai.playground.backends.protocol import Backend, BackendError
from astrai.playground.callbacks.context import QUIET, Context, Update, panel_label, session_of
from astrai.playground.callbacks.run import RunCallbacks
from astrai.playground.callbacks.teacher import TeacherCallbacks
from astrai.playground.views import charts, fleet, pages, series, text, tree

MAX_GHOSTS = 64  # evicted pages kept for the tree's next drawing
OCCUPANCY_STREAMING_S = 4.0  # while the visitor's own text streams, the occupancy chart is redrawn this seldom
# An idle page: its tick waits up to IDLE_WAIT_S for a change, looking every CHECK_EVERY_S (a few reads, no lock a
# step holds). tools/idle_cost.py, 30 idle pages on the Intel Xeon (docs/benchmarks.md): polled each second,
# 0.35-0.57% of a core per page; waiting, 0.03-0.08%.
IDLE_WAIT_S = 20.0
CHECK_EVERY_S = 0.25
THREADS_AT_ONCE = 8  # ticks looking or drawing at once (a waiting one holds no thread between its looks)


@dataclass(frozen=True)
class LiveCursor:
    """Where one tab's live view is: which engine it draws, the last event and step it saw, and what it drew."""

    engine: str = ""  # ``_engine_key`` drawn: another one redraws everything
    seq: int = 0
    steps: int = -1
    settled: bool = False  # nothing moved at the last tick
    following: bool = True  # the visitor was live (not replaying) at the last tick: back live, everything is redrawn
    tick: int = 0
    evicted: tuple[PageEvicted, ...] = ()  # pages evicted since the tree was last drawn: its ghosts
    occupancy_at: float = 0.0
    badges: tuple[str, ...] = field(default=())  # the badges last sent


@dataclass(frozen=True)
class Look:
    """Who is looking, and how they see pages: their session (the privacy rule), their last run's request ids (the
    tree's focus; None before a run) and how tokens are written (special tokens as text.SPECIAL_TOKEN_TEXT)."""

    session: str
    focus: set[int] | None
    decode: text.Decode


def _readable(backend: Backend) -> text.Decode:
    return text.readable(backend.decode, backend.special_ids())


def _engine_key(profile: Profile, backend: Backend | None) -> str:
    """Which cache a cursor drew: the profile and its backend's generation (or none running)."""
    return f"{profile.key}#{backend.generation if backend is not None else 'stopped'}"


class LiveCallbacks:
    def __init__(self, ctx: Context, runs: RunCallbacks, teacher: TeacherCallbacks | None = None):
        self.ctx, self.ui, self.runs = ctx, ctx.ui, runs
        self.teacher = teacher  # its call to the class rides on this poll (the banner); None: no teacher's view
        self._threads = anyio.CapacityLimiter(THREADS_AT_ONCE)

    async def watch(self, cursor: LiveCursor | None, request: gr.Request) -> Update:
        """The timer's tick: ``refresh`` as soon as this tab has something to draw, or nothing after
        ``IDLE_WAIT_S`` (the module's docstring). Sleeps on the event loop between looks: a waiting tab holds no
        thread."""
        session = session_of(request)
        deadline = time.monotonic() + IDLE_WAIT_S
        while await anyio.to_thread.run_sync(self.idle, cursor, session, limiter=self._threads):
            if time.monotonic() >= deadline:
                return {self.ui.cache.cursor: cursor}  # nothing new (Gradio takes an empty dict for one value)
            await asyncio.sleep(CHECK_EVERY_S)
        update = await anyio.to_thread.run_sync(self.refresh, cursor, request, limiter=self._threads)
        return (update | self.teacher.banner_update(session)) if self.teacher is not None else update

    def idle(self, cursor: LiveCursor | None, session: str) -> bool:
        """True while a tick would draw nothing: the tab's last tick found nothing moving and drew it all (settled),
        shows no badges of a run, and since then the visitor has not started a run, gone back live or replaying,
        nor moved to another engine, and the engine has not stepped, and no teacher's call waits for the page. Takes
        no lock a step holds."""
        if self.teacher is not None and self.teacher.waiting(session):
            return False
        if cursor is None or not cursor.settled or cursor.badges:
            return False
        visitor = self.ctx.visitors.peek(session)
        if visitor.streaming_since is not None or visitor.following != cursor.following:
            return False
        backend = self.ctx.engines.backend(visitor.profile)
        if cursor.engine != _engine_key(visitor.profile, backend):
            return False
        return backend is None or backend.steps == cursor.steps

    def refresh(self, cursor: LiveCursor | None, request: gr.Request) -> Update:
        ctx, cache = self.ctx, self.ui.cache
        session = session_of(request)
        visitor = ctx.visitors.peek(session)
        profile = visitor.profile
        view = ctx.engines.view(profile, ctx.visitors.on(profile))
        backend = ctx.engines.backend(profile)
        engine = _engine_key(profile, backend)
        if backend is None:  # settled on "stopped": the next tick waits for the engine to start again
            line = text.engine_line(view, profile.model)
            return {
                cache.stats: f"{line}  \nIts engine is not running now (retired while idle): Run starts it again.",
                cache.cursor: LiveCursor(engine=engine, settled=True, following=visitor.following),
            }
        previous = cursor or LiveCursor()
        fresh = previous.engine != engine
        try:
            stats = backend.stats()
        except BackendError as exc:  # a server away: say so, keep serving, try again at the next tick
            return {cache.stats: text.unreachable_line(backend.label, str(exc))}
        events = backend.events(after=0 if fresh else previous.seq)
        evicted = [] if fresh else [e for e in events if isinstance(e, PageEvicted)]
        quiet = not fresh and not events and stats.steps == previous.steps
        now = replace(
            previous if not fresh else LiveCursor(),
            engine=engine,
            seq=events[-1].seq if events else (0 if fresh else previous.seq),
            steps=stats.steps,
            settled=quiet,
            following=visitor.following,
            tick=previous.tick + 1,
            evicted=((() if fresh else previous.evicted) + tuple(evicted))[-MAX_GHOSTS:],
        )
        line = f"{text.engine_line(view, backend.label)}  \n{text.stats_line(stats, backend.derived, backend.caveat)}"
        states = _replica_states(backend)
        if states:
            line += "  \n" + fleet.fleet_line(states, [(r.policy, r.metrics()) for r in backend.routers])
        update: Update = {cache.stats: line}
        if visitor.streaming_since is not None or previous.badges:
            badges = self.runs.details(visitor, session, highlights=False)
            shown = tuple(badges[b] for b in self.ui.panels.badges)
            if shown != previous.badges:
                update |= badges
            now = replace(now, badges=shown if visitor.streaming_since is not None else ())
        update[cache.cursor] = now
        if not visitor.following:  # replaying: no redraw
            return update
        back = not previous.following  # the first tick back live draws everything (this tick's cursor can land
        # after the one the Live button reset: its "following" is what keeps the replay from staying on screen)
        if quiet and previous.settled and not back:  # nothing moved: no redraw
            return update
        look = Look(session, set(visitor.shown.request_ids) if visitor.shown else None, _readable(backend))
        everything = fresh or quiet or back
        if states:
            return update | self._draw_fleet(backend, states, look, visitor.streaming_since, everything, now)
        return update | self._draw(backend, look, visitor.streaming_since, everything, evicted, now, stats)

    def _draw(
        self,
        backend: Backend,
        look: Look,
        streaming_since: float | None,
        everything: bool,
        evicted: list[PageEvicted],
        cursor: LiveCursor,
        stats: CacheStats,
    ) -> Update:
        """Every redrawn figure costs the browser a frame or more, and the browser's frames are what the streaming
        text needs (tools/measure.py A/B runs: with the page map and occupancy redrawn every other second while the
        text streamed, the slowest panel showed 14 updates/s; with the page map alone each second, 17-18). So while
        this visitor's text streams, only the page map is redrawn each tick, the occupancy chart every
        ``OCCUPANCY_STREAMING_S``, and the three below wait for the end. Otherwise the two in view are redrawn each
        tick and the three below take turns; once the cache settles, all are redrawn."""
        cache = self.ui.cache
        records = backend.snapshot().pages
        owners = self.ctx.visitors.owners(sorted(_requests(records)))
        views = pages.page_views(records, owners, look.session, {e.page for e in evicted}, look.decode)
        update: Update = {cache.page_map: charts.page_map(views, panel_label)}
        wall = time.monotonic()
        streaming = streaming_since is not None and not everything
        if streaming and wall - max(streaming_since or 0.0, cursor.occupancy_at) < OCCUPANCY_STREAMING_S:
            return update
        data = series.series(backend.history(0), stats, time.time())
        update[cache.occupancy] = charts.occupancy_chart(data)
        drawn = replace(cursor, occupancy_at=wall)
        if not streaming:
            if everything or cursor.tick % 3 == 0:
                update[cache.lru] = charts.lru_chart(data)
            if everything or cursor.tick % 3 == 1:
                update[cache.hit_rate] = charts.hit_rate_chart(data)
            if everything or cursor.tick % 3 == 2:
                shape = tree.prefix_tree(records, cursor.evicted, owners, look.session, look.decode, look.focus)
                update[cache.prefix_tree] = charts.prefix_tree(shape, panel_label)
                drawn = replace(drawn, evicted=())
        return update | {cache.cursor: drawn}

    def _draw_fleet(
        self,
        backend: Backend,
        states: list[fleet.ReplicaState],
        look: Look,
        streaming_since: float | None,
        everything: bool,
        cursor: LiveCursor,
    ) -> Update:
        """A fleet: each replica's page map, and occupancy and hit rate with a line per replica. The same budget
        as ``_draw``: while the visitor's text streams, the page maps each tick and occupancy every
        ``OCCUPANCY_STREAMING_S``; otherwise the two in view each tick, and the hit rate, the cached blocks and the
        prefix tree of every replica's blocks in turn; ``everything`` (a fresh page, or the fleet just settled)
        redraws all, so the lines end where the replicas' counters are."""
        cache, now, wall = self.ui.cache, time.time(), time.monotonic()
        maps: list[tuple[str, list[pages.PageView] | None]] = []
        lines: list[tuple[str, series.Series]] = []
        for replica, state in zip(backend.replicas, states, strict=True):
            if state.stats is None:
                maps.append((fleet.replica_map_title(state, None), None))
                continue
            records = replica.snapshot().pages
            owners = self.ctx.visitors.owners(sorted(_requests(records)))
            views = pages.page_views(records, owners, look.session, set(), look.decode)
            maps.append((fleet.replica_map_title(state, views), views))
            lines.append((state.name, series.series(replica.history(0), state.stats, now)))
        update: Update = {cache.page_map: fleet.replica_page_maps(maps, panel_label)}
        streaming = streaming_since is not None and not everything
        if streaming and wall - max(streaming_since or 0.0, cursor.occupancy_at) < OCCUPANCY_STREAMING_S:
            return update
        update[cache.occupancy] = fleet.replica_occupancy(lines)
        if not streaming:
            if everything or cursor.tick % 3 == 0:
                update[cache.hit_rate] = fleet.replica_hit_rates(lines)
            if everything or cursor.tick % 3 == 1:
                update[cache.lru] = fleet.replica_cached(lines)
            if everything or cursor.tick % 3 == 2:
                records = backend.snapshot().pages
                owners = self.ctx.visitors.owners(sorted(_requests(records)))
                shape = tree.prefix_tree(records, [], owners, look.session, look.decode, look.focus)
                update[cache.prefix_tree] = charts.prefix_tree(shape, panel_label)
        return update | {cache.cursor: replace(cursor, occupancy_at=wall)}

    def wire(self, demo: gr.Blocks) -> None:
        cache = self.ui.cache
        outputs: list[Block] = [cache.page_map, cache.occupancy, cache.lru, cache.hit_rate, cache.prefix_tree]
        outputs += [cache.stats, cache.cursor, *self.ui.panels.badges]
        outputs += self.teacher.banner_outputs if self.teacher is not None else []
        cache.live_charts.change(
            lambda on: gr.Timer(active=bool(on)),
            cache.live_charts,
            cache.timer,
            queue=False,
            api_visibility="private",
            **QUIET,
        )
        # Not queued: Gradio's queue holds one of its 40 job slots (``max_threads``) per event being processed, so
        # thirty waiting ticks would leave the visitors' runs ten. A plain request waits holding no slot and no
        # thread, and costs less than a queued event (no status messages); THREADS_AT_ONCE bounds its threads.
        cache.timer.tick(self.watch, cache.cursor, outputs, api_visibility="private", queue=False, **QUIET)
        # /refresh answers at once (clients and tests read the view through it; it never waits for a change)
        demo.load(self.refresh, cache.cursor, outputs, api_name="refresh", api_visibility="undocumented", **QUIET)


def _replica_states(backend: Backend) -> list[fleet.ReplicaState]:
    """Each replica of a fleet with its stats, or why it cannot be read now; [] for one cache."""
    states = []
    for replica in backend.replicas:
        try:
            stats, why = replica.stats(), None
        except BackendError as exc:
            stats, why = None, str(exc)
        states.append(fleet.ReplicaState(replica.name, replica.label, stats, why))
    return states


def _requests(records: Sequence[PageRecord]) -> set[int]:
    return {r for record in records for r in (*record.requests, record.stored_by) if r is not None}
