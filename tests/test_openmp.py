"""Idle OpenMP pools are released, so they do not throttle the thread that computes (astrai/openmp.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from astrai import InferenceEngine
from astrai.openmp import release_pool


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2, reason="Linux, 2 threads")
def test_release_pool_frees_the_calling_threads_openmp_workers():
    for thread in threading.enumerate():  # earlier tests' engine loops: none may exit while threads are counted
        if thread.name == "astrai-engine":
            thread.join(timeout=10)
    workers = torch.get_num_threads() - 1  # the calling thread is the team's first member
    counts = {}

    def compute_then_release():
        a = torch.randn(512, 512)
        counts["idle"] = os_threads()
        for _ in range(5):
            a @ a  # a parallel region: this thread gets a pool of OpenMP workers
        counts["computing"] = os_threads()
        release_pool()
        counts["released"] = os_threads()

    worker = threading.Thread(target=compute_then_release)
    worker.start()
    worker.join()
    assert counts["computing"] == counts["idle"] + workers
    assert counts["released"] == counts["idle"]


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
