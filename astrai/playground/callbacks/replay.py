"""Replay: the visitor's last run, step by step, from its recording (never from the live engine's state)."""

from __future__ import annotations

import time

import gradio as gr

from astrai.playground.callbacks.context import QUIET, Context, Update, panel_label, session_of
from astrai.playground.callbacks.live import LiveCursor
from astrai.playground.callbacks.run import eviction_notes, follow
from astrai.playground.state import Playback, Visitor
from astrai.playground.ui.components import fixed
from astrai.playground.views import charts, fleet, pages, replay, text, tree

REAL_TIME = 1.0  # ▶ 1×: the run in its recorded time (▶ slow: ``replay.SLOW_STEPS_PER_S``)


class ReplayCallbacks:
    def __init__(self, ctx: Context):
        self.ctx, self.ui = ctx, ctx.ui

    def show_step(self, index: float | None, request: gr.Request) -> Update:
        """The visitor grabbed the slider: stop following, and show that step of their run."""
        session = session_of(request)
        visitor = self.ctx.visitors.act(session)
        visitor.following, visitor.playback = False, None  # a playing timer stops itself at its next tick
        return self._frame(visitor, session, int(index or 0))

    def step_by(self, index: float | None, delta: int, request: gr.Request) -> Update:
        return self.show_step(int(index or 0) + delta, request)

    def play(self, index: float | None, slow: bool, request: gr.Request) -> Update:
        """Play the run from the slider's step: in its recorded time, or ``slow``, ``replay.SLOW_STEPS_PER_S``."""
        visitor = self.ctx.visitors.act(session_of(request))
        frames = visitor.recording.frames if visitor.recording else []
        if not frames:
            return {}
        start = int(index or 0) % len(frames)  # at the end: start over
        pace = replay.SLOW_STEPS_PER_S if slow else None
        visitor.following, visitor.playback = False, Playback(REAL_TIME, time.monotonic(), start, pace)
        return {self.ui.replay.timer: gr.Timer(active=True)}

    def pause(self, request: gr.Request) -> Update:
        self.ctx.visitors.act(session_of(request)).playback = None
        return {self.ui.replay.timer: gr.Timer(active=False)}

    def tick(self, request: gr.Request) -> Update:
        """Advance a playing replay to the run's step whose recorded time the scaled clock has reached."""
        session = session_of(request)
        visitor = self.ctx.visitors.peek(session)
        recording, playback, timer = visitor.recording, visitor.playback, self.ui.replay.timer
        frames = recording.frames if recording else []
        if playback is None or recording is None or not frames:
            return {timer: gr.Timer(active=False)}
        start, elapsed = playback.start_index, time.monotonic() - playback.wall_start
        if playback.steps_per_s is not None:
            frame = min(len(frames), start + int(elapsed * playback.steps_per_s))
        else:
            times = [recording.samples[end - 1].time for end in frames]
            first = recording.samples[frames[0] - 1]
            origin = times[start - 1] if start else first.time - first.duration_s
            frame = max(start, sum(t <= origin + elapsed * playback.speed for t in times))
        update = self._frame(visitor, session, frame)
        if frame >= len(frames):
            visitor.playback = None
            update[timer] = gr.Timer(active=False)
        return update

    def live(self, request: gr.Request) -> Update:
        """Back to live: a new cursor (the next refresh redraws everything), and the panels show the run's text again,
        not the step replayed last (a Follow-up turn takes its answers from them)."""
        visitor = self.ctx.visitors.act(session_of(request))
        visitor.following, visitor.playback = True, None
        recording = visitor.recording
        frames = len(recording.frames) if recording else 0
        controls = self.ui.replay
        update: Update = {
            controls.timer: gr.Timer(active=False),
            controls.step: frames,
            self.ui.cache.cursor: LiveCursor(),
        }
        backend = self.ctx.engines.backend(visitor.shown.profile) if visitor.shown else None
        if recording is None or not recording.closed or backend is None or backend.generation != recording.generation:
            return update  # a run still streaming writes its own text
        special = backend.special_ids()
        texts = replay.texts_at(
            recording, recording.samples_at(frames), lambda ids: backend.decode([t for t in ids if t not in special])
        )
        return update | {box: texts[i] if i < len(texts) else "" for i, box in enumerate(self.ui.panels.outputs)}

    def page_map_at(self, index: int, request: gr.Request) -> list[dict[str, object]]:
        """The caller's recorded pool after ``index`` steps of their last run (state, refs, LRU rank), for tests."""
        recording = self.ctx.visitors.peek(session_of(request)).recording
        if recording is None:
            return []
        return [
            {"page": p.page, "state": p.state, "ref_count": p.ref_count, "lru_rank": p.lru_rank}
            for p in replay.pages_at(recording, recording.samples_at(int(index)))
        ]

    def _frame(self, visitor: Visitor, session: str, frame: int) -> Update:
        follow(self.ctx, visitor)  # a run that ended after its after_run: its last steps join now
        recording, controls, cache = visitor.recording, self.ui.replay, self.ui.cache
        if recording is None or visitor.shown is None:
            return {controls.note: "Run a batch first: its steps are recorded here."}
        backend = self.ctx.engines.backend(visitor.shown.profile)
        if backend is None or backend.generation != recording.generation:
            return {controls.note: "The engine of your last run was retired while idle: run again to record anew."}
        frame = max(0, min(frame, len(recording.frames)))
        index = recording.samples_at(frame)
        records = replay.pages_at(recording, index)
        requests = {r for p in records for r in (*p.requests, p.stored_by) if r is not None}  # ids start at 0
        owners = self.ctx.visitors.owners(sorted(requests))
        decode, special = text.readable(backend.decode, backend.special_ids()), backend.special_ids()
        data = replay.replay_series(recording, frame)
        texts = replay.texts_at(recording, index, lambda ids: backend.decode([t for t in ids if t not in special]))
        step = recording.samples[index - 1].step if index else recording.base.step
        if backend.replicas:  # a fleet: each replica's pages in its own map, as live
            n = len(backend.replicas)
            per_replica = fleet.split_pages(records, n)
            maps = [
                (replica.name, pages.page_views(mine, owners, session, set(), decode))
                for replica, mine in zip(backend.replicas, per_replica, strict=True)
            ]
            page_map = fleet.replica_page_maps(maps, panel_label, title=f"Page map per replica after step {step}")
        else:
            page_views = pages.page_views(records, owners, session, set(), decode)
            page_map = charts.page_map(
                page_views, panel_label, title=f"Page map after step {step}", no_rank=replay.no_rank(recording)
            )
        notes = eviction_notes(self.ctx, backend, recording, session)
        update: Update = {
            controls.step: frame,  # a plain value: the maximum was set when the run ended
            controls.note: f"**Replay** · {replay.narrate(recording, frame, notes)}",
            cache.page_map: page_map,
            cache.occupancy: charts.occupancy_chart(data),
            cache.lru: charts.lru_chart(data),
            cache.hit_rate: charts.hit_rate_chart(data),
            cache.prefix_tree: charts.prefix_tree(
                tree.prefix_tree(records, [], owners, session, decode, set(recording.request_ids)), panel_label
            ),
        }
        return update | {box: texts[i] if i < len(texts) else "" for i, box in enumerate(self.ui.panels.outputs)}

    def wire(self) -> None:
        controls, cache = self.ui.replay, self.ui.cache
        gr.api(self.page_map_at, api_name="page_map_at", concurrency_limit=8)
        frame = [controls.step, controls.note, cache.page_map, cache.occupancy, cache.lru, cache.hit_rate]
        frame += [cache.prefix_tree, *self.ui.panels.outputs, controls.timer]
        controls.step.input(
            self.show_step, controls.step, frame, api_name="show_step", trigger_mode="always_last", **QUIET
        )
        for button, delta in ((controls.back, -1), (controls.forward, 1)):
            button.click(fixed(self.step_by, delta=delta), controls.step, frame, api_visibility="private", **QUIET)
        for button, slow in ((controls.play_1x, False), (controls.play_slow, True)):
            play = fixed(self.play, slow=slow)
            button.click(play, controls.step, [controls.timer], api_visibility="private", **QUIET)
        controls.pause.click(self.pause, None, [controls.timer], api_visibility="private", **QUIET)
        controls.timer.tick(self.tick, None, frame, api_visibility="private", concurrency_limit=8, **QUIET)
        back_to_live = [controls.timer, controls.step, cache.cursor, *self.ui.panels.outputs]
        controls.live.click(self.live, None, back_to_live, api_visibility="private", **QUIET)
