"""A small version of the playground load test (the full one: python -m tools.loadtest)."""

from __future__ import annotations

from pathlib import Path

from tools.loadtest import launch_app, run_load

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def test_concurrent_clients_with_cancels_complete_and_leak_nothing():
    ARTIFACTS.mkdir(exist_ok=True)
    with launch_app(log_path=ARTIFACTS / "load-app.log") as url:
        report = run_load(url, clients=6, rounds=2, max_tokens=12, cancel_rate=0.3, job_timeout=120)
    summary = report.summary()
    assert report.outcomes["error"] == 0 and report.outcomes["hung"] == 0, summary
    assert report.outcomes["completed"] + report.outcomes["cancelled"] == 12, summary
    assert report.outcomes["completed"] > 0 and len(report.ttft) >= report.outcomes["completed"]
    assert report.used_pages_after == 0, summary


def test_a_full_queue_answers_busy_at_once_instead_of_hanging():
    with launch_app({"ASTRAI_QUEUE_SIZE": "1"}, log_path=ARTIFACTS / "busy-app.log") as url:
        report = run_load(url, clients=10, rounds=1, max_tokens=96, cancel_rate=0.0, job_timeout=120)
    summary = report.summary()
    assert report.outcomes["busy"] > 0, summary
    assert max(report.busy_answer_s) < 10, summary
    assert report.outcomes["error"] == 0 and report.outcomes["hung"] == 0, summary
    assert report.used_pages_after == 0, summary
