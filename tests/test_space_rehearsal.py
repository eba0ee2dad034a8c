"""A Space built from this commit builds, starts within the cold-start bound and serves the lesson: the rehearsal of
a Hugging Face Space's builder (`scripts/space_rehearsal.sh`, which says what it reads and does) run as CI runs it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.needs import NO_CHROMIUM, NO_PYPI
from tools.browser import CHROMIUM

REPO = Path(__file__).resolve().parent.parent
CANNOT_REHEARSE_HERE = 3
# The page must answer within this many seconds of the process start. The target is 15 s on an otherwise idle
# 2-core machine (`python -m benchmarks.cold_start --rounds 3` measures it); in the suite, vLLM servers and the tests
# share the cores, so the bound here is a guard against a start that waits for the compile again (that took over
# 30 s on every machine measured), not the target itself.
START_LIMIT_S = 30


def _reaches_pypi() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.timeout(1500)
def test_a_space_built_from_this_commit_builds_starts_fast_and_serves_the_lesson():
    if not shutil.which(CHROMIUM):
        pytest.skip(NO_CHROMIUM)
    if not _reaches_pypi():
        pytest.skip(NO_PYPI)
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "space_rehearsal.sh"), str(REPO)],
        env=os.environ | {"CHECK_PYTHON": sys.executable, "START_LIMIT_S": str(START_LIMIT_S)},
        capture_output=True,
        text=True,
        timeout=1400,
    )
    said = [line for line in done.stderr.splitlines() + done.stdout.splitlines() if "space_" in line]
    if done.returncode == CANNOT_REHEARSE_HERE:
        pytest.skip(said[-1])
    assert done.returncode == 0, "\n".join(said[-8:]) or done.stderr[-3000:]
    assert any("the page answered" in line for line in said) and any("panels received text" in line for line in said)
