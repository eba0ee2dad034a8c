"""One question per lesson step, for a teacher to ask the class once it has seen the step (README's "For teachers",
the printable handout ``docs/handout.html`` and the teacher's class panel show them).

Keyed by the step's title, so a step renamed or added without its question fails tests/test_handout.py."""

from __future__ import annotations

from astrai.playground.scenarios import LessonStep

QUESTIONS: dict[str, str] = {
    "A shared system prompt is computed once": "Panels 2–4 were submitted together with panel 1. How can they hit "
    "pages that no earlier run stored, and why does panel 1 get none?",
    "Nothing shared, nothing hit": "Every prompt fills two full pages, yet nothing is reused. What would two "
    "prompts need in common to share a page?",
    "Eviction costs hits": "The second run asks for the same shared opening. Which of its pages did the LRU give back "
    "in between, and what did recomputing them cost?",
    "The chained hash: same tokens, different key": "Two pages hold the very same tokens. Why would serving one "
    "for the other give a wrong answer?",
    "A follow-up turn hits the answer too": "Why do the second turn's cached tokens go past the first turn's "
    "prompt? What does a chat server gain from that?",
    "Caching off versus on": "Caching computes fewer prefill tokens. When would that saving show in the time to "
    "the first token, and why not on this tiny model?",
    "How big should the cache be?": "Past what capacity does a bigger cache stop paying, and why can no policy beat "
    "Belady's MIN?",
    "LRU or ARC: which page goes?": "Three one-off stories pass through a 9-page pool between two uses of a system "
    "prompt. Why does ARC keep it where LRU lets it go?",
    "A second tier: when is loading faster than recomputing?": "Loading a page back took a fraction of a "
    "millisecond here. With what kind of model and tier would computing it again be faster?",
    "Why did it miss?": "Panel 3 asks for panel 1's story again. Why is one of its pages computed anyway, and what "
    "evicted it?",
    "Routing decides what is reused": "Why does the prefix-aware router compute fewer prefill tokens than round "
    "robin with the same replicas?",
}


def question(step: LessonStep) -> str | None:
    """The question for ``step``; None for a step that has none yet (tests/test_handout.py fails then)."""
    return QUESTIONS.get(step.title)
