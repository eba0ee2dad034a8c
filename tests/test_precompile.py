"""A model's first engine while visitors are served compiles in a child process (astrai/precompile.py), and the
engine built next loads what the child compiled: a cold compile in the serving process held the GIL and
compiled_forward's lock, and stalled every visitor for 20-80 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai import InferenceEngine
from astrai.checkpoints import load_checkpoint
from astrai.playground.backends.engines import LocalEngines
from astrai.playground.backends.profiles import DEFAULT_PROFILE, EngineSettings, Profile
from tests.support.tiny_models import write_checkpoint

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


def test_only_a_model_not_yet_served_compiles_in_a_child():
    engines = LocalEngines(compile=False)
    try:
        other_dtype = Profile(settings=EngineSettings(dtype="bfloat16"), name="bf16")
        assert not engines._compiles_cold(other_dtype), "compile=False: nothing compiles anywhere"
        engines._compile = None  # the default: compiled on the CPU
        assert engines._compiles_cold(other_dtype), "a new dtype while the default engine serves"
        assert not engines._compiles_cold(DEFAULT_PROFILE), "the default's model and dtype: shared, compiled already"
    finally:
        engines.shutdown()
