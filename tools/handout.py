"""The lesson on paper and in README, generated from the lesson's own definitions so neither can drift from the page:
each step's title and note (``scenarios.py``), what the tests check of it (``promises.py``) and its question
(``teaching.py``).

    python -m tools.handout            # rewrites docs/handout.html and README's step list
    python -m tools.handout --check    # exits 1, naming the file, where either differs from what it would write

``docs/handout.html`` is one printable page (A4 or Letter) for students; README's "For teachers" holds the step list
between ``README_BEGIN`` and ``README_END``. tests/test_handout.py checks both against what this writes now, and that
the handout prints on one page.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from astrai.playground import promises
from astrai.playground.scenarios import ROUTING_STEP, Lesson, LessonStep
from astrai.playground.teaching import question

ROOT = Path(__file__).resolve().parents[1]
HANDOUT = ROOT / "docs" / "handout.html"
README = ROOT / "README.md"
README_BEGIN = "<!-- the lesson's steps: written by `python -m tools.handout` from the lesson's definitions -->"
README_END = "<!-- end of the lesson's steps -->"
STEP_NUMBER = re.compile(r"^Step \d+[:,]\s*")  # how a promise's docstring opens: the step is numbered here anyway
BOLD = re.compile(r"\*\*(.+?)\*\*")  # the one Markdown a step's note uses
WIDTH = 120  # README's lines


def wrapped(text: str, first: str = "", later: str = "") -> str:
    """README's width; a word, a path or a number is never split."""
    return textwrap.fill(
        text, WIDTH, initial_indent=first, subsequent_indent=later, break_long_words=False, break_on_hyphens=False
    )


def lesson_steps() -> tuple[LessonStep, ...]:
    """The steps every deployment of the embedded engine offers (a vLLM fleet adds ``ROUTING_STEP``)."""
    return Lesson.for_deployment(routers=0).steps


def asked(step: LessonStep) -> str:
    found = question(step)
    if found is None:
        raise LookupError(f"no question for the step {step.title!r}: add one to astrai/playground/teaching.py")
    return found


def checked(step: LessonStep) -> str:
    """What the tests check of a visitor's run on ``step``, in the words of its check's docstring."""
    check = promises.promise(step)
    if check is None:
        return "its text promises nothing of the visitor's own run."
    words = STEP_NUMBER.sub("", " ".join((check.__doc__ or "").split())).replace("``", "`")
    return f"`promises.{check.__name__}`: {words[:1].upper()}{words[1:]}"


def readme_steps(steps: Sequence[LessonStep]) -> str:
    """README's step list: per step, what the page says, what the tests check, and the question to ask."""
    lines = [README_BEGIN, ""]
    for number, step in enumerate(steps, start=1):
        lines.append(f"{number}. **{step.title}** (scenario *{step.scenario}*)")
        for item in (
            f"The page says: {step.text}",
            f"The tests check, on each visitor's own run: {checked(step)}",
            f"Ask: *{asked(step)}*",
        ):
            lines.append(wrapped(item, "   - ", "     "))
    fleet = (
        f"On a vLLM fleet behind two routers the lesson has one more step, **{ROUTING_STEP.title}**: "
        f"*{asked(ROUTING_STEP)}*"
    )
    lines += ["", wrapped(fleet), "", README_END]
    return "\n".join(lines)


HANDOUT_STYLE = """
@page { size: auto; margin: 9mm 11mm; }
body { font: 7.8pt/1.25 "DejaVu Sans", "Helvetica", "Arial", sans-serif; color: #111; margin: 0; }
h1 { font-size: 13pt; margin: 0 0 3pt; }
p { margin: 0 0 5pt; }
ol { margin: 0; padding: 0; list-style: none; columns: 2; column-gap: 8mm; }
li { margin: 0 0 4pt; break-inside: avoid; }
.ask { font-style: italic; margin-top: 1pt; }
.ask::before { content: "Question: "; font-style: normal; font-weight: bold; }
.line { border-bottom: 0.6pt dotted #888; height: 11pt; }
.foot { color: #555; font-size: 7.5pt; margin-top: 4pt; }
"""


def sentence(title: str) -> str:
    """A title as a sentence: a full stop, unless it ends in its own ("How big should the cache be?")."""
    return title if title.endswith((".", "?", "!")) else f"{title}."


def note_html(step: LessonStep) -> str:
    return BOLD.sub(r"<b>\1</b>", html.escape(step.text))


def handout_html(steps: Sequence[LessonStep]) -> str:
    """One page for students: each step's note as the page shows it, its question and a line for the answer."""
    items = "\n".join(
        f"<li><b>{number}. {html.escape(sentence(step.title))}</b> {note_html(step)}"
        f'<div class="ask">{html.escape(asked(step))}</div><div class="line"></div></li>'
        for number, step in enumerate(steps, start=1)
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>AstrAI playground: the lesson on one page</title>
<style>{HANDOUT_STYLE}</style>
</head>
<body>
<h1>Watch a KV cache reuse work: the lesson, step by step</h1>
<p>Open the playground at the address your teacher gives. It opens on step 1 with its prompts filled in. At each
step, do what its note says (the note sits beside the view it points at), watch, answer the question below in a
sentence, then press <b>Lesson ▶</b>. If your teacher moves the class, a banner at the top of the page offers
the step: press its button. Your text is never shown to anyone else; other visitors' pages read "other session".</p>
<ol>
{items}
</ol>
<p class="foot">Written by <code>python -m tools.handout</code> from the lesson's own steps
(astrai/playground/scenarios.py) and questions (astrai/playground/teaching.py).</p>
</body>
</html>
"""


def readme_with_steps(readme: str, steps: Sequence[LessonStep]) -> str:
    """README with its step list replaced by the generated one (the markers must be there, once each)."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin or readme.count(README_BEGIN) != 1:
        raise ValueError(f"README.md needs one {README_BEGIN!r} followed by {README_END!r}")
    return readme[:begin] + readme_steps(steps) + readme[end + len(README_END) :]


def written() -> dict[Path, str]:
    """Each file this tool writes, with what it would write now."""
    steps = lesson_steps()
    return {HANDOUT: handout_html(steps), README: readme_with_steps(README.read_text(), steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 where a file differs from what would be written")
    args = parser.parse_args(argv)
    stale = []
    for path, text in written().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        print(f"{path} differs from the lesson's definitions: run python -m tools.handout", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
