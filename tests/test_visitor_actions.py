"""Visitors' actions in any order, as a state machine: two or three visitors run (a run may be left streaming and
resumed later), stop, clear the cache, pick scenarios and lesson steps, apply engine settings, compare, replay,
follow up and poll the live view, on small pools where pages are evicted and requests preempted. After every action,
what one visitor does never ends or changes another's run, the counters add up on every engine, a recording holds
its own run's steps and stops growing once closed, and memory stays within its bounds.

In process, without a browser: the callbacks are called as Gradio would call them (``tests/support/playground.py``).
The engines run on their own threads meanwhile, so a run held mid-stream keeps computing while others act.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gradio as gr
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from astrai import InferenceEngine
from astrai.observation import CacheCleared
from astrai.playground import state
from astrai.playground.backends.local import LocalBackend
from astrai.playground.backends.profiles import EngineSettings, Profile
from astrai.playground.callbacks import pacing
from astrai.playground.callbacks.context import Update
from astrai.playground.scenarios import SCENARIO_BY_NAME, SCENARIOS
from astrai.playground.state import Visitors
from astrai.playground.views import replay, text, tree
from astrai.playground.views.causes import TABLE_CAUSES
from tests.support.playground import Playground, no_progress, playground, request

PER_VISITOR = {s.profile: s.profile for s in SCENARIOS if s.profile.per_visitor}  # equal settings: the same pool

VISITORS = ("ann", "ben", "cy")
EVICTION = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
SHORT_PROMPTS = ("Once upon a time", "Tom had a red ball and", "The cat sat on", "Lily went to the park. She", "A dog")
PREFIXES = ("", "Once upon a time, ")
MAX_ENGINES, MAX_CUSTOM = 5, 2  # the operator's bounds here: small, so visitors' settings reach them
# Bounds made small so that they bite within a few actions (the app reads them at each call).
KEEP_VISITORS, KEEP_RECORDINGS, KEEP_OWNERS, MAX_SAMPLES = 4, 2, 24, 40
ENDED = ("finished", "cancelled", "failed")
# What a visitor may be told instead of a run: their form asks more than their engine holds, or for an engine past
# the operator's bounds, or a comparison on an engine without caching.
REFUSALS = re.compile(
    r"tokens of KV but the whole pool holds|over max_seq_len|prompt too long|prefix caching off already|"
    r"engines for visitors' own settings are taken|already runs \d+ engines|does not fit"
)
# Where visitors arrive: tiny settings of their own (page size, pages, batch, prefix caching), pools of 64 to 256
# tokens, the tiniest most often; or the lesson's small pool (40 pages of 16 tokens).
PLACES = [(4, 16, 8, True), (4, 16, 8, True), EVICTION.name, (8, 24, 4, True), (4, 48, 2, False), (16, 16, 8, True)]
RUN_FORM = dict(
    compare=st.sampled_from([False, False, True]),
    max_tokens=st.sampled_from([2, 8, 16, 24]),
    # what the visitor typed (three or four short prompts), or None: the form as it is (a scenario's, a follow-up)
    typed=st.sampled_from([None, 0, 0]).flatmap(
        lambda keep: st.none() if keep is None else st.lists(st.sampled_from(SHORT_PROMPTS), min_size=3, max_size=4)
    ),
    prefix=st.sampled_from(PREFIXES),
    namespace=st.sampled_from([None, "shared", "mine", "fresh"]),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
)
MOVES = st.one_of(
    st.tuples(st.just("scenario"), st.sampled_from([s.name for s in SCENARIOS])),
    st.tuples(st.just("lesson"), st.sampled_from([-1, 1])),
    st.tuples(
        st.just("settings"),
        st.tuples(  # page size, pages, batch, prefix caching
            st.sampled_from([4, 8, 16]), st.sampled_from([16, 24, 40, 48]), st.sampled_from([2, 4, 8]), st.booleans()
        ),
    ),
)
SETTLE_S = 10.0  # how long an ended run's requests (or a stopped run's cancels) may take to show as ended

STEPS = settings(
    max_examples=20,
    stateful_step_count=15,
    deadline=None,
    derandomize=True,  # CI sees the same examples every time
    database=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # explain traces every line: far too slow
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(frozen=True)
class Half:
    """One batch a run submitted (a Compare submits two): its requests, and the engine that has them."""

    ids: tuple[int, ...]
    profile: Profile
    backend: LocalBackend


@dataclass
class Stream:
    """A visitor's run or compare, as the browser holds it: the generator, advanced as far as it was."""

    gen: Iterator[Update]
    max_tokens: int
    greedy: bool
    halves: list[Half] = field(default_factory=list)
    last: Update | None = None


@dataclass
class Tally:
    """What the examples did, over all of them: the test is only worth something if these happened."""

    counts: Counter[str] = field(default_factory=Counter)
    engines: dict[int, Counter[str]] = field(default_factory=dict)  # each engine's evictions and preemptions

    def totals(self) -> Counter[str]:
        return sum(self.engines.values(), Counter()) + self.counts


class Reference:
    """Greedy outputs computed alone, on an engine of the same model with no prefix cache and room to spare."""

    def __init__(self, pg: Playground):
        model = pg.ctx.engines._models[(pg.ctx.engines.default.model, "float32")]  # the playground's own model
        self.engine = InferenceEngine(
            model.model, model.tokenizer, page_size=16, n_pages=512, max_batch_size=8, prefix_caching=False,
            compile=False,
        )  # fmt: skip
        self.tokenizer = model.tokenizer
        self.outputs: dict[tuple[int, ...], tuple[int, ...]] = {}

    def check(self, infos: list[Any], max_tokens: int) -> None:
        """Each finished request's output is the reference's: the same tokens, up to max_tokens or EOS."""
        todo = [tuple(i.prompt_ids) for i in infos if tuple(i.prompt_ids) not in self.outputs]
        if todo:
            stream = self.engine.generate_ids([list(p) for p in todo], stream=True, max_tokens=24, temperature=0.0)
            for _ in stream:
                pass
            got = self.engine.request_info(stream.request_ids)
            self.outputs.update({p: tuple(i.output_ids) for p, i in zip(todo, got, strict=True)})
        for info in infos:
            want = self.outputs[tuple(info.prompt_ids)][:max_tokens]
            assert tuple(info.output_ids) == want, (info.id, info.output_ids, want)

    def shutdown(self) -> None:
        self.engine.shutdown()


@pytest.fixture(scope="module")
def pg():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (
            ("KEEP_VISITORS", KEEP_VISITORS),
            ("KEEP_POLLING", KEEP_VISITORS),
            ("KEEP_RECORDINGS", KEEP_RECORDINGS),
            ("KEEP_OWNERS", KEEP_OWNERS),
            ("COUNT_EVERY_S", 0.0),  # visitors on an engine are counted at each look: no clock in the outcome
            ("SEEN_WITHIN_S", 1e9),  # every visitor of an example is on their engine (a fresh table each example)
        ):
            patch.setattr(state, name, value)
        patch.setattr(replay, "MAX_SAMPLES", MAX_SAMPLES)
        # every text delta is a message: a run held after k messages is held after k deltas, whatever the clock
        patch.setattr(pacing, "TEXT_EVERY_S", 0.0)
        patch.setattr(pacing, "MESSAGES_PER_S", math.inf)
        with playground(max_engines=MAX_ENGINES, max_custom=MAX_CUSTOM) as pg:
            yield pg


_examples = itertools.count()


def ended(backend: LocalBackend, ids: tuple[int, ...]) -> bool:
    infos = backend.request_info(list(ids))
    return len(infos) < len(ids) or all(i.status in ENDED for i in infos)


def settle(backend: LocalBackend, ids: tuple[int, ...]) -> list[Any]:
    """The requests' infos once every one has ended (a cancel lands at the engine's next step)."""
    deadline = time.monotonic() + SETTLE_S
    while not ended(backend, ids):
        assert time.monotonic() < deadline, f"requests {ids} never ended: {backend.request_info(list(ids))}"
        time.sleep(0.01)
    return backend.request_info(list(ids))


class VisitorActions(RuleBasedStateMachine):
    def __init__(self, pg: Playground, reference: Reference, tally: Tally):
        super().__init__()
        self.pg, self.ui, self.reference, self.tally = pg, pg.ctx.ui, reference, tally
        example = next(_examples)
        tally.counts["examples"] += 1
        # a fresh table: the visitors of earlier examples have left (their sessions are never seen again)
        object.__setattr__(pg.ctx, "visitors", Visitors(pg.ctx.engines.default))
        default = pg.ctx.engines.backend(pg.ctx.engines.default)
        assert default is not None
        default.clear()  # and every example starts on a cold default engine
        self.session = {v: f"x{example}-{v}" for v in VISITORS}
        self.tourists = (f"x{example}-tourist-{i}" for i in itertools.count())
        fields = self.ui.run_fields()
        self.field_of = {component: name for name, component in fields.items()}
        self.field_of |= {box: f"output_{i + 1}" for i, box in enumerate(self.ui.panels.outputs)}
        self.form = {
            v: pg.fields() | {f"output_{i + 1}": "" for i in range(len(self.ui.panels.outputs))} for v in VISITORS
        }
        self.lesson_step = dict.fromkeys(VISITORS, 0)
        self.slider = dict.fromkeys(VISITORS, 0)
        self.cursor: dict[str, Any] = dict.fromkeys(VISITORS)
        self.streams: dict[str, Stream] = {}
        self.mine: dict[str, set[int]] = {v: set() for v in VISITORS}  # every request each visitor submitted
        self.profile = dict.fromkeys(VISITORS, pg.ctx.engines.default)  # where each visitor's moves put them
        self.closed: dict[tuple[int, ...], int] = {}  # a closed recording (by its requests) -> its samples
        self.seen: dict[str, tuple[Any, ...]] = {}  # each visitor's state as the last action left it
        self.actors: set[str] = set()  # who acted in the last rule

    # ----- helpers ----------------------------------------------------------------------------------------------
    def req(self, v: str) -> Any:
        return request(self.session[v])

    def visitor(self, v: str) -> state.Visitor | None:
        """The visitor's state in the table, None when never seen or forgotten (``KEEP_VISITORS``)."""
        return self.pg.ctx.visitors._visitors.get(self.session[v])

    def absorb(self, v: str, update: Update) -> None:
        """What the browser does with a callback's update: the form's fields take the new values."""
        for component, value in update.items():
            if component in self.field_of and not isinstance(value, gr.components.Component):
                self.form[v][self.field_of[component]] = value
        if self.ui.setup.lesson_step in update:
            self.lesson_step[v] = update[self.ui.setup.lesson_step]
        if self.ui.cache.cursor in update:
            self.cursor[v] = update[self.ui.cache.cursor]
        step = update.get(self.ui.replay.step)
        if isinstance(step, int):
            self.slider[v] = step
        elif isinstance(step, gr.Slider) and isinstance(step.value, int | float):
            self.slider[v] = int(step.value)

    def advance(self, v: str, steps: int) -> None:
        """Resume ``v``'s run for ``steps`` messages (or to its end); then the browser's after_run, if it ended."""
        stream = self.streams[v]
        try:
            for _ in range(steps):
                update = next(stream.gen)
                self.note_halves(v, stream)
                stream.last = update
                self.absorb(v, update)  # the panels' text: what Follow-up turn appends
        except StopIteration:
            self.end(v, stream, refused=None)
        except gr.Error as exc:
            self.end(v, stream, refused=str(exc))

    def note_halves(self, v: str, stream: Stream) -> None:
        """A run that just submitted a batch (the message after its submission): its requests, and the engine that
        has them (held by the run now). Each batch acts as the visitor, so their state in the table shows it, even
        if the table forgot them since the run's last batch (then the run writes a new record)."""
        visitor = self.visitor(v)
        shown = visitor.shown if visitor else None
        if shown is None or set(shown.request_ids) <= self.mine[v]:
            return  # no new batch: this message is one of the batch already noted
        backend = self.pg.ctx.engines.backend(shown.profile)
        assert backend is not None, "an engine a run holds is never retired"
        if stream.halves and stream.last is not None:  # the first half ended with the message before
            self.check_texts(stream.halves[-1], stream.last)
        stream.halves.append(Half(shown.request_ids, shown.profile, backend))
        self.mine[v] |= set(shown.request_ids)

    def end(self, v: str, stream: Stream, refused: str | None) -> None:
        del self.streams[v]
        if refused is not None:
            assert REFUSALS.search(refused), f"{v}'s run ended with an error: {refused}"
            self.tally.counts["refused"] += 1
        for i, half in enumerate(stream.halves):
            infos = settle(half.backend, half.ids)
            statuses = {info.status for info in infos}
            assert statuses <= {"finished"}, f"{v}'s run, never stopped, ended {statuses}"
            if stream.greedy:
                self.reference.check(infos, stream.max_tokens)
            if i == len(stream.halves) - 1 and stream.last is not None:  # a refused second half: the first's end
                self.check_texts(half, stream.last)
        if stream.halves and refused is None:
            self.tally.counts["runs finished"] += 1
        self.after_run(v)

    def check_texts(self, half: Half, update: Update) -> None:
        """The panels' final text is the engine's output, token for token."""
        tokenizer = half.backend._engine.tokenizer
        infos = {info.id: info for info in half.backend.request_info(list(half.ids))}
        for i, rid in enumerate(half.ids):
            want = tokenizer.decode(list(infos[rid].output_ids), skip_special_tokens=True)
            assert update[self.ui.panels.outputs[i]] == want, (rid, update[self.ui.panels.outputs[i]], want)

    def after_run(self, v: str) -> None:
        update = self.pg.runs.after_run(self.req(v))
        self.absorb(v, update)
        visitor = self.visitor(v)
        shown = visitor.shown if visitor else None
        if shown is None:
            return
        panels = self.ui.panels
        # after a Compare each badge tells both halves, labelled, and the tokens are coloured by the caching-on half
        halves = [(shown, "")]
        if shown.caching_on_half is not None:
            halves = [(shown.caching_on_half, "**Caching on:**"), (shown, "**Caching off:**")]
        for run, label in halves:
            backend = self.pg.ctx.engines.backend(run.profile)
            infos = backend.request_info(list(run.request_ids)) if backend else []
            for i, info in enumerate(infos):
                badge = next((line for line in update[panels.badges[i]].split("  \n") if line.startswith(label)), "")
                assert f"**{info.prompt_tokens}** prompt tokens" in badge, (label, update[panels.badges[i]])
                cached = re.search(r"\*\*(\d+)\*\* cached", badge)
                if cached:
                    assert int(cached.group(1)) == info.cached_tokens <= info.prompt_tokens - 1, (badge, info)
                if run is not halves[0][0]:
                    continue
                runs = re.findall(r'data-cause="(\w+)" data-tokens="(\d+)"', update[panels.highlights[i]] or "")
                if info.cached_tokens is not None and runs:  # every prompt token has one cause, cached ones first
                    labels = [cause for cause, n in runs for _ in range(int(n))]
                    assert len(labels) == min(info.prompt_tokens, text.MAX_HIGHLIGHT_TOKENS), runs
                    cached_n = min(info.cached_tokens, len(labels)) if run.caching else 0
                    assert labels[:cached_n] == ["cached"] * cached_n and "cached" not in labels[cached_n:], labels
                elif info.cached_tokens is None:
                    assert not runs, "a request not looked up yet has no causes to show"
        for row in update.get(self.ui.cache.table, []):  # none when the run's engine was retired
            prompt, cached = row[3], row[4]
            assert cached == "off" or cached is None or 0 <= cached < prompt, row
            by_cause = [n for n in row[4 : 4 + len(TABLE_CAUSES)] if isinstance(n, int)]
            assert cached is None or sum(by_cause) == prompt or not by_cause[1:], ("the causes add up", row)
        if visitor is not None and visitor.with_cache is not None:
            on = visitor.with_cache
            served = on.prompt_tokens - on.computed_tokens + (on.recomputed_tokens or 0)
            assert 0 <= served < on.prompt_tokens or on.prompt_tokens == 0, on

    def state_of(self, v: str) -> tuple[Any, ...]:
        """What another visitor's action must leave alone: where ``v`` is, what they were shown, and their replay
        (which may only be dropped, by ``KEEP_RECORDINGS``)."""
        visitor = self.visitor(v)
        if visitor is None:
            return (None,)
        recording = visitor.recording
        recorded = None if recording is None else (recording.request_ids, len(recording.samples), recording.closed)
        shown = visitor.shown.request_ids if visitor.shown else None
        return visitor.profile, shown, recorded

    def others_on(self, profile: Profile, v: str) -> tuple[bool, bool]:
        """Whether another visitor is on ``profile``'s engine: (surely, maybe). Surely: their view is on it, or their
        run streams there; maybe: their run on it has ended, but its generator has not been resumed to see it."""
        visitors = self.pg.ctx.visitors
        me = self.session[v]
        viewing = {s for s, visitor in visitors._visitors.items() if visitor.profile == profile}
        if profile == self.pg.ctx.engines.default:
            viewing |= set(visitors._polling)
        surely, maybe = bool(viewing - {me}), False
        for other, stream in self.streams.items():
            if other == v or not stream.halves or stream.halves[-1].profile != profile:
                continue
            if ended(stream.halves[-1].backend, stream.halves[-1].ids):
                maybe = True
            else:
                surely = True
        return surely, maybe

    # ----- rules ------------------------------------------------------------------------------------------------
    @initialize(
        places=st.lists(st.sampled_from(PLACES), min_size=len(VISITORS), max_size=len(VISITORS)),
        shares=st.lists(st.booleans(), min_size=len(VISITORS), max_size=len(VISITORS)),
    )
    def arrive(self, places, shares):
        """Each visitor opens the page, says whether the lesson's small pools are their own or the one shared with
        everyone, and goes where the pages are few: the small pool, or tiny settings."""
        self.actors = set(VISITORS)
        for v, place, share in zip(VISITORS, places, shares, strict=True):
            if share:
                self.pg.setup.share_pools(True, self.req(v), no_progress)
            if isinstance(place, str):
                self.go(v, place)
            else:
                self.settle_on(v, *place)

    def go(self, v: str, name: str) -> None:
        update = self.pg.setup.load_scenario(name, self.req(v), no_progress)
        self.moved(v, update, SCENARIO_BY_NAME[name].profile)

    # The rules draw nothing from the machine's state (which visitor streams can depend on the engine's pace): a rule
    # that does not apply is what the browser does then (Run while one's run streams: ignored, Gradio's trigger mode).
    @rule(
        v=st.sampled_from(VISITORS),
        steps=st.sampled_from([1, 2, 3]),
        then=st.sampled_from(["hold", "hold", "stop"]),
        **RUN_FORM,
    )
    def run_and_hold(self, v, steps, then, **form):
        """Run (or Compare), and the browser holds the stream after a message or three: it is resumed later, or
        stopped, while the others act; or the visitor presses Stop at once."""
        if v in self.streams:
            return
        self.start(v, steps, **form)
        if then == "stop" and v in self.streams:
            self.stop_run(v)

    @rule(v=st.sampled_from(VISITORS), **RUN_FORM)
    def run_through(self, v, **form):
        """Run (or Compare) to the end, then the browser's after_run."""
        if v not in self.streams:
            self.start(v, 1000, **form)

    def start(self, v, steps, compare, max_tokens, typed, prefix, namespace, temperature):
        """Run (or Compare: the batch on the visitor's engine, then on one like it without caching) with the form as
        it is or as the visitor typed it; held after ``steps`` messages."""
        form = self.form[v]
        if typed is not None:
            form |= {"n_panels": len(typed), "shared_prefix": prefix}
            form |= {f"prompt_{i + 1}": typed[i] if i < len(typed) else "" for i in range(len(self.ui.panels.prompts))}
        if namespace is not None:
            form["cache_namespace"] = namespace
        form |= {"max_tokens": max_tokens, "temperature": temperature, "seed": 7}
        self.actors = {v}
        fields = {name: form[name] for name in self.ui.run_fields()}
        gen = (self.pg.runs.compare if compare else self.pg.runs.run)(fields, self.req(v))
        self.streams[v] = Stream(gen, max_tokens, greedy=temperature == 0.0)
        self.tally.counts["compares" if compare else "runs"] += 1
        self.advance(v, steps)
        if v in self.streams:
            self.tally.counts["held"] += 1

    @rule(v=st.sampled_from(VISITORS), steps=st.sampled_from([1, 3, 1000]))
    def resume(self, v, steps):
        """A held run's browser reads on (to its end, at most): ``v``'s, or else the first visitor's who holds one."""
        held = [v] if v in self.streams else sorted(self.streams)
        if held:
            self.actors = {held[0]}
            self.tally.counts["resumed"] += 1
            self.advance(held[0], steps)

    @rule(v=st.sampled_from(VISITORS))
    def stop(self, v):
        """Stop: Gradio cancels the visitor's run (its generator is closed), if one streams, then runs after_run."""
        self.actors = {v}
        if v in self.streams:
            self.stop_run(v)
        else:
            self.after_run(v)

    def stop_run(self, v: str) -> None:
        stream = self.streams.pop(v)
        stream.gen.close()
        for half in stream.halves:
            statuses = {info.status for info in settle(half.backend, half.ids)}
            assert statuses <= {"finished", "cancelled"}, f"{v}'s stopped run ended {statuses}"
            self.tally.counts["cancelled"] += "cancelled" in statuses
            end = max(info.ended_step for info in half.backend.request_info(list(half.ids)))
            deadline = time.monotonic() + SETTLE_S
            while half.backend.stats().steps < end:  # the step that records the end comes at once
                assert time.monotonic() < deadline, f"{v}'s stopped run: step {end}, its end, never came"
                time.sleep(0.01)
        self.after_run(v)

    @rule(v=st.sampled_from(VISITORS))
    def clear_cache(self, v):
        """Clear cache: refused while another visitor is on the engine, done otherwise."""
        self.actors = {v}
        visitor = self.visitor(v)
        profile = visitor.profile if visitor else self.pg.ctx.engines.default
        backend = self.pg.ctx.engines.backend(profile)
        seq = backend.events(0)[-1].seq if backend and backend.events(0) else 0
        self.pg.runs.clear_cache(self.req(v))
        surely, maybe = self.others_on(profile, v)
        if backend is None:  # retired: Clear built it again, or was refused a build past the bounds
            return
        cleared = any(isinstance(e, CacheCleared) for e in backend.events(seq))
        if surely:
            assert not cleared, f"{v} cleared {profile.name} under another visitor"
        elif not maybe:
            assert cleared, f"{v}, alone on {profile.name}, could not clear it"
        self.tally.counts["cleared" if cleared else "clear refused"] += 1

    @rule(v=st.sampled_from(VISITORS), to=MOVES)
    def move(self, v, to):
        """Pick a scenario, step through the lesson, or apply Engine settings (tiny pools: a 40-page one of 16 tokens,
        batch 8, is the small-pool scenario's)."""
        self.actors = {v}
        how, where = to
        if how == "scenario":
            self.go(v, where)
        elif how == "lesson":
            update = self.pg.setup.lesson(self.lesson_step[v], where, self.req(v), no_progress)
            if self.ui.setup.scenario in update:
                self.moved(v, update, SCENARIO_BY_NAME[update[self.ui.setup.scenario]].profile)
            else:  # the lesson's end: no scenario, so nobody moves
                self.absorb(v, update)
        else:
            self.settle_on(v, *where)

    def settle_on(self, v: str, page_size: int, n_pages: int, max_batch_size: int, prefix_caching: bool) -> None:
        values = {"model": self.pg.ctx.engines.default.model, "page_size": page_size, "n_pages": n_pages,
                  "max_batch_size": max_batch_size, "prefix_caching": prefix_caching, "dtype": "float32"}  # fmt: skip
        update = self.pg.setup.apply_settings(values, self.req(v), no_progress)
        settings_ = EngineSettings(page_size, n_pages, max_batch_size, prefix_caching)
        self.moved(v, update, Profile(self.pg.ctx.engines.default.model, settings_))

    def moved(self, v: str, update: Update, profile: Profile) -> None:
        self.absorb(v, update)
        status = update[self.ui.setup.engine.status]
        if status.startswith("✅"):
            profile = PER_VISITOR.get(profile, profile)
            visitor = self.visitor(v)
            assert visitor is not None
            if profile.per_visitor and not visitor.shared_pools and "You share this pool" not in status:
                profile = self.pg.ctx.engines.own(profile, self.session[v])  # a pool of their own
            self.profile[v] = profile
            self.tally.counts["moved"] += 1
        else:
            assert "You stay on" in status and REFUSALS.search(status), status
            self.tally.counts["move refused"] += 1

    @rule(
        v=st.sampled_from(VISITORS),
        action=st.sampled_from(["show", "back", "forward", "live", "play", "play slowly"]),
        at=st.integers(0, 30),
    )
    def replay(self, v, action, at):
        self.actors = {v}
        req = self.req(v)
        if action == "show":
            update = self.pg.replays.show_step(at, req)
        elif action in ("back", "forward"):
            update = self.pg.replays.step_by(self.slider[v], -1 if action == "back" else 1, req)
        elif action == "live":
            update = self.pg.replays.live(req)
        else:
            self.pg.replays.play(self.slider[v], action == "play slowly", req)
            update = self.pg.replays.tick(req)
        self.absorb(v, update)
        visitor = self.visitor(v)
        recording = visitor.recording if visitor else None
        if recording is not None and visitor is not None and visitor.shown is not None:
            pages = self.pg.replays.page_map_at(at, req)
            assert len(pages) == visitor.shown.profile.settings.n_pages  # the recorded pool is the whole pool
            assert all((p["state"] == "in_use") == (p["ref_count"] > 0) for p in pages), pages
            self.tally.counts["replayed"] += 1

    @rule(v=st.sampled_from(VISITORS))
    def follow_up(self, v):
        """Follow-up turn: each prompt becomes prompt + answer + " Then" (its own answers; an empty one is kept)."""
        self.actors = {v}
        form = self.form[v]
        n = int(form["n_panels"])
        values = {"n_panels": n} | {f"prompt_{i + 1}": form[f"prompt_{i + 1}"] for i in range(n)}
        values |= {f"output_{i + 1}": form[f"output_{i + 1}"] for i in range(n)}
        self.absorb(v, self.pg.runs.follow_up(values))

    @rule(v=st.sampled_from(VISITORS))
    def poll(self, v):
        """The live view's tick, the engine held still for it: its stats line and its tree count the same pages."""
        self.actors = set()  # a poll is nobody's action: it changes nothing
        visitor = self.pg.ctx.visitors.peek(self.session[v])
        backend = self.pg.ctx.engines.backend(visitor.profile)
        with backend._engine._lock if backend else contextlib.nullcontext():
            update = self.pg.live.refresh(self.cursor[v], self.req(v))
        self.absorb(v, update)
        line = update[self.ui.cache.stats]
        figure = update.get(self.ui.cache.prefix_tree)
        if figure is not None:
            cached = re.search(r"\*\*(\d+)\*\* cached", line)
            drawn = re.search(r"\((\d+) in use, (\d+) cached\)", figure.layout.title.text)
            assert cached and drawn and cached.group(1) == drawn.group(2), (line, figure.layout.title.text)
            self.tally.counts["trees"] += 1

    @rule(what=st.sampled_from(["tourist", "time passes"]))
    def meanwhile(self, what):
        """Someone new opens the page and picks the small pool (the table may forget the least recently active); or
        time passes, and every engine no run holds has been idle long enough: retired (the default engine stays)."""
        self.actors = set()
        if what == "tourist":
            self.pg.setup.load_scenario(EVICTION.name, request(next(self.tourists)), no_progress)
        else:
            retire(self.pg, self.tally)

    # ----- invariants -------------------------------------------------------------------------------------------
    @invariant()
    def nobody_else_changed_a_visitor(self):
        self.tally.counts["steps"] += 1
        for v in VISITORS:
            now = self.state_of(v)
            before = self.seen.get(v)
            if before is not None and v not in self.actors and now != before and now != (None,):
                profile, shown, recorded = before
                # another's action may only drop a replay (KEEP_RECORDINGS), never change one
                assert now == (profile, shown, None), (
                    f"{self.actors or 'nobody'}'s action changed {v}: {before} -> {now}"
                )
            self.seen[v] = now
        self.actors = set()

    @invariant()
    def where_visitors_are(self):
        for v in VISITORS:
            visitor = self.visitor(v)
            if visitor is None:
                self.profile[v] = self.pg.ctx.engines.default  # forgotten: a new visitor starts on the default
            else:
                assert visitor.profile == self.profile[v], (v, visitor.profile, self.profile[v])

    @invariant()
    def held_runs_keep_running(self):
        """A run held mid-stream is never ended by anyone but its visitor: its requests wait, run or finish."""
        for v, stream in self.streams.items():
            for half in stream.halves:
                for info in half.backend.request_info(list(half.ids)):
                    assert info.status in ("waiting", "running", "finished"), (v, info)

    @invariant()
    def counters_hold(self):
        for profile in self.pg.ctx.engines.built():
            backend = self.pg.ctx.engines.backend(profile)
            if backend is None:
                continue
            engine = backend._engine
            with engine._lock:  # the engine's loop waits: the pool, its counters and its pages are read at once
                engine.pool.check_invariants()
                stats, snapshot = backend.stats(), backend.snapshot()
            assert stats.free_pages + stats.used_pages + stats.cached_pages == stats.n_pages, stats
            assert stats.hit_tokens <= stats.query_tokens, stats
            assert stats.readmitted_hit_tokens <= stats.readmitted_query_tokens, stats
            if not stats.prefix_caching:
                assert stats.query_tokens == stats.hit_tokens == stats.cached_pages == 0, stats
            shape = tree.prefix_tree(snapshot.pages, [], {}, "", lambda ids: "")
            line = text.stats_line(stats)
            assert f"**{shape.cached}** cached" in line, (shape.cached, line)
            assert shape.pages == shape.cached + shape.in_use and shape.in_use <= stats.used_pages
            self.tally.engines[backend.generation] = Counter(evictions=stats.evictions, preemptions=stats.preemptions)
        for v in VISITORS:  # every request of every visitor, wherever it ran
            visitor = self.visitor(v)
            if visitor is None or visitor.shown is None:
                continue
            backend = self.pg.ctx.engines.backend(visitor.shown.profile)
            for info in backend.request_info(list(visitor.shown.request_ids)) if backend else []:
                assert info.cached_tokens is None or 0 <= info.cached_tokens <= info.prompt_tokens - 1, info
                if not visitor.shown.caching:
                    assert not info.cached_tokens, info

    @invariant()
    def recordings_hold_their_runs(self):
        for v in VISITORS:
            visitor = self.visitor(v)
            recording = visitor.recording if visitor else None
            if recording is None or visitor is None:
                continue
            assert visitor.shown is not None and recording.request_ids == visitor.shown.request_ids
            assert set(recording.request_ids) <= self.mine[v], "a recording of another visitor's run"
            assert len(recording.samples) <= replay.MAX_SAMPLES
            steps = [s.step for s in recording.samples]
            assert steps == list(range(recording.base.step + 1, recording.base.step + 1 + len(steps))), steps
            mine = set(recording.request_ids)
            frames = recording.frames
            for k, end in enumerate(frames):
                closing = recording.closed and k == len(frames) - 1 and end == len(recording.samples)
                assert closing or mine & set(recording.samples[end - 1].requests), (v, end)
            if recording.closed or recording.request_ids in self.closed:
                kept = self.closed.setdefault(recording.request_ids, len(recording.samples))
                assert recording.closed, f"{v}'s recording was closed, and is open again"
                assert len(recording.samples) == kept, f"{v}'s closed recording grew from {kept} samples"
                backend = self.pg.ctx.engines.backend(visitor.shown.profile)
                infos = backend.request_info(list(mine)) if backend else []
                ends = [i.ended_step for i in infos]
                if len(infos) == len(mine) and None not in ends and len(steps) < replay.MAX_SAMPLES:
                    assert steps and steps[-1] == max(ends), f"{v}'s recording went past its run's end"  # type: ignore[type-var]

    @invariant()
    def memory_is_bounded(self):
        visitors = self.pg.ctx.visitors
        assert len(visitors._visitors) <= state.KEEP_VISITORS
        assert len(visitors._polling) <= state.KEEP_POLLING
        assert len(visitors._owners) <= state.KEEP_OWNERS
        recordings = [v.recording for v in visitors._visitors.values() if v.recording is not None]
        assert len(recordings) <= state.KEEP_RECORDINGS
        streaming = {self.session[v] for v in self.streams}
        assert all(runs > 0 and session in streaming for (_, session), runs in visitors._runs.items())
        assert self.pg.ctx.runs._active <= len(self.streams)
        engines = self.pg.ctx.engines
        built = [p for p in engines.built() if p.owner is None]  # engines; visitors' own pools are in the reserve
        assert len(built) <= MAX_ENGINES and sum(p.custom for p in built) <= MAX_CUSTOM, built
        own = [p for p in engines.built() if p.owner is not None]
        assert sum(p.settings.n_pages for p in own) <= engines._tenant_pages, own

    def teardown(self):
        """Every tab reads its held run to the end (checked as any run's end), then closes; idle engines retire.
        After a failure (hypothesis tears down in a ``finally``), only the closing: the failure's report stands."""
        failing = sys.exc_info()[0] is not None
        try:
            if not failing:
                for v in list(self.streams):
                    self.actors = {v}
                    self.advance(v, 10**6)
                    self.nobody_else_changed_a_visitor()
                self.counters_hold()
                self.recordings_hold_their_runs()
                self.memory_is_bounded()
                assert not self.pg.ctx.visitors._runs and not self.pg.ctx.runs._active
        finally:  # after a failure: the tabs close (their runs are cancelled)
            for stream in self.streams.values():
                stream.gen.close()
            self.streams.clear()
            retire(self.pg, self.tally)


def retire(pg: Playground, tally: Tally) -> None:
    """Retire every idle engine but the default one, as ``idle_retire_s`` of idleness would."""
    engines = pg.ctx.engines
    before = len(engines.built())
    engines._idle_retire_s = 0.0
    try:
        engines.backend(engines.default)  # any look retires the idle ones
    finally:
        engines._idle_retire_s = 3600.0
    tally.counts["retired"] += before - len(engines.built())


@pytest.mark.slow
@pytest.mark.timeout(900)  # passing, a minute or two; failing, hypothesis shrinks for up to five minutes more
def test_visitor_actions(pg):
    reference, tally = Reference(pg), Tally()
    try:
        run_state_machine_as_test(lambda: VisitorActions(pg, reference, tally), settings=STEPS)
    finally:
        reference.shutdown()
    totals = tally.totals()
    print(dict(totals))
    # the machine is only worth something if the hard cases happened
    for what in ("held", "resumed", "cancelled", "cleared", "clear refused", "evictions", "preemptions",
                 "runs finished"):  # fmt: skip
        assert totals[what], (what, dict(totals))


def test_settings_refused_past_the_bound_say_so_and_leave_the_visitor_where_they_were():
    """Found by the machine: past the operator's bound on visitors' own engines, Apply settings left the visitor on
    their engine but its status said "✅ You are on the “your own settings” engine" with the refused settings."""
    with playground(max_custom=1) as pg:
        model = pg.ctx.engines.default.model
        mine = {"model": model, "page_size": 4, "n_pages": 16, "max_batch_size": 2, "prefix_caching": True}
        pg.setup.apply_settings(mine | {"dtype": "float32"}, request("first"), no_progress)
        before = pg.ctx.visitors.peek("second").profile
        update = pg.setup.apply_settings(mine | {"n_pages": 24, "dtype": "float32"}, request("second"), no_progress)
        status = update[pg.ctx.ui.setup.engine.status]
        assert pg.ctx.visitors.peek("second").profile == before, "refused: the visitor stays"
        assert "You stay on" in status and "✅" not in status, status


def test_a_run_stopped_before_its_first_step_has_its_end_recorded():
    """Found by the machine: a request cancelled while it waited (never admitted, no page to give back) got the next
    step as its ``ended_step``, but the idle engine recorded no step: Stop's after_run waited ``END_WAIT_S`` for it in
    vain, the replay stayed open, and whatever step came next, another visitor's, joined the recording as its end."""
    with playground() as pg:
        session = "stops-at-once"
        backend = pg.ctx.engines.backend(pg.ctx.engines.default)
        assert backend is not None
        with backend._engine._lock:  # the engine cannot admit the request before it is cancelled
            stream = pg.runs.run(pg.fields(max_tokens=2, n_panels=1), request(session))
            next(stream)
            stream.close()  # Stop
        shown = pg.ctx.visitors.peek(session).shown
        assert shown is not None
        deadline = time.monotonic() + 10
        while backend.request_info(list(shown.request_ids))[0].status != "cancelled":  # at the engine's next loop
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pg.runs.after_run(request(session))
        [info] = backend.request_info(list(shown.request_ids))
        assert backend.stats().steps >= info.ended_step, "the step that records its end came"
        recording = pg.ctx.visitors.peek(session).recording
        assert recording is not None and recording.closed, "the run ended, and its end is recorded"
        assert recording.samples[-1].step == info.ended_step
