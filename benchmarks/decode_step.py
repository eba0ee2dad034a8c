"""One decode step, A against B: ``python -m benchmarks.decode_step [--dtype bfloat16] [--model embedded]
[--variants eager,default,torch-attention,compiled]``.

The model runner alone (no scheduler, sampler or streams), on the SmolLM2-135M-shaped model or the embedded one, in
variants that each hold their own copy of the weights: the default (compiled, from the on-disk cache when this
machine compiled the model before; packed and fused weights, decode attention by the C kernel), the same with
decode attention through PyTorch (gather, then ``scaled_dot_product_attention``), eager (``compile=False``),
``compiled`` (``compile=True``, the default said explicitly), and ``plain-pages`` (the default with its laid-out
weights and KV pool on 4 KiB pages, ``huge_pages.py``). Every variant
first computes the same prompts, then the variants take turns computing one decode step for the whole batch,
step after step, so a drift of the machine hits all of them alike. Each round reports every variant's median step
and its ratio to the first variant, taken pair by pair within the round.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from astrai import huge_pages
from astrai.model_runner import SUPPORTED_DTYPES, ModelRunner, Preparation
from astrai.request import Request
from astrai.sampling import SamplingParams
from benchmarks.bench import embedded, smollm_shaped
from benchmarks.host_cpu import cpu_name

PAGE_SIZE = 16
VARIANTS = {
    "default": dict(),
    "eager": dict(compile=False),
    "torch-attention": dict(attention_kernel=False),
    "compiled": dict(compile=True),
    "plain-pages": dict(),  # the default on 4 KiB pages (huge_pages.ENABLED off while it is built)
}


def decode_batch(runner: ModelRunner, batch: int, context: int, vocab: int) -> list[tuple[Request, int]]:
    """``batch`` requests whose first ``context`` tokens are computed; the step computes token ``context + 1``."""
    gen = torch.Generator().manual_seed(0)
    pages_each = (context + 1 + runner.page_size - 1) // runner.page_size
    requests = []
    for i in range(batch):
        ids = torch.randint(1, vocab, (context + 1,), generator=gen).tolist()
        req = Request(prompt_ids=ids, params=SamplingParams())
        req.pages = list(range(i * pages_each, (i + 1) * pages_each))
        runner.step([(req, context)])
        req.num_computed = context
        requests.append(req)
    return [(req, 1) for req in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=sorted(SUPPORTED_DTYPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--model", choices=("smollm", "embedded"), default="smollm")
    parser.add_argument("--variants", default="eager,default", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--profile", action="store_true", help="then print each variant's ops over --steps steps")
    args = parser.parse_args()
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        parser.error(f"unknown variants: {', '.join(sorted(unknown))}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = smollm_shaped() if args.model == "smollm" else embedded()
    vocab = model.config.vocab_size
    n_pages = args.batch * (args.context // PAGE_SIZE + 2)
    runners, work = {}, {}
    for name in chosen:
        preparation = Preparation.resolve(SUPPORTED_DTYPES[args.dtype], torch.device("cpu"), **VARIANTS[name])
        started = time.perf_counter()
        huge_pages.ENABLED = name != "plain-pages"
        runner = ModelRunner(copy.deepcopy(model), n_pages, PAGE_SIZE, preparation)
        work[name] = decode_batch(runner, args.batch, args.context, vocab)
        runner.step(work[name])
        runners[name] = runner
        print(f"{name}: ready in {time.perf_counter() - started:.1f} s (compile, prefill, first decode)", flush=True)
    first = next(iter(runners))
    print(
        f"\nCPU: {cpu_name()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, "
        f"{args.dtype}, batch {args.batch}, "
        f"context {args.context}\n\n| round | "
        + " | ".join(f"{n} ms" for n in runners)
        + " | "
        + " | ".join(f"{first} / {n}" for n in list(runners)[1:])
        + " |"
    )
    print("|---" * (2 * len(runners)) + "|")
    for r in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.steps):
            for name, runner in runners.items():
                started = time.perf_counter()
                runner.step(work[name])
                times[name].append((time.perf_counter() - started) * 1000)
        ratios = [statistics.median(a / b for a, b in zip(times[first], times[n], strict=True)) for n in runners]
        print(
            f"| {r + 1} | "
            + " | ".join(f"{statistics.median(t):.1f}" for t in times.values())
            + " | "
            + " | ".join(f"{x:.2f}x" for x in ratios[1:])
            + " |",
            flush=True,
        )
    if args.profile:
        for name, runner in runners.items():
            print(f"\n{name}, {args.steps} steps:\n{op_table(runner, work[name], args.steps)}", flush=True)


def op_table(runner: ModelRunner, work: list[tuple[Request, int]], steps: int) -> str:
    """torch.profiler's table of the ops of ``steps`` decode steps, by self time (the C kernel's time is
    ``astrai::paged_attention``'s self time)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(steps):
            runner.step(work)
    return profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


if __name__ == "__main__":
    main()
