"""A small soak of the app (the full one: python -m tools.soak_app): the report's figures, and what fails it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from transformers import AutoTokenizer

from astrai.explain import Cause
from astrai.playground.backends.profiles import EMBEDDED_MODEL, Profile
from astrai.playground.promises import Panel
from astrai.playground.scenarios import SCENARIO_BY_NAME
from tools.loadtest import start_app
from tools.soak_app import AppSoakReport, fresh_prompts, run_app_soak, unexplained, unknown_tokens

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


def test_a_small_soak_of_the_app_reports_its_figures():
    """Three visitors, six runs over the lesson's steps, some on never-seen prompts: every visitor connected, every
    run read back explained, no unknown token on a never-seen prompt, and the memory sampled every two runs."""
    ARTIFACTS.mkdir(exist_ok=True)
    with start_app(log_path=ARTIFACTS / "soak-app.log") as app:
        report = run_app_soak(app.url, visitors=3, runs=6, concurrent=3, max_tokens=8, app_pid=app.pid, sample_every=2)
    summary = json.loads(json.dumps(report.as_json()))
    assert report.ok and summary["ok"], summary
    assert summary["visitors"] == 3 and summary["runs"] == 6 and summary["errors"] == 0, summary
    assert 0 < summary["never_seen_runs"] < 6, summary  # seed 0 mixes both kinds
    assert summary["panels"] >= 6 and 0 < summary["never_seen_panels"] < summary["panels"], summary
    assert summary["unexplained_panels"] == 0 and summary["unknown_never_seen"] == 0, summary
    assert sum(step["runs"] for step in summary["steps"].values()) == 6, summary["steps"]
    assert [runs for runs, _ in summary["memory_mib"]] == [0, 2, 4, 6], summary["memory_mib"]
    assert all(mib > 0 for _, mib in summary["memory_mib"]) and summary["peak_mib"] > 0, summary
    warm = summary["after_warm_up"]
    assert warm["from_runs"] == 2 and warm["min_mib"] <= warm["to_mib"] <= warm["max_mib"], warm
    assert 0 < summary["ttft_p50"] <= summary["ttft_p95"] and summary["runs_per_s"] > 0, summary
    assert report.lines()[-1] == "OK"


def test_unknown_tokens_on_a_never_seen_prompt_fail_the_soak():
    new = Panel(20, 0, {Cause.NEW: 16, Cause.PARTIAL_PAGE: 3, Cause.LAST_TOKEN: 1})
    unknown = Panel(20, 0, {Cause.NEW: 13, Cause.UNKNOWN: 3, Cause.PARTIAL_PAGE: 3, Cause.LAST_TOKEN: 1})
    assert unknown_tokens((new,)) == 0 and unknown_tokens((new, unknown, unknown)) == 6
    assert unexplained((new, unknown)) == 0
    assert unexplained((Panel(20, 0, {Cause.CACHED: 0}),)) == 1  # a row with the cached tokens alone
    report = AppSoakReport(visitors=1, planned_runs=1, sessions={"a"}, runs=1)
    assert report.ok and report.lines()[-1] == "OK"
    report.unknown_never_seen = unknown_tokens((unknown,))
    assert not report.ok and report.lines()[-1] == "FAILED"


def test_memory_after_warm_up_is_read_from_the_fifth_of_the_runs_on():
    mib = 1024
    report = AppSoakReport(visitors=1, planned_runs=100)
    report.memory_kb = [(0, 100 * mib), (10, 190 * mib), (20, 200 * mib), (60, 210 * mib), (100, 205 * mib)]
    assert report.warm_up() == dict(
        from_runs=20, from_mib=200.0, to_mib=205.0, growth_mib=5.0, growth_pct=2.5, min_mib=200.0, max_mib=210.0
    )
    report.memory_kb = report.memory_kb[:3]
    assert report.warm_up() is None


def test_never_seen_prompts_differ_within_their_first_page():
    """Each fresh prompt's first page (the start token and 15 more) is its own: across panels and visits."""
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    page = Profile().settings.page_size
    scenario = SCENARIO_BY_NAME["Shared system prompt"]
    shape = [scenario.prefix + p for p in scenario.prompts]
    prompts = [p for visit in (1, 2, 10) for p in fresh_prompts(0xABC, visit, shape, random.Random(visit))]
    first_pages = {tuple(tokenizer(p).input_ids[:page]) for p in prompts}
    assert len(first_pages) == len(prompts) == 12
    assert all(len(p.split()) == len(s.split()) + 1 for p, s in zip(prompts, shape * 3, strict=True))
