"""The repository is one a Hugging Face Space accepts: README's front matter and the large files' storage.

A Space reads its configuration from README's YAML front matter, and its builder installs
`gradio[oauth]==<sdk_version>` after the locks (unhashed): a version other than the locked gradio would replace
it. The Hub refuses a push that carries a file over 10 MiB outside Git LFS.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
assert _spec is not None and _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

HUB_COLOURS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}  # the Hub's colorFrom/colorTo
LFS_THRESHOLD = 10 * 1024 * 1024  # bytes: a larger file outside LFS makes the Hub refuse the push


def front_matter() -> dict[str, object]:
    text = (ROOT / "README.md").read_text()
    assert text.startswith("---\n"), "README.md does not start with YAML front matter"
    matter = yaml.safe_load(text.split("---\n", 2)[1])
    assert isinstance(matter, dict)
    return matter


def test_sdk_version_is_the_gradio_the_lock_pins():
    assert str(lock.pinned(ROOT / "requirements.txt")["gradio"]) == front_matter()["sdk_version"]


def test_the_front_matter_is_one_a_space_accepts():
    matter = front_matter()
    assert matter["sdk"] == "gradio"
    assert isinstance(matter["app_file"], str) and (ROOT / matter["app_file"]).is_file()
    assert matter["python_version"] == "3.11"  # a string: YAML reads an unquoted 3.10 as 3.1
    assert matter["colorFrom"] in HUB_COLOURS and matter["colorTo"] in HUB_COLOURS
    assert isinstance(matter["title"], str) and matter["title"].strip()
    assert isinstance(matter["short_description"], str) and 0 < len(matter["short_description"]) <= 60


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_every_tracked_file_over_10_mib_goes_through_lfs():
    def git(*args: str) -> list[str]:
        """The NUL-terminated fields git's ``-z`` output gives."""
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")[
            :-1
        ]

    large = [path for path in git("ls-files", "-z") if (ROOT / path).stat().st_size > LFS_THRESHOLD]
    if not large:
        return
    # check-attr -z: path, attribute, value, path, attribute, value, ...
    answer = git("check-attr", "-z", "filter", "--", *large)
    outside = [path for path, _, value in zip(answer[0::3], answer[1::3], answer[2::3], strict=True) if value != "lfs"]
    assert not outside, f"over 10 MiB and no LFS pattern in .gitattributes covers them: {outside}"
