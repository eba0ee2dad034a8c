"""What feeding the explainer from the engine's loop adds to a step: ``python -m benchmarks.explain_feed [--runs 30]``.

The engine hands every event to its ``LiveHistory`` as it stamps it (``InferenceEngine._emit`` -> ``push``), on the
loop thread, under the engine's lock: that is the only cost the step pays for explanations. The playground's
default engine (its settings, the embedded model) serves ``--runs`` six-panel runs of the lesson's prompts (the
runs of ``benchmarks.explain_tick``), with ``push`` timed per call and charged to its event's step. Reported: the
events and the pushes' time of a decode-only step (mean, and the 99th percentile, in µs: a timed push may include
the loop thread's wait for the GIL or a core) against that step's own duration (median, in ms), and the push of
one event alone (the same events pushed again into a fresh history on one thread, best of five).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict

from astrai.engine import InferenceEngine
from astrai.explain import LiveHistory
from astrai.observation import EngineEvent
from astrai.playground.backends.local import LocalBackend
from astrai.playground.backends.profiles import DEFAULT_PROFILE, EMBEDDED_MODEL
from benchmarks.explain_tick import served
from benchmarks.host_cpu import cpu_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="six-panel runs served")
    args = parser.parse_args()
    settings = DEFAULT_PROFILE.settings
    engine = InferenceEngine.from_pretrained(
        EMBEDDED_MODEL,
        page_size=settings.page_size,
        n_pages=settings.n_pages,
        max_batch_size=settings.max_batch_size,
        dtype=settings.dtype,
        event_log_size=1 << 20,  # every event kept, to push them again alone
    )
    backend = LocalBackend(engine, "default")
    live = engine._explainer
    push = live.push
    per_step: defaultdict[int, float] = defaultdict(float)

    def timed(event: EngineEvent) -> None:
        started = time.perf_counter()
        push(event)
        per_step[event.step] += time.perf_counter() - started

    live.push = timed  # type: ignore[method-assign]
    try:
        for run in range(args.runs):
            served(backend, run)
        samples = [s for s in engine.history() if s.decode_tokens and not s.prefill_tokens]
        pushes = sorted(per_step.get(s.step, 0.0) * 1e6 for s in samples)
        step_ms = statistics.median(s.duration_s for s in samples) * 1000
        events = engine.events()
        per_decode_step = Counter(e.step for e in events)
        decode_events = statistics.mean(per_decode_step.get(s.step, 0) for s in samples)
        best = float("inf")
        for _ in range(5):
            fresh = LiveHistory(
                max_keys=16384, max_requests=4096, pages=settings.n_pages, page_size=settings.page_size,
                prefix_caching=True,
            )  # fmt: skip
            started = time.perf_counter()
            for event in events:
                fresh.push(event)
            best = min(best, time.perf_counter() - started)
        kinds = Counter(type(e).__name__ for e in events)
        print(f"cpu: {cpu_name()}")
        print(f"engine: {settings.n_pages} pages x {settings.page_size} tokens; {args.runs} runs of 6 panels")
        mean = statistics.mean(pushes)
        print(
            f"decode-only steps: {len(samples)}, median {step_ms:.2f} ms, {decode_events:.2f} events each (mean); "
            f"their pushes: mean {mean:.1f} us, p99 {pushes[int(0.99 * (len(pushes) - 1))]:.1f} us per step "
            f"({mean / 1000 / step_ms * 100:.3f}% of the median step)"
        )
        print(
            f"one push alone: {best / len(events) * 1e6:.2f} us per event, best of 5 over {len(events)} ({dict(kinds)})"
        )
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
