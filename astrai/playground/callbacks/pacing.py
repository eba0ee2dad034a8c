"""Pacing a run's stream: every run keeps a fixed cadence, and all runs together share the server's message budget.

Every yield of every run is one message that Gradio diffs, serializes and sends on the same two cores as the
engine: with 16 visitors at 25 messages/s each, the server would spend its time on messages, not tokens.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

TEXT_EVERY_S = 0.04  # panel text: at most one update per 40 ms (gradio sends every yield)
# Stream messages the server sends per second, all runs together; more runs, fewer each. 40, not 50: since runs keep
# their cadence (Pacer), 50 cost 16 visitors 5-19% of the engine's tokens/s (tools/loadtest.py, 3 A/B pairs).
MESSAGES_PER_S = 40


class StreamingRuns:
    """How many runs are streaming now, so each can pace its messages to share ``MESSAGES_PER_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0

    @contextlib.contextmanager
    def streaming(self) -> Iterator[None]:
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def interval(self) -> float:
        """Seconds between two text messages of one run."""
        return max(TEXT_EVERY_S, self._active / MESSAGES_PER_S)


class Pacer:
    """Lets one run's text messages out on a fixed cadence: a message goes with the first delta at or after each
    due time.

    Due times advance from the last due time, not from when the message went: deltas come once per engine step
    (about 10 ms for the embedded model), so timing from the message stretched a 40 ms interval to 48-52 ms and a
    run sent 21.5 messages a second where 25 were meant (measured with gradio_client). After a stall the next due
    time is at least half an interval away, so a late run does not burst to catch up.
    """

    def __init__(self, interval: Callable[[], float]):
        self._interval = interval
        self._due = float("-inf")  # the first delta goes at once: click to first token

    def ready(self, now: float) -> bool:
        if now < self._due:
            return False
        step = self._interval()
        self._due = max(self._due + step, now + step / 2)
        return True
