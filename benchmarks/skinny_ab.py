"""Decode steps with the skinny product kernel against the same steps through oneDNN alone:
``python -m benchmarks.skinny_ab [--model embedded] [--dtype bfloat16] [--batch 8] [--rounds 3]``.

One model runner at the engine's defaults (compiled, packed weights, C attention); the variants differ only in
whether each packed layer may use its skinny copy (``FusedProduct.skinny``, switched per step), so both run the same
graph on the same weights in one process, step after step. Each round prints both medians and their ratio (oneDNN
over skinny, pair by pair: above 1, the kernel is faster). Then each distinct weight shape of the model alone, one
product at a time, at 1 to 32 rows (``--shapes``): where the kernel stops paying (``skinny_linear.SKINNY_ROWS``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from astrai.model_runner import SUPPORTED_DTYPES, ModelRunner, Preparation
from astrai.packed_linear import FusedProduct
from benchmarks.bench import embedded, smollm_shaped
from benchmarks.decode_step import PAGE_SIZE, decode_batch
from benchmarks.host_cpu import cpu_name


def timed(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm", "embedded"), default="embedded")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(SUPPORTED_DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help="steps per variant per round")
    parser.add_argument("--shapes", action="store_true", help="then each weight shape alone, at 1 to 32 rows")
    args = parser.parse_args()
    model, _ = embedded() if args.model == "embedded" else smollm_shaped()
    dtype = SUPPORTED_DTYPES[args.dtype]
    pages = args.batch * ((args.context + 1) // PAGE_SIZE + 1)
    runner = ModelRunner(model, pages, PAGE_SIZE, Preparation.resolve(dtype, torch.device("cpu")))
    layers = [m for m in model.modules() if isinstance(m, FusedProduct)]
    kernels = {layer: layer.skinny for layer in layers}
    if not any(kernels.values()):
        raise SystemExit("the skinny kernel serves no layer here (no compiler, or no AVX512-BF16 for bfloat16)")

    def use(skinny: bool) -> None:
        for layer, kernel in kernels.items():
            layer.skinny = kernel if skinny else None

    work = decode_batch(runner, args.batch, args.context, model.config.vocab_size)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; {args.model} {args.dtype}, {args.batch} rows")
    for round_ in range(1, args.rounds + 1):
        pairs = []
        for _ in range(args.steps):
            step = []
            for skinny in (False, True):
                use(skinny)
                step.append(timed(lambda: runner.step(work), 1)[0])
            pairs.append(step)
        onednn, skinny = (statistics.median(p[i] for p in pairs) * 1e3 for i in range(2))
        ratio = statistics.median(a / b for a, b in pairs)
        print(f"round {round_}: oneDNN {onednn:.3f} ms, skinny {skinny:.3f} ms a step; oneDNN/skinny {ratio:.3f}")
    use(True)
    if not args.shapes:
        return
    with torch.inference_mode():
        for layer in {tuple(layer.packed_weight.shape): layer for layer in layers}.values():
            width = sum(layer.widths)
            for rows in (1, 4, 8, 16, 32):
                x = torch.randn(rows, layer.originals[0][0].in_features).to(dtype)
                variants = {
                    "onednn": partial(torch.ops.mkldnn._linear_pointwise, x, layer.packed_weight, None, "none", [], ""),
                    "skinny": partial(layer.skinny.multiply, x, None),
                }
                times = {name: statistics.median(timed(call, 300)) * 1e6 for name, call in variants.items()}
                print(
                    f"{width} x {x.shape[1]}, {rows} rows: oneDNN {times['onednn']:.1f} us, "
                    f"skinny {times['skinny']:.1f} us, oneDNN/skinny {times['onednn'] / times['skinny']:.2f}"
                )


if __name__ == "__main__":
    main()
