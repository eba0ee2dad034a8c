"""Where the forwards of engines sharing one prepared model run: one at a time, and while several are busy, on one
model thread.

Why a thread and not a lock: OpenMP (libgomp, torch's) gives each thread that starts a parallel region a worker
pool of its own, and once the workers of all pools outnumber the CPUs it stops spinning between regions
(``openmp.py``). Engines sharing a model, each forwarding on its own loop thread, made two pools: with both busy,
their batches took 1.5-2.5x as long as the same batches one after the other (``python -m benchmarks.shared_engines``,
2-core AMD EPYC). On one thread there is one pool, and the forwards are serialised as they must be anyway (the
packed layers keep per-call state; a compiled graph is not safe for two threads at once).

But an engine alone forwards on its own loop thread: the hand-off costs two thread wake-ups a step, and with a
browser on the same cores they cost the live view about a fifth of its visible updates (tools/measure.py: 17.5-18.5
against 22.3 a second with a second, idle engine on the model). So ``SharedForwards`` sends a forward to the model
thread only while another engine on the model has forwarded within ``BUSY_WINDOW_S``.

Invariants: forwards never overlap (``SharedForwards.lock`` is held around each, on either path); the model thread
runs its jobs in the order they were submitted, and a job's result or exception reaches the thread that submitted it,
and nothing else; a loop thread that moves to the model thread first frees the OpenMP pool its own forwards made; the
model thread frees its pool once idle for ``IDLE_RELEASE_S`` (not after every job: a busy engine submits its next
step within milliseconds, and a new pool costs more). A model served on a GPU (``openmp=False``) computes on no
OpenMP pool: nothing is released there, and the hand-off only serialises the forwards.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from astrai.openmp import release_pool

T = TypeVar("T")
IDLE_RELEASE_S = 0.05
BUSY_WINDOW_S = 0.5  # an engine that forwarded this recently is busy (its steps follow each other within ms)


class _Job:
    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


class ModelThread:
    def __init__(self, name: str, openmp: bool):
        self._openmp = openmp  # release the thread's OpenMP pool when idle
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
                self._release_pool()  # idle: its workers would slow the pools of threads that compute
                job = self._jobs.get()
            if job is None:
                self._release_pool()
                return
            try:
                job.value = job.fn()
            except BaseException as exc:  # handed to the caller, who decides (a failed step fails its requests)
                job.error = exc
            finally:
                job.done.set()

    def _release_pool(self) -> None:
        if self._openmp:
            release_pool()


class SharedForwards:
    """The forwards of the engines on one model: ``run`` one at a time, on the caller's thread or the model's."""

    def __init__(self, name: str, openmp: bool):
        self.lock = threading.Lock()  # held around every forward, whichever thread runs it
        self._busy_lock = threading.Lock()  # _forwarded_at and _direct, for a few dictionary operations
        self._forwarded_at: dict[object, float] = {}  # caller -> time of its last forward
        self._direct: set[object] = set()  # callers whose last forward ran on their own thread
        self._openmp = openmp  # the model computes on OpenMP threads (the CPU): a loop thread leaving frees its pool
        self.thread = ModelThread(name, openmp)

    def run(self, caller: object, forward: Callable[[], T]) -> T:
        now = time.monotonic()
        with self._busy_lock:
            self._forwarded_at[caller] = now
            crowded = any(other is not caller and now - at < BUSY_WINDOW_S for other, at in self._forwarded_at.items())
            left_direct = crowded and caller in self._direct
            (self._direct.discard if crowded else self._direct.add)(caller)

        def locked() -> T:
            with self.lock:
                return forward()

        if not crowded:
            return locked()
        if left_direct and self._openmp:
            release_pool()  # this loop thread's pool would throttle the model thread's
        return self.thread.call(locked)

    def forget(self, caller: object) -> None:
        """``caller`` forwards no more (its engine released the model)."""
        with self._busy_lock:
            self._forwarded_at.pop(caller, None)
            self._direct.discard(caller)

    def stop(self) -> None:
        self.thread.stop()
