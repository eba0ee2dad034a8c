"""README's "On a fresh machine" commands, as scripts/readme_commands.py reads them for `.ci/run` and
scripts/fresh_clone_check.sh."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "scripts" / "readme_commands.py")
assert _spec is not None and _spec.loader is not None
readme_commands = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_commands)


def test_readme_installs_the_lock_then_torch_then_runs():
    """torch comes second (pre-requirements.txt): the other packages are then installed, so only torch is looked
    up on PyTorch's index, which this kind of machine cannot reach (one retry, not one per package)."""
    found = readme_commands.commands((ROOT / "README.md").read_text())
    assert found == {
        "app": "pip install -r requirements.txt && pip install -r pre-requirements.txt && python app.py",
        "tests": "pip install -r requirements-dev.txt && pip install -r pre-requirements.txt && python -m pytest -q",
    }


@pytest.mark.parametrize(
    "readme",
    [
        "# x\n\n## Elsewhere\n\n```bash\na\n```\n\n```bash\nb\n```\n",
        "## On a fresh machine\n\n```bash\na\n```\n\n## Next\n\n```bash\nb\n```\n",
        "## On a fresh machine\n\n```bash\na\nb\n```\n\n```bash\nc\n```\n",
    ],
    ids=["no-section", "one-block", "two-line-block"],
)
def test_a_readme_without_its_two_commands_is_named(readme):
    with pytest.raises(ValueError, match="On a fresh machine"):
        readme_commands.commands(readme)
