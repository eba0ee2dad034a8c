"""``LiveHistory``: an engine's ``KeyHistory``, fed every event as the engine emits it, so none is ever lost.

The engine calls ``push`` once per event, where it stamps it (its events are emitted one at a time, in ``seq``
order, under the engine's own lock); readers call ``explain``. Reading a ring of events only when asked would lose
whatever overflowed the ring between two calls, and every later miss would read "events lost" for good.

Threads: ``push`` never waits. Each event goes into an inbox (a ``deque``: its ``append`` and ``popleft`` are safe
across threads), then whoever holds the history's lock moves the inbox into the history, oldest first: ``push``
itself when the lock is free (so the inbox is empty after each push that finds it free), else the reader that
holds it, before it reads. The inbox therefore holds only the events emitted while one reader held the lock (a
few steps' at most), and the history, bounded by ``max_keys`` plus the pool's pages, holds the rest.

Moments: the engine passes its completed steps to ``explain``; every event of those steps was pushed before the
count was raised, so the history holds all of them once the inbox is drained, and a request admitted in the step
still running reads ``IN_PROGRESS`` rather than causes its step's end could change.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from astrai.explain.explainer import explain
from astrai.explain.history import KeyHistory
from astrai.explain.records import Explanation
from astrai.observation import EngineEvent, RequestInfo


class LiveHistory:
    """One page pool's key history, fed by its engine's ``push`` and read by ``explain`` (thread-safe)."""

    def __init__(self, *, max_keys: int, max_requests: int, pages: int, page_size: int, prefix_caching: bool) -> None:
        """``pages``: the pool's pages (the most keys it can hold cached); ``page_size`` and ``prefix_caching``: the
        engine's settings, fixed for its life."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._history = KeyHistory(max_keys=max_keys, max_requests=max_requests, max_live=pages)
        self._page_size, self._prefix_caching = page_size, prefix_caching
        self._lock = threading.Lock()  # the history: held to feed it, and by a reader for its whole answer
        self._inbox: deque[EngineEvent] = deque()

    def push(self, event: EngineEvent) -> None:
        """Take one event, the next in ``seq`` order (callers serialize their pushes). Never blocks: while a
        reader holds the history, the event waits in the inbox for that reader, or the next push, to feed it."""
        self._inbox.append(event)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def explain(
        self,
        infos: Sequence[RequestInfo],
        completed_step: int,
        viewer_owns: Callable[[int | None], bool] | None = None,
    ) -> list[Explanation]:
        """``astrai.explain.explain`` over every event pushed so far. ``completed_step``: the engine's completed
        steps, read after ``infos`` and before this call (a request admitted after them reads ``IN_PROGRESS``)."""
        with self._lock:
            self._drain()
            return explain(
                self._history,
                infos,
                page_size=self._page_size,
                prefix_caching=self._prefix_caching,
                viewer_owns=viewer_owns,
                completed_step=completed_step,
            )

    def keys(self) -> tuple[int, int]:
        """(keys kept, of them cached now): the bound's figures, for tests and the curious."""
        with self._lock:
            self._drain()
            return len(self._history), self._history.cached_keys()

    def _drain(self) -> None:
        """Feed the inbox to the history, oldest first (the caller holds ``_lock``)."""
        inbox, history = self._inbox, self._history
        while inbox:
            history.feed_one(inbox.popleft())
