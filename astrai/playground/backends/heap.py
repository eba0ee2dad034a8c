"""Keeping the C heap small: few arenas, and its free memory given back to the system as runs end.

A class's burst of runs leaves glibc's arenas holding freed memory it does not return by itself: every gradio worker
thread allocates from an arena of its own (building figures, tokenizing, torch's temporaries), and glibc gives
memory back only from the top of the main heap. After one lockstep round of the lesson the app's VmRSS was 1,378 MiB,
and 1,185 MiB after one ``malloc_trim(0)`` (measured on a 2-core Intel Xeon with AMX): 193 MiB held free. Left
alone, that pool of free chunks grows with each burst, so a Space that runs for days looks like it leaks.

``limit_arenas`` (app.py calls it at start, before the server's threads exist) caps glibc's arenas: by default
each thread that meets a busy arena makes another, up to 8 per core, each holding its own free memory; the same round
ended at 1,224 MiB with two arenas, 1,118 MiB after a trim.

``HeapTrim.run_ended`` is called as each run of any engine ends: it trims in a thread of its own, at once when no
run is left (at most every ``quiet_interval_s``: a burst's last runs ending one by one cost one trim), and every
``busy_interval_s`` while runs go on (in a soak that never paused, VmRSS reached 1,789 MiB after 15 minutes, and the
trim as its last run ended took it to 1,499 MiB). A trim takes about 12 ms for 200 MiB of holes and 150,000 free
small chunks, 5 ms when there is little to give back, on the same machine; a run never waits for one, though a
thread that allocates from an arena being trimmed waits for its lock. Without glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable

M_ARENA_MAX = -8  # glibc's malloc.h


def _glibc(function: str) -> Callable[..., int] | None:
    """One of glibc's malloc functions, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):
        return None


def limit_arenas(count: int = 2) -> bool:
    """Cap the arenas glibc makes from now on at ``count``; whether it could (False without glibc)."""
    mallopt = _glibc("mallopt")
    return mallopt is not None and mallopt(M_ARENA_MAX, count) == 1


class HeapTrim:
    """Trims the C heap in the background as runs end: when none is left, and now and then while they go on."""

    def __init__(self, quiet_interval_s: float = 2.0, busy_interval_s: float = 30.0) -> None:
        self._trim = _glibc("malloc_trim")
        self.quiet_interval_s, self.busy_interval_s = quiet_interval_s, busy_interval_s
        self._lock = threading.Lock()
        self._last = time.monotonic()  # the last trim's start (the app's start counts as one)
        self._running = False
        self.trims = 0  # trims done (tests read it)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def run_ended(self, quiet: bool) -> None:
        """A run ended, and ``quiet``: no other run of any engine goes on. Trims in the background if the last trim
        is older than the interval for that case."""
        if self._trim is None:
            return
        interval = self.quiet_interval_s if quiet else self.busy_interval_s
        with self._lock:
            now = time.monotonic()
            if self._running or now - self._last < interval:
                return
            self._running, self._last = True, now
        threading.Thread(target=self._run, name="astrai-heap-trim", daemon=True).start()

    def _run(self) -> None:
        assert self._trim is not None
        try:
            self._trim(0)  # 0: keep no padding at the top of the heap; it returns free pages of every arena too
            self.trims += 1
        finally:
            with self._lock:
                self._running = False
