"""Soak with faults: ``python -m tools.soak --requests 2000``.

Many client threads send random requests to one engine with a small pool (so eviction and preemption happen all
the time): random lengths and shared prefixes, random sampling, random early cancellation, and exceptions
injected into the model's forward on random steps. Afterwards every request must have finished, been cancelled,
or failed with an error naming the cause; no page may leak; the cache invariants must hold; and every greedy
request that finished must equal transformers' own greedy output.

A hang is reported within ``STALL_S`` seconds: a watchdog sees any client that is waiting on a request and has
received nothing for that long, stops the run and counts it in ``hung``; every other wait is bounded too.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from astrai.engine import EngineClosedError, InferenceEngine, RequestFailedError
from tests.support.tiny_models import make_model, make_tokenizer, reference_generate

WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "a",
    "big",
    "red",
    "ball",
    "park",
    "sun",
    "tree",
    "Lily",
    "Tom",
    "happy",
    "day",
    "played",
    "with",
    "小猫",
    "😀",
]
PREFIXES = ["Once upon a time there was a little cat. ", "Lily and Tom went to the park. They played ", ""]
MAX_NEW = 24
STALL_S = 10.0  # a client waiting this long without a single stream item is hung
FINAL = {"finished", "cancelled", "failed"}


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter = field(default_factory=Counter)
    unexplained_errors: list[str] = field(default_factory=list)
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    hung: int = 0
    longest_wait_s: float = 0.0
    used_pages_after: int = -1
    evictions: int = 0
    preemptions: int = 0
    faults_injected: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not self.unexplained_errors
            and self.greedy_mismatches == 0
            and self.hung == 0
            and self.used_pages_after == 0
        )


class FaultyForward:
    """Wraps a model's forward: raises on a random share of calls, and can hang on one call (until released)."""

    def __init__(self, model: torch.nn.Module, rate: float, rng: random.Random, hang_on_call: int | None = None):
        self.forward, self.rate, self.rng, self.injected = model.forward, rate, rng, 0
        self.lock = threading.Lock()
        self.calls = 0
        self.hang_on_call = hang_on_call
        self.released = threading.Event()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.calls += 1
            hang = self.calls == self.hang_on_call
            fail = self.rng.random() < self.rate
            self.injected += fail
        if hang:
            self.released.wait()
        if fail:
            raise RuntimeError("injected fault in the model forward")
        return self.forward(*args, **kwargs)


class Watchdog:
    """When each client last saw progress; a client that is not waiting on anything is not watched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}

    def progress(self, client: int) -> None:
        with self._lock:
            self._last[client] = time.monotonic()

    def idle(self, client: int) -> None:
        with self._lock:
            self._last.pop(client, None)

    def stalled(self, limit_s: float) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(now - t > limit_s for t in self._last.values())


def run_soak(
    n_requests: int = 2000,
    clients: int = 8,
    seed: int = 0,
    fault_rate: float = 0.02,
    cancel_rate: float = 0.1,
    n_pages: int = 48,
    hang_on_call: int | None = None,
    stall_s: float = STALL_S,
) -> SoakReport:
    rng = random.Random(seed)
    tokenizer = make_tokenizer()
    model = make_model("llama", len(tokenizer), seed=seed)
    prompts = [rng.choice(PREFIXES) + " ".join(rng.choices(WORDS, k=rng.randint(1, 14))) for _ in range(60)]
    reference = {p: reference_generate(model, tokenizer, p, MAX_NEW) for p in prompts}
    report = SoakReport(requests=n_requests)
    # eager: the faults wrap the model's forward, which a compiled graph would not call
    engine = InferenceEngine(
        model, tokenizer, page_size=4, n_pages=n_pages, max_batch_size=8, max_batched_tokens=48, compile=False
    )
    faults = FaultyForward(model, fault_rate, random.Random(seed + 1), hang_on_call)
    model.forward = faults
    lock = threading.Lock()
    remaining = iter(range(n_requests))
    outcomes: list[tuple[list[str], dict, Outcome]] = []
    watchdog = Watchdog()

    def client(index: int) -> None:
        crng = random.Random(seed * 100 + index)
        while True:
            watchdog.idle(index)
            with lock:
                taken = list(itertools.islice(remaining, crng.randint(1, 3)))
            if not taken:
                return
            batch = [crng.choice(prompts) for _ in taken]
            greedy = crng.random() < 0.5
            sampling = dict(
                max_tokens=crng.randint(1, MAX_NEW),
                temperature=0.0 if greedy else crng.uniform(0.3, 1.5),
                top_p=crng.uniform(0.3, 1.0),
                top_k=crng.choice([0, 5, 50]),
                seed=crng.randrange(1000),
            )
            try:
                watchdog.progress(index)
                outcome = consume(
                    engine, batch, sampling, crng.random() < cancel_rate, crng, lambda: watchdog.progress(index)
                )
            except Exception as exc:  # a client-side surprise is a finding, not a reason to stop quietly
                with lock:
                    report.unexplained_errors.append(f"client: {exc!r}")
                continue
            with lock:
                outcomes.append((batch, sampling, outcome))

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not report.hung:
        time.sleep(0.1)
        report.hung = watchdog.stalled(stall_s)
    report.seconds = time.monotonic() - started
    if report.hung:  # stop the run: closed streams raise in the clients, which then return
        engine.shutdown(timeout=1)
        faults.released.set()
        for t in threads:
            t.join(timeout=5)
        report.faults_injected = faults.injected
        return report
    deadline = time.monotonic() + 5
    while engine.cache_stats().used_pages and time.monotonic() < deadline:  # cancels land at the next step
        time.sleep(0.01)
    for batch, sampling, outcome in outcomes:
        record(report, batch, sampling, outcome, reference)
    stats = engine.cache_stats()
    report.used_pages_after, report.evictions, report.preemptions = (
        stats.used_pages,
        stats.evictions,
        stats.preemptions,
    )
    report.faults_injected = faults.injected
    with engine._lock:
        engine.pool.check_invariants()
    engine.shutdown()
    return report


@dataclass
class Outcome:
    infos: list[dict]  # the engine's final account of each request
    wait_s: float


def consume(
    engine: InferenceEngine,
    batch: list[str],
    sampling: dict,
    cancel: bool,
    rng: random.Random,
    progress: Callable[[], None],
) -> Outcome:
    started = time.monotonic()
    stream = engine.generate(batch, stream=True, **sampling)
    stop_after = rng.randint(0, 6) if cancel else None
    try:
        for n, _ in enumerate(stream):
            progress()
            if stop_after is not None and n >= stop_after:
                stream.close()
                break
    except (RequestFailedError, EngineClosedError):
        pass  # the stream cancels its other requests; record() reads each request's own status and error
    waited = time.monotonic() - started
    deadline = time.monotonic() + 5  # a cancel lands at the engine's next step
    while True:
        infos = engine.request_info(stream.request_ids)
        if all(i.status in FINAL for i in infos) or time.monotonic() > deadline:
            return Outcome(infos, waited)
        time.sleep(0.005)


def record(
    report: SoakReport,
    batch: list[str],
    sampling: dict,
    outcome: Outcome,
    reference: dict[str, list[int]],
) -> None:
    """Judge each request by the engine's own account of it: a failure must name its cause."""
    report.longest_wait_s = max(report.longest_wait_s, outcome.wait_s)
    for info, prompt in zip(outcome.infos, batch, strict=True):
        report.outcomes[info.status] += 1
        if info.status == "failed" and "injected fault" not in (info.error or ""):
            report.unexplained_errors.append(info.error or "failed without a message")
        if info.status == "finished" and sampling["temperature"] == 0:
            report.greedy_checked += 1
            report.greedy_mismatches += list(info.output_ids) != reference[prompt][: sampling["max_tokens"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-rate", type=float, default=0.02)
    args = parser.parse_args()
    logging.getLogger("astrai").setLevel(logging.CRITICAL)  # the injected faults would flood the log
    report = run_soak(args.requests, args.clients, args.seed, args.fault_rate)
    for name, value in vars(report).items():
        print(f"{name}: {value}")
    print("OK" if report.ok else "FAILED")
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
