"""One question per lesson step, for a teacher to ask the class once it has seen the step (README's "For teachers",
the printable handout ``docs/handout.html`` and the teacher's class panel show them).

Keyed by the step's title, so a step renamed or added without its question fails tests/test_handout.py."""

from __future__ import annotations

import re

from astrai.playground.scenarios import LessonStep

TITLE_NUMBER = re.compile(r"^\d+\.\s*")

QUESTIONS: dict[str, str] = {
    "1. A shared system prompt is computed once": "Panels 2–4 were submitted together with panel 1. How can they hit "
    "pages that no earlier run stored, and why does panel 1 get none?",
    "2. Nothing shared, nothing hit": "Every prompt fills two full pages, yet nothing is reused. What would two "
    "prompts need in common to share a page?",
    "3. Eviction: the LRU gives pages back": "Which cached pages does the LRU give back first, and what does that cost "
    "the next run that needed them?",
    "4. The chained hash: same tokens, different key": "Two pages hold the very same tokens. Why would serving one "
    "for the other give a wrong answer?",
    "5. A follow-up turn hits the answer too": "Why do the second turn's cached tokens go past the first turn's "
    "prompt? What does a chat server gain from that?",
    "6. Caching off versus on": "Caching computes fewer prefill tokens. When would that saving show in the time to "
    "the first token, and why not on this tiny model?",
    "7. How big should the cache be?": "Past what capacity does a bigger cache stop paying, and why can no policy beat "
    "Belady's MIN?",
    "8. Why did it miss?": "Panel 3 asks for panel 1's story again. Why is one of its pages computed anyway, and what "
    "evicted it?",
    "9. Routing decides what is reused": "Why does the prefix-aware router compute fewer prefill tokens than round "
    "robin with the same replicas?",
}


def question(step: LessonStep) -> str | None:
    """The question for ``step``; None for a step that has none yet (tests/test_handout.py fails then)."""
    return QUESTIONS.get(step.title)


def plain_title(step: LessonStep) -> str:
    """The step's title without its own leading number, if it has one (whoever shows it numbers it)."""
    return TITLE_NUMBER.sub("", step.title)
