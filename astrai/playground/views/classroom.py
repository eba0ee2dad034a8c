"""The teacher's class panel and the visitors' banner, from a ``ClassView`` (counts and step numbers only)."""

from __future__ import annotations

from collections.abc import Sequence

from astrai.playground.classroom import ClassView
from astrai.playground.scenarios import LessonStep
from astrai.playground.state import SEEN_WITHIN_S

PANEL_CAPTION = (
    f"*Open pages*: pages that polled in the last {SEEN_WITHIN_S:g} s (a hidden tab, or one with Live charts off, "
    "polls nothing and drops out), yours not counted. *Runs*: the class's runs started on that step with prefix "
    "caching on, since the app started, each once a prompt of it was looked up (Compare's caching-off half is not "
    "counted). *Hit rate*: over their panels, prompt tokens served from the prefix cache / prompt tokens looked up "
    "(each prompt once, at its first admission)."
)


def step_name(steps: Sequence[LessonStep], index: int) -> str:
    """The step as the class panel, the banner and the teacher's menu name it: its number, then its title."""
    return f"step {index + 1}: {steps[index].title}"


def hit_rate(cached: int, looked_up: int) -> str:
    return f"{cached / looked_up:.0%}" if looked_up else "–"


def class_panel(view: ClassView, steps: Sequence[LessonStep], question: str | None) -> str:
    """A column per lesson step (``steps``, in order; a strip a few lines tall, so it leaves the projected page to
    the lesson): open pages on it, runs, hit rate and its tokens; then who is elsewhere, the standing call, and the
    question to ask about the called step."""
    indexes = range(len(steps))
    hits = [view.hits.get(i) for i in indexes]
    called = view.call.step if view.call is not None else None
    header = [f"**{i + 1}** ⬅ called" if i == called else f"**{i + 1}**" for i in indexes]
    rows = [
        ("open pages", [str(view.on_step.get(i, 0)) for i in indexes]),
        ("runs", [f"{h.runs:,}" if h else "0" for h in hits]),
        ("hit rate", [hit_rate(h.cached_tokens, h.looked_up_tokens) if h else "–" for h in hits]),
        ("cached / looked up", [f"{h.cached_tokens:,} / {h.looked_up_tokens:,}" if h else "–" for h in hits]),
    ]
    table = [f"| step | {' | '.join(header)} |", f"|---|{'---|' * len(steps)}"]
    table += [f"| {name} | {' | '.join(cells)} |" for name, cells in rows]
    total = sum(view.on_step.values()) + view.elsewhere
    lines = [
        "\n".join(table),
        f"**{total}** open pages: {total - view.elsewhere} on a lesson step, {view.elsewhere} on a scenario of their "
        "own choosing.",
    ]
    if view.call is not None:
        there = view.on_step.get(view.call.step, 0)
        lines[-1] += f" You called the class to **{step_name(steps, view.call.step)}**: {there} of them are on it."
        if question:
            lines.append(f"Ask them: *{question}*")
    lines.append(f"<small>{PANEL_CAPTION}</small>")
    return "\n\n".join(lines)


def banner(steps: Sequence[LessonStep], step: int) -> str:
    """What a visitor's page says of the teacher's call: the step, and nothing else of the teacher's view."""
    return f"**Your teacher moved the class to {step_name(steps, step)}.**"
