"""Two engines on one model, busy at once: ``python -m benchmarks.shared_engines [--rounds 3]``.

The playground runs one engine per profile over one loaded model; two visitors on two profiles make two engines
busy at once. Their forwards take turns (one prepared model, one forward at a time), so together they can at best
do the same work in the same time as one after the other. This measures how close they come: per round, the wall
time of each engine's batch alone, then of both batches submitted at once from two threads, and the ratio of the
second to the sum of the first two (1.0: no cost to sharing; above: overhead, such as OpenMP pools of two threads
throttling each other). Rounds interleave the three runs in one process; the CPU is named.

``--versus-loop-threads`` adds, in each round, the same measurement with every forward run on its engine's own loop
thread under the prepared model's lock (as before the model thread), so the two are compared within one run.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from astrai import InferenceEngine, load_checkpoint
from astrai.model_runner import PreparedModel
from benchmarks.host_cpu import cpu_name

MODEL = Path(__file__).resolve().parents[1] / "assets" / "models" / "tinystories-llama"  # the embedded model
PROMPTS = ["Once upon a time there was", "The little dog ran to", "Lily wanted to bake a", "Ben found a shiny"]


def timed(engine: InferenceEngine, max_tokens: int) -> float:
    engine.clear()
    started = time.perf_counter()
    engine.generate(PROMPTS, max_tokens=max_tokens)
    return time.perf_counter() - started


def both(a: InferenceEngine, b: InferenceEngine, max_tokens: int) -> float:
    started = time.perf_counter()
    threads = [threading.Thread(target=timed, args=(engine, max_tokens)) for engine in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def on_loop_threads(prepared: PreparedModel, caller, batch, tokens, positions, rows):
    """``PreparedModel.forward`` as it was: always on the calling loop thread, under the lock."""
    with prepared.forwards.lock:
        return prepared._forward(batch, tokens, positions, rows)


def measure(a: InferenceEngine, b: InferenceEngine, max_tokens: int) -> tuple[float, float, float]:
    alone_a, alone_b = timed(a, max_tokens), timed(b, max_tokens)
    return alone_a, alone_b, both(a, b, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--versus-loop-threads", action="store_true", help="also forward on the loop threads")
    args = parser.parse_args()
    model, tokenizer = load_checkpoint(str(MODEL))
    a = InferenceEngine(model, tokenizer, page_size=16, n_pages=1024, max_batch_size=64)
    b = InferenceEngine(model, tokenizer, page_size=16, n_pages=40, max_batch_size=8)
    print(f"CPU: {cpu_name()}; {len(PROMPTS)} prompts x {args.max_tokens} tokens on each engine, greedy")
    timed(a, 8), timed(b, 8)  # warm-up
    variants = {"model thread": PreparedModel.forward}
    if args.versus_loop_threads:
        variants["loop threads"] = on_loop_threads
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(1, args.rounds + 1):
        for name, forward in variants.items():
            PreparedModel.forward = forward
            alone_a, alone_b, together = measure(a, b, args.max_tokens)
            ratios[name].append(together / (alone_a + alone_b))
            print(
                f"round {round_}, forwards on the {name}: A alone {alone_a:.2f} s, B alone {alone_b:.2f} s, "
                f"both at once {together:.2f} s, ratio {ratios[name][-1]:.2f}"
            )
    for name, values in ratios.items():
        print(
            f"forwards on the {name}: ratio (both at once / one after the other) min {min(values):.2f} / median "
            f"{statistics.median(values):.2f} / max {max(values):.2f}"
        )
    a.shutdown(), b.shutdown()


if __name__ == "__main__":
    main()
