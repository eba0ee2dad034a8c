"""The cache-sizing lab in the playground: its lesson step says what the lab computes, the view draws what the curves
hold, a visitor's own requests replay on demand, and an engine can run under another eviction policy."""

from __future__ import annotations

import re

import pytest

from astrai.lab.replay import Replay
from astrai.lab.trace import read_trace
from astrai.playground.backends.profiles import EngineSettings
from astrai.playground.scenarios import LESSON, sizing_claim
from astrai.playground.views import charts, sizing
from astrai.playground.views.series import series
from tests.support.playground import no_progress, playground, request


@pytest.mark.slow
def test_the_lesson_step_says_what_a_fresh_replay_of_the_trace_gives():
    """The step's numbers come from the shipped curves; here they are replayed again through the pool."""
    curves = sizing.load()[0]
    at = curves.nearest(5859)
    claim = sizing_claim()
    step = next(step for step in LESSON if step.look_at == "sizing")
    assert step.text == claim and f"{at:,} blocks" in claim
    prepared = Replay(read_trace("assets/traces/conversation_trace.jsonl"))
    fresh = {policy: prepared.run(policy, at).hit_rate for policy in ("lru", "arc", "belady")}
    ceiling = prepared.run("lru", None).hit_rate
    largest = prepared.run("lru", curves.capacities[-1]).hit_rate
    for rate in (fresh["lru"], fresh["arc"], fresh["belady"], ceiling, largest):
        assert f"{rate:.1%}" in claim, (rate, claim)
    assert "ARC (the best online policy here)" in claim and fresh["arc"] > fresh["lru"]
    full = int(re.search(r"reaches that ceiling at ([\d,]+) blocks", claim).group(1).replace(",", ""))
    assert prepared.run("belady", full).hit_rate == pytest.approx(ceiling)


def test_the_chart_and_table_hold_the_curves_at_the_capacity_chosen():
    curves = sizing.load()[1]
    figure = sizing.curve_chart(curves, curves.capacities[3])
    assert {t.name for t in figure.data} == {sizing.POLICY_NAMES[p] for p in curves.policies}
    assert figure.layout.xaxis.type == "log"
    rows = sizing.rows_at(curves, curves.capacities[3])
    assert [r[0] for r in rows][0] == sizing.POLICY_NAMES["belady"], "the optimum serves the most"
    assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
    assert curves.nearest(curves.capacities[3] * 1.1) == curves.capacities[3]


def test_the_capacity_is_picked_on_a_log_scale_and_written_with_separators():
    """Issue 43: a linear slider from 1,000 to 50,000 that snapped to log-spaced points put everything interesting
    in its first 16%. The control offers the replayed capacities themselves, each written with separators."""
    curves = sizing.load()[0]
    choices = sizing.capacity_choices(curves)
    assert [value for _, value in choices] == curves.capacities
    assert [label for label, _ in choices] == [f"{c:,}" for c in curves.capacities] and choices[-1][0] == "50,000"
    ratios = [b / a for a, b in zip(curves.capacities, curves.capacities[1:], strict=False)]
    assert max(ratios) / min(ratios) < 1.01 and sizing.step_ratio(curves) == pytest.approx(ratios[0], rel=0.01)
    assert all(
        re.fullmatch(r"\d{1,3}(,\d{3})*", cell)
        for row in sizing.rows_at(curves, curves.nearest(5859))
        for cell in row[2:]
    )


def test_a_visitor_replays_their_own_requests_and_an_engine_runs_under_another_policy():
    with playground() as pg:
        session = "sizer"
        status = pg.setup.apply_settings(
            {"model": pg.ctx.engines.default.model, "page_size": 4, "n_pages": 48, "max_batch_size": 4,
             "prefix_caching": True, "dtype": "float32", "eviction": "arc"},
            request(session),
            no_progress,
        )  # fmt: skip
        assert "ARC eviction" in status[pg.ctx.ui.setup.engine.status]
        for prompt in ("Once upon a time there was a cat", "Once upon a time there was a dog", "Lily ran home"):
            for _ in pg.runs.run(
                pg.fields(n_panels=1, prompt_1=prompt, shared_prefix="", max_tokens=8), request(session)
            ):
                pass
            pg.runs.after_run(request(session))
        visitor = pg.ctx.visitors.peek(session)
        backend = pg.ctx.engines.backend(visitor.profile)
        assert backend is not None and backend.stats().eviction == "arc"
        assert "ARC queue" in charts.lru_chart(series(backend.history(0), backend.stats(), 0.0)).layout.title.text
        assert visitor.recording is not None and visitor.recording.eviction == "arc"
        update = pg.sizing.replay_mine(request(session), no_progress)
        mine = pg.ctx.visitors.peek(session).sizing
        assert mine is not None and mine.block_size == 4 and mine.requests == 3
        assert set(mine.policies) == {"lru", "fifo", "lfu", "arc", "belady"}
        assert all(p.hit_rate <= mine.ceiling + 1e-12 for p in mine.points)
        assert update[pg.ctx.ui.sizing.table] and "LRU serves" in update[pg.ctx.ui.sizing.note]
        control = update[pg.ctx.ui.sizing.capacity]  # mine's capacities; the pool's 48 pages hold all they fill
        assert [value for _, value in control.choices] == mine.capacities and control.value == mine.capacities[-1]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction must be one of"):
        EngineSettings(eviction="random").validate()
