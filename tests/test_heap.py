"""The C heap's free memory goes back to the system when the engines go quiet (astrai/playground/backends/heap.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from astrai.playground.backends.heap import IdleTrim
from tests.support.playground import playground, request
from tests.support.waiting import wait_until

# A thread's arena left with 150 MiB of holes: 64 KiB chunks (under glibc's mmap threshold, so from the arena), two
# of every three freed, the third kept so that no hole is at the top of the heap, where a free gives memory back by
# itself. Only a trim returns the holes' pages.
HOLES = textwrap.dedent(
    """
    import ctypes, threading, time
    from astrai.playground.backends.heap import IdleTrim

    def rss_mib():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    kept = []

    def fill():
        chunks = [libc.malloc(64 * 1024) for _ in range(3 * 800)]
        for chunk in chunks:
            ctypes.memset(chunk, 1, 64 * 1024)  # resident
        for i, chunk in enumerate(chunks):
            (kept.append if i % 3 == 2 else libc.free)(chunk)

    worker = threading.Thread(target=fill)
    worker.start()
    worker.join()
    before = rss_mib()
    trim = IdleTrim()
    trim.idle()
    deadline = time.monotonic() + 10
    while trim.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    print(before, rss_mib(), trim.trims)
    """
)


@pytest.mark.skipif(not IdleTrim().available, reason="needs glibc's malloc_trim")
def test_a_trim_gives_an_arenas_free_holes_back():
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True, check=True, timeout=60).stdout
    before, after, trims = out.split()
    assert int(trims) == 1
    assert float(before) - float(after) > 80, f"VmRSS {before} MiB before the trim, {after} after"


@pytest.mark.skipif(not IdleTrim().available, reason="needs glibc's malloc_trim")
def test_trims_come_at_most_once_an_interval():
    trim = IdleTrim(min_interval_s=3600)
    trim.idle()
    assert wait_until(lambda: trim.trims == 1)
    trim.idle()  # within the interval: none
    trim.idle()
    assert not wait_until(lambda: trim.trims > 1, timeout=0.5)


def test_the_last_run_ending_trims():
    with playground() as pg:
        trims = pg.ctx.engines.heap_trim
        trims.min_interval_s = 0.0  # every quiet moment trims
        fields = pg.fields(n_panels=2, prompt_1="Once upon a time", prompt_2="The dog", max_tokens=4)
        before = trims.trims
        for _ in pg.runs.run(fields, request("ann")):
            pass
        assert wait_until(lambda: trims.trims > before) or not trims.available


ARENAS = textwrap.dedent(
    """
    import ctypes, sys, threading
    from astrai.playground.backends.heap import limit_arenas

    assert limit_arenas(int(sys.argv[1]))
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    start = threading.Barrier(8)

    def churn():
        start.wait()
        for _ in range(20000):
            libc.free(libc.malloc(256))

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    libc.malloc_stats()  # one "Arena N:" paragraph per arena, on stderr
    """
)


@pytest.mark.skipif(not IdleTrim().available, reason="needs glibc")
def test_threads_share_the_arenas_the_limit_allows():
    def arenas(limit: int) -> int:
        run = subprocess.run([sys.executable, "-c", ARENAS, str(limit)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stderr.count("Arena ")

    assert arenas(2) <= 2 < arenas(64)
