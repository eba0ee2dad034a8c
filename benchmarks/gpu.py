"""GPU benchmark: ``python -m benchmarks.gpu --rounds 3``: the engine at its defaults on CUDA against transformers'
``generate`` (a left-padded batch, greedy) on the same GPU.

Models and workloads are ``benchmarks/bench.py``'s: the embedded tinystories-llama and a random SmolLM2-135M-shaped
Llama, W1 (8 prompts sharing a 256-token prefix) and W2 (8 prompts of 16 to 300 tokens), 64 new tokens each. For each
model and dtype, the engine (``InferenceEngine(model, tokenizer, dtype=dtype)``: every other option at its default,
so on the GPU, without the CPU-only speed-ups) and transformers each get their own copy of the weights on the GPU,
run every workload once to warm up, then take turns, workload by workload, for ``--rounds`` rounds. tok/s counts the
tokens each really generated; the engine / generate ratio is taken within each round, then min / median / max over
the rounds. "greedy = generate" counts the prompts whose outputs agree in the last round (a padded batch, and
bfloat16, may legitimately differ: the tests hold the engine to transformers token for token, unpadded, in float32).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from astrai import InferenceEngine
from benchmarks.bench import (
    Result,
    count_range,
    embedded,
    make_workloads,
    run_engine,
    run_hf_generate,
    smollm_shaped,
    spread,
)
from benchmarks.host_cpu import cpu_name

MODELS = {
    "embedded": ("embedded tinystories-llama", embedded),
    "smollm": ("SmolLM2-135M-shaped Llama (random weights)", smollm_shaped),
}
ENGINE = "astrai (defaults)"


@dataclass
class Pair:
    """One workload run by both methods in one round, one after the other."""

    round: int
    workload: str
    engine: Result
    generate: Result

    @property
    def ratio(self) -> float:
        return self.engine.tok_s / self.generate.tok_s


def gpu_name(device: torch.device) -> str:
    """``NVIDIA H200, 140 GiB, compute capability 9.0 (CUDA 13.0, devices visible: 1)``: figures from two GPUs
    are not comparable, so the output starts with it (as ``host_cpu.cpu_name`` names the CPU)."""
    props = torch.cuda.get_device_properties(device)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor} "
        f"(CUDA {torch.version.cuda}, devices visible: {torch.cuda.device_count()})"
    )


def bench_model(
    load: Callable, dtype: str, names: list[str], rounds: int, device: torch.device, compile: bool = False
) -> list[Pair]:
    base, tokenizer = load()
    eos = tokenizer.eos_token_id
    workloads = [w for w in make_workloads(base.config.vocab_size) if w.name in names]
    reference = copy.deepcopy(base).to(device=device, dtype=getattr(torch, dtype))
    pairs: list[Pair] = []
    with InferenceEngine(copy.deepcopy(base), tokenizer, dtype=dtype, compile=compile) as engine:
        if engine.device != device:
            raise RuntimeError(f"the engine's default device is {engine.device}, not {device}")
        for work in workloads:  # warm-up: CUDA context, cuBLAS handles, the caching allocator's blocks
            run_engine(engine, work, ENGINE)
            run_hf_generate(reference, work, eos)
        for round_ in range(1, rounds + 1):
            for work in workloads:
                pair = Pair(round_, work.name, run_engine(engine, work, ENGINE), run_hf_generate(reference, work, eos))
                pairs.append(pair)
                print(
                    f"round {round_} {work.name} {dtype}: astrai {pair.engine.tok_s:.1f} tok/s "
                    f"({pair.engine.generated} tokens), generate {pair.generate.tok_s:.1f} tok/s "
                    f"({pair.generate.generated} tokens): {pair.ratio:.2f}x",
                    flush=True,
                )
    return pairs


def table(rows: list[tuple[str, str, list[Pair]]]) -> str:
    lines = [
        "| model | dtype | workload | rounds | astrai tok/s | generate tok/s | astrai / generate, per round | "
        "min / median / max | tokens per run: astrai; generate | greedy = generate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for title, dtype, pairs in rows:
        for workload in dict.fromkeys(p.workload for p in pairs):
            mine = [p for p in pairs if p.workload == workload]
            last = mine[-1]
            same = sum(a == b for a, b in zip(last.engine.outputs, last.generate.outputs, strict=True))
            counts = [count_range([getattr(p, m).generated for p in mine]) for m in ("engine", "generate")]
            lines.append(
                f"| {title} | {dtype} | {workload} | {len(mine)} | {spread([p.engine.tok_s for p in mine], '.1f')} | "
                f"{spread([p.generate.tok_s for p in mine], '.1f')} | {', '.join(f'{p.ratio:.2f}' for p in mine)} | "
                f"{spread([p.ratio for p in mine], '.2f', 'x')} | "
                f"{'; '.join(counts)} | "
                f"{same}/{len(last.engine.outputs)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded,smollm", help=f"comma list of: {', '.join(MODELS)}")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="the engine with compile=True (compiled in warm-up)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark runs on a GPU (python -m benchmarks.bench runs on the CPU)")
    device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"GPU: {gpu_name(device)}\nhost CPU: {cpu_name()}\n"
        f"torch {torch.__version__}, transformers {transformers.__version__}\n",
        flush=True,
    )
    rows = []
    for key in args.models.split(","):
        title, load = MODELS[key]
        for dtype in args.dtypes.split(","):
            print(f"### {title}, {dtype}", flush=True)
            pairs = bench_model(load, dtype, args.workloads.split(","), args.rounds, device, args.compile)
            rows.append((title + (", compiled" if args.compile else ""), dtype, pairs))
            torch.cuda.empty_cache()
    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
