#!/usr/bin/env python3
"""Print README's commands from its "On a fresh machine" section: its first two bash blocks, one line each.

    python scripts/readme_commands.py          # the app's command, then the tests' command
    python scripts/readme_commands.py tests    # only the tests' command (`.ci/run` runs it)

`.ci/run` and `scripts/fresh_clone_check.sh` run what this prints, so what they test is what README tells a new
user to type. Standard library only: both call it before anything is installed. Exits 1, saying why, when the
section or its two one-line blocks are missing.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## On a fresh machine"
WHICH = ("app", "tests")


def commands(readme: str) -> dict[str, str]:
    """{"app": ..., "tests": ...} from README's text. Raises ValueError naming what is missing."""
    if SECTION not in readme:
        raise ValueError(f"README.md has no {SECTION!r} section")
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)[:2]]
    if len(blocks) < 2 or any("\n" in block or not block for block in blocks):
        raise ValueError(f"README.md's {SECTION!r} needs two bash blocks of one line each (the app's, the tests')")
    return dict(zip(WHICH, blocks, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", choices=WHICH, help="print only this command")
    args = parser.parse_args()
    try:
        found = commands(README.read_text())
    except ValueError as error:
        print(f"readme_commands: {error}", file=sys.stderr)
        return 1
    for which in [args.which] if args.which else WHICH:
        print(found[which])
    return 0


if __name__ == "__main__":
    sys.exit(main())
