"""What the playground keeps beside its backend: which session and panel each request belongs to.

That is the privacy rule's input: a visitor sees the text of pages their own requests use or stored, and every
other page as "other session". Callbacks run on Gradio's worker threads, so the map is guarded by one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from astrai.playground.backends.protocol import Backend
from astrai.playground.views.replay import Recording
from astrai.playground.views.text import Owner, RunSummary

KEEP_OWNERS = 4096  # requests remembered; the oldest are forgotten first (their pages show as another session's)
KEEP_VISITORS = 128  # visitors whose last run (replay, savings) is kept; the least recently active go first


@dataclass(frozen=True)
class ShownRun:
    """The run whose badges, token colouring and table a visitor sees: the latest one they started."""

    request_ids: tuple[int, ...]
    prompts: tuple[str, ...]


@dataclass
class Visitor:
    """One session's view state. Written by that session's callbacks only; each field is replaced whole."""

    recording: Recording | None = None
    following: bool = True  # live: the replay slider and the charts follow the latest step
    streaming_since: float | None = None  # monotonic start of this visitor's streaming run (charts redraw less)
    play: tuple[float, float, int] | None = None  # (speed, wall clock at start, index at start) while playing
    with_cache: RunSummary | None = None
    without_cache: RunSummary | None = None
    shown: ShownRun | None = None


class PlaygroundService:
    """The backend every visitor shares, and the request → (session, panel) map."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._owners: OrderedDict[int, Owner] = OrderedDict()
        self._owners_generation = backend.generation
        self._visitors: OrderedDict[str, Visitor] = OrderedDict()
        self._lock = threading.Lock()  # guards _owners, _owners_generation and _visitors

    def visitor(self, session: str) -> Visitor:
        with self._lock:
            visitor = self._visitors.pop(session, None) or Visitor()
            self._visitors[session] = visitor
            while len(self._visitors) > KEEP_VISITORS:
                self._visitors.popitem(last=False)
            return visitor

    def register(self, request_ids: list[int], session: str) -> None:
        with self._lock:
            self._forget_if_rebuilt()
            for panel, rid in enumerate(request_ids):
                self._owners[rid] = Owner(session, panel)
            while len(self._owners) > KEEP_OWNERS:
                self._owners.popitem(last=False)

    def owners(self, request_ids: list[int]) -> dict[int, Owner]:
        """The known owners of these requests (a request of a forgotten or other backend generation is absent)."""
        with self._lock:
            self._forget_if_rebuilt()
            return {rid: self._owners[rid] for rid in request_ids if rid in self._owners}

    def _forget_if_rebuilt(self) -> None:
        if self._owners_generation != self.backend.generation:
            self._owners.clear()
            self._owners_generation = self.backend.generation
