"""Keeps OpenMP thread pools that sit idle from slowing down the one that computes.

Why: the engine runs the model on its own loop thread, and OpenMP (libgomp, which torch's CPU wheels use) gives
every thread that starts a parallel region a pool of worker threads of its own. libgomp counts the workers of every
pool, idle or not, and once they outnumber the CPUs it stops spinning between parallel regions (its documented
spin count, ``GOMP_SPINCOUNT``, drops from 300,000 to 100) and puts the workers to sleep, to be woken by a system
call at the next region. A model step runs thousands of parallel regions, so a pool left behind by the thread that
loaded the model (or by an idle engine) made the loop thread's steps up to twice as slow as the same steps on the
main thread (2 cores; docs/benchmarks.md).

``release_pool`` frees the calling thread's pool (OpenMP 5's ``omp_pause_resource_all``): the engine calls it on the
caller's thread once the model is prepared and whenever a caller submits requests (it is about to wait on the
engine), and on its loop thread whenever the loop goes idle. A thread that computes again simply gets a new pool.
Pools of threads that never call the engine are out of its reach. Where the runtime is not found (another
platform, another OpenMP), it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from _ctypes import CFuncPtr  # ctypes' function type (ctypes names it _CFuncPtr, which its stubs do not export)
from pathlib import Path

log = logging.getLogger("astrai")

OMP_PAUSE_SOFT = 1  # frees the threads; the runtime starts afresh at the next parallel region
RUNTIMES = ("libgomp", "libomp", "libiomp")


@functools.cache
def _pause() -> CFuncPtr | None:
    """``omp_pause_resource_all`` of the OpenMP runtime loaded in this process (torch's), or None."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if any(Path(path).name.startswith(name) for name in RUNTIMES):
                pause = ctypes.CDLL(path).omp_pause_resource_all
                pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                return pause
    except (OSError, AttributeError) as error:
        log.debug("no OpenMP runtime to release idle threads of: %s", error)
    return None


def release_pool() -> None:
    """Free the OpenMP worker threads of the calling thread, if it has any (a no-op inside a parallel region)."""
    pause = _pause()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)
