"""Per-visitor state, typed, and the one registry that holds it.

A visitor is one browser session (Gradio's session hash). Their state is written by that session's callbacks only,
each field replaced whole, so a run in progress and the chart timer agree on it. The registry's lock guards the
tables (visitors, request owners), never a visitor's fields.

Memory is bounded two ways, and polling never counts as activity:
- at most ``KEEP_VISITORS`` visitors (``knobs.SESSIONS``, as many as Gradio keeps sessions of), the least recently
  *active* forgotten first, and ``KEEP_POLLING`` tabs that only poll (a time each);
- at most ``KEEP_RECORDINGS`` replays (a run's recorded steps: the heavy part), kept by the same order.
The 1 Hz chart refresh of an open tab only marks it as seen (for "visitors on this engine"): it neither creates
a visitor nor moves one up the order, so hundreds of idle tabs cannot push an active visitor's replay out.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from astrai.playground import knobs
from astrai.playground.backends.profiles import Profile
from astrai.playground.views.causes import Tally
from astrai.playground.views.pages import Owner
from astrai.playground.views.replay import Recording
from astrai.playground.views.sizing import Curves
from astrai.playground.views.text import RunSummary

KEEP_OWNERS = 4096  # requests remembered; the oldest are forgotten first (their pages show as another session's)
KEEP_VISITORS = knobs.SESSIONS  # as many as Gradio keeps sessions of (app.py's launch)
KEEP_POLLING = 4096  # open tabs counted on an engine: a session and a time each
KEEP_RECORDINGS = 128
SEEN_WITHIN_S = 10.0  # a tab polled within this long counts as a visitor on its engine
COUNT_EVERY_S = 1.0


@dataclass(frozen=True)
class ShownRun:
    """The run whose badges, token colouring and table a visitor sees: the latest one they started."""

    request_ids: tuple[int, ...]
    prompts: tuple[str, ...]
    profile: Profile  # the engine it ran on (its request ids are that engine's)
    caching: bool = True  # its engine looked prompts up in a prefix cache (off: the badges say so, not "0 cached")
    # a Compare's caching-off half carries its caching-on half: the badges and the table show both, each labelled
    caching_on_half: ShownRun | None = None


@dataclass(frozen=True)
class Playback:
    """A replay playing: its speed (a share of the recorded time), or a fixed pace of steps a second whatever the
    steps' recorded times; and where and when it started."""

    speed: float
    wall_start: float  # time.monotonic() at the start
    start_index: int
    steps_per_s: float | None = None  # set: the pace, and ``speed`` is not used


@dataclass
class Visitor:
    """One session's view state."""

    profile: Profile  # the engine this visitor is on: the scenario's, or their own settings'
    shared_pools: bool = False  # the lesson's small pools: the one every visitor shares, not a pool of their own
    recording: Recording | None = None
    following: bool = True  # live: the replay slider and the charts follow the latest step
    streaming_since: float | None = None  # monotonic start of this visitor's streaming run (charts redraw less)
    playback: Playback | None = None
    with_cache: RunSummary | None = None
    without_cache: RunSummary | None = None
    shown: ShownRun | None = None
    sizing: Curves | None = None  # the cache-sizing curves of their own requests, once replayed
    # the prompt tokens of every run since the page opened (or the lesson restarted) by cause: the lesson's end
    tally: Tally = field(default_factory=Tally)
    seen_at: float = field(default_factory=time.monotonic)

    def forget_shown(self) -> None:
        """A lesson step or scenario loads: no view keeps the last run (badges, token colouring, table, savings,
        replay), and the view is live again. A run still streaming stops writing them (``visitor.shown`` is no
        longer its own)."""
        self.shown, self.recording, self.with_cache, self.without_cache = None, None, None, None
        self.following, self.playback = True, None


class Visitors:
    """Every visitor's state, and the request -> (session, panel) map the privacy rule reads.

    Request ids are unique within the process across every engine (``astrai.request`` numbers them from one
    counter; the vLLM backend from its own), so one owner map serves every engine."""

    def __init__(self, default: Profile):
        self._default = default
        self._lock = threading.Lock()  # guards _visitors and _owners (not the visitors' fields)
        self._visitors: OrderedDict[str, Visitor] = OrderedDict()  # least recently active first
        self._owners: OrderedDict[int, Owner] = OrderedDict()
        self._polling: OrderedDict[str, float] = OrderedDict()  # tabs that only poll: session -> last seen
        self._recent: dict[Profile, set[str]] = {}  # sessions by profile, as counted at _counted_at
        self._counted_at = float("-inf")
        self._runs: Counter[tuple[Profile, str]] = Counter()  # runs streaming now, by engine and session

    def act(self, session: str) -> Visitor:
        """The visitor doing something (a run, a replay, a lesson step): created if new, moved to the front."""
        with self._lock:
            visitor = self._visitors.pop(session, None) or Visitor(self._default)
            self._polling.pop(session, None)
            visitor.seen_at = time.monotonic()
            self._visitors[session] = visitor
            while len(self._visitors) > KEEP_VISITORS:
                self._visitors.popitem(last=False)
            for old in list(self._visitors.values())[:-KEEP_RECORDINGS]:
                old.recording = None
            return visitor

    def peek(self, session: str) -> Visitor:
        """The visitor as a poll sees them: marked seen, never created in the table nor moved up the order (a tab
        that never acts reads a fresh default visitor)."""
        now = time.monotonic()
        with self._lock:
            visitor = self._visitors.get(session)
            if visitor is None:
                self._polling.pop(session, None)
                self._polling[session] = now
                while len(self._polling) > KEEP_POLLING:
                    self._polling.popitem(last=False)
                return Visitor(self._default)
        visitor.seen_at = now
        return visitor

    def leave(self, session: str) -> None:
        """The visitor's page closed (Gradio's unload): their state goes, recording and all. A reload is a new
        session, so nothing could read it again; the requests they own stay known (``owners``), as another
        visitor's view of their pages needs no more than that they were someone else's."""
        with self._lock:
            self._visitors.pop(session, None)
            self._polling.pop(session, None)

    def on(self, profile: Profile) -> int:
        """Visitors on ``profile``'s engine (at least the caller, who just polled or acted): those whose view is on
        it, seen recently, and those whose run streams on it, wherever they went since. Counted at most once a
        second for all profiles (every open tab asks each second); runs, at once."""
        return max(len(self._on(profile)), 1)

    def others_on(self, profile: Profile, session: str) -> int:
        """Visitors other than ``session`` on ``profile``'s engine now (``on``'s count): their pages are in its pool,
        and an action on the whole pool (Clear cache) would change their runs or their view."""
        return len(self._on(profile) - {session})

    def _on(self, profile: Profile) -> set[str]:
        now = time.monotonic()
        with self._lock:
            if now - self._counted_at >= COUNT_EVERY_S:
                recent: dict[Profile, set[str]] = {}
                for session, visitor in self._visitors.items():
                    if now - visitor.seen_at <= SEEN_WITHIN_S:
                        recent.setdefault(visitor.profile, set()).add(session)
                for session, seen in self._polling.items():  # a tab that only polls is on the default engine
                    if now - seen <= SEEN_WITHIN_S:
                        recent.setdefault(self._default, set()).add(session)
                self._recent, self._counted_at = recent, now
            running = {session for (on, session), runs in self._runs.items() if on == profile and runs > 0}
            return self._recent.get(profile, set()) | running

    @contextlib.contextmanager
    def running(self, profile: Profile, session: str) -> Iterator[None]:
        """A run of ``session``'s streaming on ``profile``'s engine: for as long as it does, the visitor counts as
        on that engine, even after moving to another scenario."""
        with self._lock:
            self._runs[(profile, session)] += 1
        try:
            yield
        finally:
            with self._lock:
                self._runs[(profile, session)] -= 1
                if self._runs[(profile, session)] <= 0:
                    del self._runs[(profile, session)]

    def register(self, request_ids: list[int], session: str) -> None:
        with self._lock:
            for panel, rid in enumerate(request_ids):
                self._owners[rid] = Owner(session, panel)
            while len(self._owners) > KEEP_OWNERS:
                self._owners.popitem(last=False)

    def requests(self) -> list[int]:
        """Every visitor's requests still remembered (the last ``KEEP_OWNERS``), oldest first: an engine's
        ladder counts them all, as token ids (``callbacks/ladder.py``)."""
        with self._lock:
            return list(self._owners)

    def requests_of(self, session: str) -> list[int]:
        """The session's requests still remembered (the last ``KEEP_OWNERS`` of all visitors'), oldest first."""
        with self._lock:
            return [rid for rid, owner in self._owners.items() if owner.session == session]

    def owners(self, request_ids: list[int]) -> dict[int, Owner]:
        """The known owners of these requests (a forgotten one is absent: its pages read "other session")."""
        with self._lock:
            return {rid: self._owners[rid] for rid in request_ids if rid in self._owners}
