"""Keeping the C heap small: few arenas, and its free memory given back to the system when the engines go quiet.

A class's burst of runs leaves glibc's arenas holding freed memory it does not return by itself: every gradio worker
thread allocates from an arena of its own (building figures, tokenizing, torch's temporaries), and glibc gives
memory back only from the top of the main heap. After one lockstep round of the lesson the app's VmRSS was 1,378 MiB,
and 1,185 MiB after one ``malloc_trim(0)`` (measured on a 2-core Intel Xeon with AMX): 193 MiB held free. Left
alone, that pool of free chunks grows with each burst, so a Space that runs for days looks like it leaks.

``limit_arenas`` (app.py calls it at start, before the server's threads exist) caps glibc's arenas: by default
each thread that meets a busy arena makes another, up to 8 per core, each holding its own free memory; the same round
ended at 1,224 MiB with two arenas, 1,118 MiB after a trim.

``IdleTrim.idle`` is called when the last run of any engine ends: it trims in a thread of its own, at most once
every ``min_interval_s``, so a burst's runs ending one by one cost one trim, and a run never waits for one. On a
system without glibc (macOS, musl) it does nothing.
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


class IdleTrim:
    """Trims the C heap when asked, in the background, no more often than ``min_interval_s``."""

    def __init__(self, min_interval_s: float = 10.0) -> None:
        self._trim = _glibc("malloc_trim")
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last = -min_interval_s  # monotonic time of the last trim's start
        self._running = False
        self.trims = 0  # trims done (tests read it)

    @property
    def available(self) -> bool:
        return self._trim is not None

    def idle(self) -> None:
        """The engines went quiet: trim now in the background, unless one ran within ``min_interval_s``."""
        if self._trim is None:
            return
        with self._lock:
            now = time.monotonic()
            if self._running or now - self._last < self.min_interval_s:
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
