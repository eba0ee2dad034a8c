"""A failing test is reported by name even when a parse nests inside pytest's (tests/support/safe_tracebacks.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A test that fails, in a session where every collection parses source, as a failing finalizer's traceback does.
FAILING = textwrap.dedent(
    """
    import ast, gc

    def parse_while_collecting(phase, info):
        if phase == "start":
            ast.parse("x = (1 + (2 * (3 - 4)))")

    gc.callbacks.append(parse_while_collecting)
    gc.set_threshold(10)

    def test_fails():
        assert 1 == 2

    def test_after_it():
        pass
    """
)


def run_child(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_child.py").write_text(FAILING)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, "test_child.py"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_failure_is_listed_by_name_when_a_parse_nests_in_another(tmp_path):
    result = run_child(tmp_path, "-p", "tests.support.safe_tracebacks")
    assert "INTERNALERROR" not in result.stdout + result.stderr, result.stdout[-3000:]
    assert "FAILED test_child.py::test_fails" in result.stdout and "1 failed, 1 passed" in result.stdout, result.stdout


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the nested parse breaks CPython 3.11's AST constructor")
def test_without_the_plugin_the_same_session_crashes(tmp_path):
    """The control: what the plugin prevents does happen here, so the test above can fail."""
    result = run_child(tmp_path)
    assert "AST constructor recursion depth mismatch" in result.stdout + result.stderr, result.stdout[-3000:]
