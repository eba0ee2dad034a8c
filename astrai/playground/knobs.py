"""The operator's knobs: environment variables read once, at start, each checked against its range.

A value out of range, or not a number, stops the app at start with one line naming the variable, its value and
what it takes (``KnobError``; app.py prints it), never a traceback and never a silent default; a teacher's key too
short to be safe, the same way, without its value. README's "Environment knobs" lists the same names and ranges.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


class KnobError(ValueError):
    """An environment variable the playground reads holds a value it cannot use."""


@dataclass(frozen=True)
class Knob:
    name: str
    default: float
    low: float
    high: float
    integer: bool = True

    def read(self) -> float:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            value = int(raw) if self.integer else float(raw)
        except ValueError:
            value = math.nan
        if not self.low <= value <= self.high:
            kind = "an integer" if self.integer else "a number"
            raise KnobError(f"{self.name}={raw!r}: it takes {kind} from {self.low:g} to {self.high:g}")
        return value


TEACHER_KEY_MIN_CHARS = 16  # a key shorter than this is refused: anyone who guesses it gets the teacher's view


def teacher_key() -> str | None:
    """``ASTRAI_TEACHER_KEY``: the key that opens the teacher's view (``?teacher=KEY``); unset or empty, the app has
    no teacher's view at all. Its value is never echoed, not even in the message that refuses it."""
    key = os.environ.get("ASTRAI_TEACHER_KEY", "").strip()
    if key and len(key) < TEACHER_KEY_MIN_CHARS:
        raise KnobError(
            f"ASTRAI_TEACHER_KEY: it takes at least {TEACHER_KEY_MIN_CHARS} characters (it has {len(key)}); make "
            "one with: python -c 'import secrets; print(secrets.token_urlsafe(16))'"
        )
    return key or None


MAX_BATCH = 128  # the largest batch an engine of the playground runs (Engine settings offer 1 to this)

MAX_ENGINES = int(Knob("ASTRAI_MAX_ENGINES", 6, 1, 64).read())
MAX_CUSTOM_ENGINES = int(Knob("ASTRAI_MAX_CUSTOM_ENGINES", 3, 0, 64).read())
KV_BUDGET_MB = Knob("ASTRAI_KV_BUDGET_MB", 1024, 1, 1_048_576, integer=False).read()
ENGINE_IDLE_S = Knob("ASTRAI_ENGINE_IDLE_S", 600, 1, 86_400 * 365, integer=False).read()
# the default engine's batch: 128 lets a class of 30 (4-6 panels each) be admitted at once; at 64 the runs past it
# waited for a slot: the default engine's TTFT p95 per round under 30 spread visitors was 0.77-1.62 s, against
# 0.55-0.91 s at 128 (docs/reliability.md)
MAX_BATCH_SIZE = int(Knob("ASTRAI_MAX_BATCH_SIZE", 128, 1, MAX_BATCH).read())
RUN_CONCURRENCY = int(Knob("ASTRAI_RUN_CONCURRENCY", 32, 1, 1024).read())  # runs streaming at once
QUEUE_SIZE = int(Knob("ASTRAI_QUEUE_SIZE", 64, 1, 100_000).read())  # waiting events past this: "queue is full"
# the default engine's reserve for visitors' own small pools (the lesson's pool-pressure steps): 2048 pages hold 51
# visitors' 40-page pools (a visitor holds one at a time), 96 MiB of the embedded model's KV in float32; past it, a
# visitor shares the step's one pool with everyone else there
TENANT_PAGES = int(Knob("ASTRAI_TENANT_PAGES", 2048, 0, 65_536).read())
# the sessions whose state the app keeps, Gradio's (its per-session copy of the page's config, about 1.5 MiB each
# here) and its own (state.Visitors): the least recently active forgotten first. A closed page's session is not
# always reported, and Gradio keeps 10,000 by default, so a Space that runs for days grew by its visitors: a soak
# of 300 visitors added 230 MiB. 128 is four classes of 30, reloads included
SESSIONS = int(Knob("ASTRAI_SESSIONS", 128, 16, 100_000).read())
TEACHER_KEY = teacher_key()
