"""A model's first engine serves eager while its forward compiles in a child process (astrai/precompile.py), then
loads what the child compiled: a cold compile in the serving process held the GIL and compiled_forward's lock, and
stalled every visitor for 20-80 s (and the app's start for as long)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from astrai import InferenceEngine, precompile
from astrai.checkpoints import load_checkpoint
from astrai.playground.backends.engines import LocalEngines
from astrai.playground.backends.profiles import DEFAULT_PROFILE, EngineSettings, Profile
from tests.support.tiny_models import write_checkpoint
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_what_the_child_compiles_the_serving_process_loads(tmp_path, monkeypatch):
    checkpoint = write_checkpoint(tmp_path / "tiny", "safetensors")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    command = [sys.executable, "-m", "astrai.precompile", str(checkpoint), "--threads", str(torch.get_num_threads())]
    child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1])["compiled"]
    assert "Compiling" in child.stdout, "its progress lines are what the visitor reads"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model, tokenizer = load_checkpoint(str(checkpoint), "float32")
    with InferenceEngine(model, tokenizer, n_pages=16, compile=True) as engine:
        assert engine.runner.compiled is not None and engine.runner.compiled.loaded


def test_the_playground_does_not_wait_for_a_compile_and_its_engines_switch_together(monkeypatch):
    """The default engine is built before the app serves, eager, its compile left to the background; an engine
    built later on the same model shares the model's forward, whichever it is."""
    gate = threading.Event()
    asked: list[tuple[str, str]] = []

    def in_child(checkpoint: str, dtype: str):
        asked.append((checkpoint, dtype))

        def build(_model) -> None:  # a child that failed to compile, once the test lets it end
            gate.wait(60)

        return build

    monkeypatch.setattr(precompile, "in_child", in_child)
    engines = LocalEngines(compile=None)
    try:
        default = engines.backend(DEFAULT_PROFILE)
        assert default is not None and default.stats().forward == "compiling"
        other = engines.ensure(Profile(settings=EngineSettings(n_pages=8), name="small"))
        assert other.stats().forward == "compiling"
        gate.set()
        assert wait_until(lambda: default.stats().forward == other.stats().forward == "failed", timeout=30)
        assert [dtype for _, dtype in asked] == ["float32", "float32"], "one builder per engine; the first one runs"
    finally:
        gate.set()
        engines.shutdown()
