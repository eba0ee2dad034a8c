"""A small version of the playground load test (the full one: python -m tools.loadtest)."""

from __future__ import annotations

import json
from pathlib import Path

from astrai.playground.scenarios import LESSON, SCENARIO_BY_NAME
from tools.loadtest import SPREAD_WEIGHTS, launch_app, run_load, run_lockstep, start_app

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def test_a_classroom_spread_over_the_scenarios_completes_undisturbed_and_leaks_nothing():
    """Six users, one per scenario and one on Engine settings of its own, each moving to its scenario before every
    run: no error, no run cut short by another visitor's move, no page left on any engine."""
    ARTIFACTS.mkdir(exist_ok=True)
    with start_app(log_path=ARTIFACTS / "load-app.log") as app:
        report = run_load(
            app.url,
            clients=6,
            rounds=2,
            max_tokens=12,
            cancel_rate=0.3,
            job_timeout=120,
            spread="weighted",
            custom=1,
            app_pid=app.pid,
        )
    summary = report.summary()
    assert report.outcomes["error"] == 0 and report.outcomes["hung"] == 0, summary
    assert report.ended_by_other == [], summary
    assert report.outcomes["completed"] + report.outcomes["cancelled"] == 12, summary
    assert report.outcomes["completed"] > 0 and len(report.ttft) >= report.outcomes["completed"]
    assert set(report.clients) == {*SPREAD_WEIGHTS, "Shared system prompt (own settings)"}, report.clients
    assert set(report.engines) == {"default", "small pool", "your own settings"}, report.engines
    assert report.used_pages_after == 0, report.engines
    assert report.memory_kb["after"] > 0 and report.memory_kb["peak"] >= report.memory_kb["after"], report.memory_kb
    assert len(report.lines()) > 8


def test_a_full_queue_answers_busy_at_once_instead_of_hanging():
    with launch_app({"ASTRAI_QUEUE_SIZE": "1"}, log_path=ARTIFACTS / "busy-app.log") as url:
        report = run_load(url, clients=10, rounds=1, max_tokens=96, cancel_rate=0.0, job_timeout=120)
    summary = report.summary()
    assert report.outcomes["busy"] > 0, summary
    assert max(report.busy_answer_s) < 10, summary
    assert report.outcomes["error"] == 0 and report.outcomes["hung"] == 0, summary
    assert report.used_pages_after == 0, summary


def test_a_class_in_lockstep_reads_each_steps_promise_off_its_own_badges():
    """Three students through lesson steps 1, 8 and 10 in lockstep: each press streams, and each student's badges,
    request table and Replay my requests' table are read against the step's promise (step 1: panels 2-4 hit the
    prefix; step 8: the LRU pool evicts the system prompt, and the replay has ARC serve it twice to LRU's once;
    step 10: each panel's cause counts, exactly), with the report's figures per step and the app's memory after."""
    ARTIFACTS.mkdir(exist_ok=True)
    steps = [0, 7, 9]
    with start_app(log_path=ARTIFACTS / "lockstep-app.log") as app:
        report = run_lockstep(app.url, clients=3, steps=steps, app_pid=app.pid)  # timeouts: a busy machine is slow
    presses = [(1, 0, ("run",)), (8, 0, ("run", "replay_mine")), (10, 0, ("run",))]
    assert [(s.step, s.round, s.presses) for s in report.steps] == presses
    for index, step in zip(steps, report.steps, strict=True):
        summary = step.summary()
        assert summary["errors"] == 0, summary["error_messages"]
        assert summary["promise"] == {"kept": 3}, summary["broken"]
        assert [s.student for s in step.students] == [0, 1, 2]
        assert all(len(s.ttft) == len(s.run_s) == len(s.cached) == 1 for s in step.students)
        assert 0 < summary["ttft_p50"] <= summary["ttft_p95"] <= summary["ttft_max"] <= summary["run_max"], summary
        assert step.seconds > 0 and "engine" in step.engine
        panels = len(SCENARIO_BY_NAME[LESSON[index].scenario].prompts)
        assert all(len(s.cached[0]) == panels and None not in s.cached[0] for s in step.students), "badges read"
    assert report.memory_kb["after"] > 0 and report.memory_kb["peak"] >= report.memory_kb["after"], report.memory_kb
    lines = report.lines()
    assert any(line.startswith("1. A shared system prompt") and line.endswith("3/3") for line in lines), lines
    assert [s["promise"] for s in json.loads(json.dumps(report.as_json()))["steps"]] == [{"kept": 3}] * 3
