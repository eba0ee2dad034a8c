"""Bounded polling for tests and tools: a wait that can never hang."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; returns its last value (bounded, never hangs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
