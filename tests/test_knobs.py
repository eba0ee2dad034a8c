"""The operator's environment knobs: each reaches what it sets, and one out of its range stops the app at start
with one line, not a traceback (astrai/playground/knobs.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_the_operator_sets_how_many_runs_stream_at_once_and_the_default_batch():
    code = "from astrai.playground import knobs; print(knobs.RUN_CONCURRENCY, knobs.MAX_BATCH_SIZE)"
    assert python(code, ASTRAI_RUN_CONCURRENCY="5", ASTRAI_MAX_BATCH_SIZE="12").stdout.split() == ["5", "12"]
    code = "from astrai.playground.backends.profiles import EngineSettings; print(EngineSettings().max_batch_size)"
    assert python(code, ASTRAI_MAX_BATCH_SIZE="12").stdout.strip() == "12"


@pytest.mark.parametrize(
    "name, value",
    [("ASTRAI_MAX_BATCH_SIZE", "129"), ("ASTRAI_MAX_BATCH_SIZE", "many"), ("ASTRAI_QUEUE_SIZE", "0")],
)
def test_a_knob_out_of_range_stops_the_app_with_one_line(name, value):
    """ASTRAI_MAX_BATCH_SIZE above its range (64 then) crashed the app at start with a traceback from the default
    engine's settings."""
    result = subprocess.run(
        [sys.executable, "app.py"],
        env={**os.environ, name: value, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert name in result.stderr and "takes an integer from 1 to" in result.stderr, result.stderr


def test_the_operator_sets_how_many_sessions_the_app_and_gradio_keep():
    """ASTRAI_SESSIONS bounds both: the app's visitors and Gradio's sessions (10,000 by default, about 1.5 MiB each
    here: a soak's memory grew with every visitor it had seen)."""
    code = (
        "from astrai.playground import state; from astrai.playground.ui.app import launch_options; "
        "print(state.KEEP_VISITORS, launch_options()['state_session_capacity'])"
    )
    assert python(code, ASTRAI_SESSIONS="40").stdout.split() == ["40", "40"]
