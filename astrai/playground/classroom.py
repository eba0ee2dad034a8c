"""The class a teacher watches: where each open page is in the lesson, the class's prefix hits per step, and the
teacher's call to move the class to a step.

It holds counts and step numbers only, never a prompt, an answer or anything else a visitor typed: what the teacher's
view shows is built from it alone, so no visitor's text can reach the teacher. A visitor learns of it only the
teacher's standing call (the banner): a step number.

- A page is *on* step ``i`` when the lesson last put it there and it still shows that step's scenario; one whose
  visitor picked a scenario of their own is *elsewhere*. It counts while it is open: seen by its live view's poll
  within ``SEEN_WITHIN_S`` (a hidden tab polls nothing, so after that it drops out; so does a page with Live charts
  off). Teachers' pages are not counted.
- A step's hits: over the panels of the runs started on it with prefix caching on (Compare's caching-off half is
  not; a panel counts once its prompt was looked up), the prompt tokens served from the cache against the prompt
  tokens looked up, each prompt once, at its first admission (the engine's own accounting).
- The teacher's call stands for ``CALL_STANDS_S`` or until the next one; each page is shown it once, unless it is
  on that step already.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from astrai.playground.state import KEEP_POLLING, SEEN_WITHIN_S

CALL_STANDS_S = 45 * 60.0  # a class period: a page opened later than that is not called to an old step
KEEP_TEACHERS = 16  # teachers' sessions remembered (a teacher may open the view on two machines)


@dataclass(frozen=True)
class Call:
    """The teacher's call: move to lesson step ``step`` (an index). ``seq`` numbers the calls from 1."""

    seq: int
    step: int
    at: float  # the clock's time of the call


@dataclass(frozen=True)
class StepHits:
    """A step's runs with prefix caching on, and their panels' prompt tokens served from the cache and looked up."""

    runs: int = 0
    cached_tokens: int = 0
    looked_up_tokens: int = 0

    def plus(self, panels: Iterable[tuple[int, int]]) -> StepHits:
        counted = list(panels)
        return StepHits(
            self.runs + 1,
            self.cached_tokens + sum(cached for _, cached in counted),
            self.looked_up_tokens + sum(looked_up for looked_up, _ in counted),
        )


@dataclass(frozen=True)
class ClassView:
    """What the teacher's class panel shows, as of one moment: open pages by step, elsewhere, hits by step, the
    standing call."""

    on_step: dict[int, int]  # step index -> open pages on it
    elsewhere: int  # open pages on a scenario of their visitor's own choosing
    hits: dict[int, StepHits]  # step index -> the class's runs there since the app started
    call: Call | None  # the call standing now


@dataclass
class _Page:
    step: int | None  # None: elsewhere
    seen_at: float
    shown_call: int = 0  # the seq of the last call shown to this page


class Classroom:
    """Thread-safe: callbacks of many sessions read and write it at once (one lock, held for dict operations only).
    Bounded: at most ``KEEP_POLLING`` pages (the least recently placed or seen forgotten first) and
    ``KEEP_TEACHERS`` teachers."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._pages: OrderedDict[str, _Page] = OrderedDict()
        self._teachers: OrderedDict[str, None] = OrderedDict()
        self._hits: dict[int, StepHits] = {}
        self._call: Call | None = None

    def admit_teacher(self, session: str) -> None:
        """``session`` showed the operator's key: its page is the teacher's (and no longer counted as the class's)."""
        with self._lock:
            self._teachers[session] = None
            self._teachers.move_to_end(session)
            while len(self._teachers) > KEEP_TEACHERS:
                self._teachers.popitem(last=False)
            self._pages.pop(session, None)

    def is_teacher(self, session: str) -> bool:
        with self._lock:
            return session in self._teachers

    def place(self, session: str, step: int | None) -> None:
        """The page of ``session`` now shows lesson step ``step`` (None: a scenario of its visitor's own choosing)."""
        with self._lock:
            if session in self._teachers:
                return
            page = self._pages.pop(session, None) or _Page(step, self._clock())
            page.step, page.seen_at = step, self._clock()
            self._pages[session] = page
            while len(self._pages) > KEEP_POLLING:
                self._pages.popitem(last=False)

    def step_of(self, session: str) -> int | None:
        """The lesson step ``session``'s page shows; None when elsewhere, unknown, or a teacher's."""
        with self._lock:
            page = self._pages.get(session)
            return page.step if page is not None else None

    def waiting_call(self, session: str) -> Call | None:
        """Marks ``session``'s page seen (its live view polls this), and returns the standing call not yet shown to
        it, unless it is on the called step already (then it counts as shown) or it is a teacher's page."""
        now = self._clock()
        with self._lock:
            page = self._pages.get(session)
            if page is None:
                return None
            page.seen_at = now
            call = self._call
            if call is None or call.seq <= page.shown_call or now - call.at > CALL_STANDS_S:
                return None
            if page.step == call.step:
                page.shown_call = call.seq
                return None
            return call

    def shown(self, session: str, call: Call) -> None:
        """``call`` reached ``session``'s page (its banner is up): it is not shown again."""
        with self._lock:
            page = self._pages.get(session)
            if page is not None:
                page.shown_call = max(page.shown_call, call.seq)

    def standing_call(self) -> Call | None:
        with self._lock:
            call = self._call
        return call if call is not None and self._clock() - call.at <= CALL_STANDS_S else None

    def call(self, step: int) -> Call:
        """The teacher calls the class to ``step``: every open page not on it is shown the call once."""
        with self._lock:
            self._call = Call((self._call.seq if self._call else 0) + 1, step, self._clock())
            return self._call

    def count_run(self, step: int | None, panels: Iterable[tuple[int, int | None]]) -> None:
        """A run started on lesson step ``step`` (None: not on one, not counted) with prefix caching on ended: each
        panel as (prompt tokens, prompt tokens served from the cache, None where it was never looked up)."""
        if step is None:
            return
        looked_up = [(prompt, cached) for prompt, cached in panels if cached is not None]
        if not looked_up:
            return
        with self._lock:
            self._hits[step] = self._hits.get(step, StepHits()).plus(looked_up)

    def view(self) -> ClassView:
        now = self._clock()
        on_step: dict[int, int] = {}
        elsewhere = 0
        with self._lock:
            for page in self._pages.values():
                if now - page.seen_at > SEEN_WITHIN_S:
                    continue
                if page.step is None:
                    elsewhere += 1
                else:
                    on_step[page.step] = on_step.get(page.step, 0) + 1
            hits = dict(self._hits)
        return ClassView(on_step, elsewhere, hits, self.standing_call())
