"""The checks every change passes: ruff's lint and format, and mypy over the whole package (its settings in
pyproject.toml: every function of the playground and the cache typed, so a view and its callers agree)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff check", "ruff format", "mypy"],
)
def test_the_tree_passes(command):
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
