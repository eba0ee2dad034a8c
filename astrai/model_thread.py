"""One thread that runs every forward of one prepared model, for every engine that shares it.

Why a thread and not a lock: OpenMP (libgomp, torch's) gives each thread that starts a parallel region a worker
pool of its own, and once the workers of all pools outnumber the CPUs it stops spinning between regions
(``openmp.py``). Engines sharing a model, each forwarding on its own loop thread, made two pools: with both busy,
their batches took 1.5-2.5x as long as the same batches one after the other (``python -m benchmarks.shared_engines``,
2-core AMD EPYC). On one thread there is one pool, and the forwards are serialised as they must be anyway (the
packed layers keep per-call state; a compiled graph is not safe for two threads at once).

Invariants: jobs run one at a time, in the order they were submitted; a job's result or exception reaches the
thread that submitted it, and nothing else; the thread frees its OpenMP pool once idle for ``IDLE_RELEASE_S``
(not after every job: a busy engine submits its next step within milliseconds, and a new pool costs more).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from astrai.openmp import release_pool

T = TypeVar("T")
IDLE_RELEASE_S = 0.05


class _Job:
    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


class ModelThread:
    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the model thread and return its result (or raise its exception) here."""
        if threading.current_thread() is self._thread:  # already on it (a job that calls back in)
            return fn()
        job = _Job(fn)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]

    def stop(self) -> None:
        """Finish the jobs already submitted, then end the thread (the caller must submit no more)."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_RELEASE_S)
            except queue.Empty:
                release_pool()  # idle: its workers would slow the pools of threads that compute
                job = self._jobs.get()
            if job is None:
                release_pool()
                return
            try:
                job.value = job.fn()
            except BaseException as exc:  # handed to the caller, who decides (a failed step fails its requests)
                job.error = exc
            finally:
                job.done.set()
