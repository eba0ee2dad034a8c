"""Idle OpenMP pools are released, so they do not throttle the thread that computes (astrai/openmp.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from astrai import InferenceEngine
from astrai.openmp import release_pool

PR_SET_NAME = 15  # prctl(2): names the calling OS thread; a thread it then starts inherits the name


def threads_named(name: str) -> int:
    """The OS threads of this process named ``name`` (a thread that ends while they are counted is not counted)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            count += Path(f"/proc/self/task/{task}/comm").read_text().strip() == name
    return count


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2, reason="Linux, 2 threads")
def test_release_pool_frees_the_calling_threads_openmp_workers():
    """Counts only the thread's own OpenMP team: the thread takes a name no other has (its thread id: an OS name
    has 15 characters at most), and the workers libgomp starts for it inherit that name, so threads that other
    tests start or end meanwhile cannot change the count."""
    workers = torch.get_num_threads() - 1  # the calling thread is the team's first member
    counts = {}

    def compute_then_release():
        name = f"omp-{threading.get_native_id()}"
        assert ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode(), 0, 0, 0) == 0
        a = torch.randn(512, 512)
        counts["idle"] = threads_named(name)
        for _ in range(5):
            a @ a  # a parallel region: this thread gets a pool of OpenMP workers
        counts["computing"] = threads_named(name)
        release_pool()
        counts["released"] = threads_named(name)

    worker = threading.Thread(target=compute_then_release)
    worker.start()
    worker.join()
    assert counts == {"idle": 1, "computing": 1 + workers, "released": 1}


def test_the_engine_releases_the_pools_it_leaves_idle(model, tokenizer, monkeypatch):
    """The caller's pool once the model is prepared and at every submission; the loop's own whenever it idles."""
    released = []
    monkeypatch.setattr("astrai.engine.release_pool", lambda: released.append(threading.current_thread().name))
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False) as engine:
        caller = threading.current_thread().name
        assert released == [caller] or released == [caller, "astrai-engine"]  # the loop may have idled already
        engine.generate("Once upon a time", max_tokens=4)
        engine.generate("Once upon a time", max_tokens=4)
        assert released.count(caller) == 3  # construction, and each submission
        deadline = time.monotonic() + 5  # the loop idles just after it delivers the last token
        while released[-1] != "astrai-engine" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released[-1] == "astrai-engine"  # idle again once the requests are done
