"""The cache-sizing lab in the playground: its lesson step says what the lab computes, the view draws what the curves
hold, a visitor's own requests replay on demand, and an engine can run under another eviction policy."""

from __future__ import annotations

import re
from collections import Counter

import gradio as gr
import pytest

from astrai.lab.__main__ import main
from astrai.lab.replay import Replay
from astrai.lab.trace import TraceRequest, read_trace, write_trace
from astrai.playground.backends.profiles import EMBEDDED_LABEL, EngineSettings, Profile
from astrai.playground.scenarios import LESSON, Lesson, sizing_claim
from astrai.playground.ui.layout import build_layout
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


def test_curves_with_a_capacity_of_0_show_and_answer(tmp_path, capsys):
    """The lab accepts capacity 0 and writes it; the view places it (a log axis has no 0, so its points are in the
    table only) and finds the nearest capacity around it."""
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRequest(i, 5, 1, (1, 2, 3)) for i in range(3)], block_size=2)
    assert main([str(path), "--capacity", "0,3,4", "--json", "--processes", "1"]) == 0
    (tmp_path / "curves.json").write_text(capsys.readouterr().out)
    (curves,) = sizing.load(tmp_path / "curves.json")
    assert curves.capacities == [0, 3, 4] and curves.semantics == "engine"
    assert [curves.nearest(c) for c in (0, 0.4, 1, 3.2, 100)] == [0, 0, 0, 3, 4]
    assert sizing.step_ratio(curves) == pytest.approx(4 / 3)
    figure = sizing.curve_chart(curves, 0)
    assert all(0 not in trace.x for trace in figure.data)
    assert "pages of an engine's pool" in figure.layout.xaxis.title.text
    assert "3 of the 3 requests need more than the whole pool" in sizing.summary(curves, 0)
    assert "need more" not in sizing.summary(curves, 3)
    assert [row[1] for row in sizing.rows_at(curves, 0)] == [0.0] * len(curves.policies)


def test_every_element_id_on_the_page_names_one_element():
    """A script or a test finds a view by its id: each must name one element. Gradio writes a Group's elem_id on
    two nested elements (its outer and inner div), so no Group may carry one."""
    lesson = Lesson.for_deployment(routers=2)  # every view: the routing step's too
    with gr.Blocks() as blocks:
        build_layout(Profile(), [EMBEDDED_LABEL], False, lesson)
    written = Counter(
        block.elem_id
        for block in blocks.blocks.values()
        for _ in range(2 if isinstance(block, gr.Group) else 1)
        if getattr(block, "elem_id", None)
    )
    assert [elem_id for elem_id, count in written.items() if count > 1] == []
    assert all(step.look_at in written for step in lesson.steps)
