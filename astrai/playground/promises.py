"""What each lesson step's text promises a visitor's own run, as checks of what that visitor reads.

The one place the lesson's promises are checked from: tests/test_scenarios.py and tests/test_lesson_truth.py check
them on the engine and in process, and ``python -m tools.loadtest --lockstep`` on what each student of a class reads
back through the page's endpoints (badges, the request table, the savings note, the stats line, Replay my requests'
table). A check reads only
what a visitor is shown, so it holds whatever pool the step's runs are served from (one shared by the class, or a
pool of the student's own). It returns the ways the visitor's step broke the promise, each in words: none, kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from astrai.explain import Cause
from astrai.playground.scenarios import (
    EVICTION_OPENING_PAGES,
    LESSON,
    POLICY,
    SECOND_TIER,
    SECOND_TIER_PAGES,
    SYSTEM_PROMPT_PAGES,
    LessonStep,
)

# Step 1's text: panels 2-4 "show 32 or more cached tokens in the very first run" (two of the prefix's full pages).
SHARED_PREFIX_MIN_HIT = 32


@dataclass(frozen=True)
class Panel:
    """One panel's prompt as its badge and its row of the request table tell it."""

    prompt_tokens: int
    cached_tokens: int | None  # None: not reported (caching off)
    causes: Mapping[Cause, int] = field(default_factory=dict)  # the table's cause columns; {}: not explained


@dataclass(frozen=True)
class Replayed:
    """Replay my requests as its table reads: the capacity shown (blocks), and the prompt tokens each eviction policy
    served there (by ``astrai.eviction`` name: "lru", "arc", ...)."""

    capacity: int
    served: Mapping[str, int]


@dataclass(frozen=True)
class Seen:
    """What one visitor read at one lesson step: each Run's panels in the order pressed (Compare's caching-on half
    counts as a run), the evictions its stats line counted during the step, Compare's prefill tokens computed
    with caching on and off, and what Replay my requests showed."""

    page_size: int
    runs: tuple[tuple[Panel, ...], ...] = ()
    evictions: int | None = None
    computed: tuple[int, int] | None = None
    replayed: Replayed | None = None


Check = Callable[[Seen], list[str]]


def _first_run(seen: Seen) -> tuple[Panel, ...]:
    if not seen.runs or not seen.runs[0]:
        raise ValueError("the step's check needs the panels of a run")
    return seen.runs[0]


def shared_prefix_computed_once(seen: Seen) -> list[str]:
    """Step 1: panel 1 computes the prefix (0 cached, a fresh namespace), panels 2-4 hit it in the same run."""
    first, *rest = _first_run(seen)
    broken = [] if first.cached_tokens == 0 else [f"panel 1: {first.cached_tokens} cached, not 0"]
    broken += [
        f"panel {i}: {p.cached_tokens} cached, not {SHARED_PREFIX_MIN_HIT} or more"
        for i, p in enumerate(rest, start=2)
        if (p.cached_tokens or 0) < SHARED_PREFIX_MIN_HIT
    ]
    return broken


def nothing_shared_nothing_hit(seen: Seen) -> list[str]:
    """Step 2: every prompt fills two full pages, and no panel gets a cached token."""
    _first_run(seen)
    broken = []
    for run in seen.runs:
        for i, p in enumerate(run, start=1):
            if p.prompt_tokens <= 2 * seen.page_size:
                broken.append(f"panel {i}: {p.prompt_tokens} prompt tokens do not fill two full pages")
            if p.cached_tokens != 0:
                broken.append(f"panel {i}: {p.cached_tokens} cached, not 0")
    return broken


def eviction_costs_hits(seen: Seen) -> list[str]:
    """Step 3: the pool evicts during the step; in the second run every panel hits the shared opening's pages, and
    some panel's tokens are computed again because a page of its own that the first run stored was evicted (a
    preemption "may" happen: not promised)."""
    if seen.evictions is None or len(seen.runs) < 2:
        raise ValueError("step 3's check needs both runs and the evictions counted during the step")
    opening = EVICTION_OPENING_PAGES * seen.page_size
    broken = [] if seen.evictions > 0 else ["no eviction during the step's runs"]
    second = seen.runs[1]
    broken += [
        f"panel {i}: {p.cached_tokens} cached in the second run, not the opening's {opening} or more"
        for i, p in enumerate(second, start=1)
        if (p.cached_tokens or 0) < opening
    ]
    if not any(p.causes.get(Cause.EVICTED, 0) for p in second):
        broken.append("no panel of the second run had tokens evicted")
    return broken


def chained_hash_refuses(seen: Seen) -> list[str]:
    """Step 4: the prompts hold a page of equal tokens, yet neither gets a cached token (a fresh namespace)."""
    return [f"panel {i}: {p.cached_tokens} cached, not 0" for i, p in enumerate(_first_run(seen), 1) if p.cached_tokens]


def follow_up_hits_the_answer(seen: Seen) -> list[str]:
    """Step 5: the second turn's cached tokens go past the first turn's prompt, panel by panel."""
    if len(seen.runs) < 2:
        raise ValueError("step 5's check needs both turns")
    first, second = seen.runs[0], seen.runs[1]
    if len(first) != len(second):
        return [f"the second turn has {len(second)} panels, the first {len(first)}"]
    return [
        f"panel {i}: {b.cached_tokens} cached in the second turn, not past the first prompt's {a.prompt_tokens}"
        for i, (a, b) in enumerate(zip(first, second, strict=True), start=1)
        if (b.cached_tokens or 0) <= a.prompt_tokens
    ]


def caching_saves_prefill(seen: Seen) -> list[str]:
    """Step 6: with caching on, fewer prefill tokens are computed than without."""
    if seen.computed is None:
        raise ValueError("step 6's check needs Compare's figures")
    on, off = seen.computed
    return [] if on < off else [f"caching on computed {on} prefill tokens, off {off}"]


def arc_keeps_what_lru_evicts(seen: Seen) -> list[str]:
    """Step 8: on the visitor's LRU pool, panel 2 hits the system prompt's pages and panel 6 finds them evicted;
    Replay my requests, at the pool's size, has LRU serve the system prompt once and ARC twice."""
    if seen.replayed is None:
        raise ValueError("step 8's check needs what Replay my requests showed")
    run, system = _first_run(seen), SYSTEM_PROMPT_PAGES * seen.page_size
    if len(run) != len(POLICY.prompts):
        return [f"{len(run)} panels, the step has {len(POLICY.prompts)}"]
    broken = [] if run[1].cached_tokens == system else [f"panel 2: {run[1].cached_tokens} cached, not {system}"]
    last = run[-1]
    if last.cached_tokens != 0 or last.causes.get(Cause.EVICTED, 0) != system:
        broken.append(f"panel 6: {_words(last.causes)}, the text promises {system} evicted and none cached")
    pool, served = POLICY.profile.settings.n_pages, seen.replayed.served
    if seen.replayed.capacity != pool:
        broken.append(f"Replay my requests showed {seen.replayed.capacity} blocks, not the pool's {pool}")
    if (served.get("lru"), served.get("arc")) != (system, 2 * system):
        broken.append(f"LRU served {served.get('lru')} and ARC {served.get('arc')}, not {system} and {2 * system}")
    return broken


def second_tier_loads(seen: Seen) -> list[str]:
    """Step 9: in the second run, every panel's badge says its story's full pages cached, all of them loaded from
    the second tier (none from the pool, none computed)."""
    if len(seen.runs) < 2:
        raise ValueError("step 9's check needs both runs")
    second, loaded = seen.runs[1], SECOND_TIER_PAGES * seen.page_size
    if len(second) != len(SECOND_TIER.prompts):
        return [f"{len(second)} panels, the step has {len(SECOND_TIER.prompts)}"]
    return [
        f"panel {i}: {p.cached_tokens} cached, {p.causes.get(Cause.LOADED, 0)} loaded from the second tier, "
        f"the text promises {loaded} and {loaded}"
        for i, p in enumerate(second, start=1)
        if p.cached_tokens != loaded or p.causes.get(Cause.LOADED, 0) != loaded
    ]


def why_did_it_miss(seen: Seen) -> list[str]:
    """Step 10, cause counts exact, panel by panel. A prompt's last token is always computed, and the tokens after
    its last full page are a partial page; of the rest (its ``looked`` tokens, in pages): panel 1 all new; panel 2's
    first page diverged, the rest new; panel 3 whole pages cached, then the one page after them evicted, the rest
    new; panel 4 one page cached, the next diverged, the rest new."""
    run, size = _first_run(seen), seen.page_size
    if len(run) != 4:
        return [f"{len(run)} panels, the step has 4"]
    broken = []
    for i, p in enumerate(run, start=1):
        if not p.causes:
            broken.append(f"panel {i}: no cause counts")
            continue
        counts = {cause: n for cause, n in p.causes.items() if n}
        looked = min(p.prompt_tokens // size * size, p.prompt_tokens - 1)
        expected = {Cause.LAST_TOKEN: 1, Cause.PARTIAL_PAGE: p.prompt_tokens - 1 - looked}
        if i == 1:
            expected[Cause.NEW] = looked
        elif i == 2:
            expected |= {Cause.DIVERGED: size, Cause.NEW: looked - size}
        elif i == 3:
            cached = counts.get(Cause.CACHED, 0)
            if cached < size or cached % size:
                broken.append(f"panel 3: {cached} cached, not whole pages")
            expected |= {Cause.CACHED: cached, Cause.EVICTED: size, Cause.NEW: looked - cached - size}
        else:
            expected |= {Cause.CACHED: size, Cause.DIVERGED: size, Cause.NEW: looked - 2 * size}
        expected = {cause: n for cause, n in expected.items() if n}
        if counts != expected:  # any other cause (unknown, another namespace, ...) breaks it too
            broken.append(f"panel {i}: {_words(counts)}, the text promises {_words(expected)}")
        if p.cached_tokens != counts.get(Cause.CACHED, 0):
            broken.append(f"panel {i}: the badge's {p.cached_tokens} cached is not its causes' cached")
    return broken


def _words(counts: Mapping[Cause, int]) -> str:
    return ", ".join(f"{n} {cause.value.replace('_', ' ')}" for cause, n in counts.items()) or "nothing"


# Step 7's text speaks of the shipped sizing curves (tests/test_sizing.py checks those), not of the visitor's run.
PROMISES: dict[str, Check | None] = dict(
    zip(
        (step.title for step in LESSON),
        (
            shared_prefix_computed_once,
            nothing_shared_nothing_hit,
            eviction_costs_hits,
            chained_hash_refuses,
            follow_up_hits_the_answer,
            caching_saves_prefill,
            None,
            arc_keeps_what_lru_evicts,
            second_tier_loads,
            why_did_it_miss,
        ),
        strict=True,
    )
)


def promise(step: LessonStep) -> Check | None:
    """The check of what ``step``'s text promises the visitor's own run; None: it promises nothing of the run."""
    return PROMISES[step.title]


def check(step: LessonStep, seen: Seen) -> list[str]:
    """How ``seen`` breaks ``step``'s promise (none: kept, or nothing promised)."""
    checking = promise(step)
    return [] if checking is None else checking(seen)


def presses(step: LessonStep) -> tuple[str, ...]:
    """The buttons the step's text says to press, in order: "run", "follow_up" (then "run" again), "compare",
    "replay_mine" (Replay my requests, after a Run). A step that names none (7: scroll to a chart) is a Run."""
    text = step.text
    if "Press Compare with caching off" in text:
        return ("compare",)
    if "Press Run, then Replay my requests" in text:
        return ("run", "replay_mine")
    if "Follow-up turn" in text:
        return ("run", "follow_up", "run")
    return ("run", "run") if "Run twice" in text else ("run",)
