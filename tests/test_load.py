"""A small version of the playground load test (the full one: python -m tools.loadtest)."""

from __future__ import annotations

from pathlib import Path

from tools.loadtest import SPREAD_WEIGHTS, launch_app, run_load, start_app

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
