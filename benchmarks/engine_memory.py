"""What one more engine on an already loaded model costs in memory: ``python -m benchmarks.engine_memory [--rounds 3]``.

Each round is a fresh process: it loads the embedded model, then builds engines that share it (one prepared
model, one KV pool each), reading its resident set size (``VmRSS`` of ``/proc/self/status``) after each stage; then
it runs one short generation on every engine (the first forward allocates activations and oneDNN's scratch) and,
for comparison, loads a second copy of the model and runs one plain forward on it (the weights are mapped from the
safetensors file, resident once read): what an engine that did not share would need first, before its own packed
weights and KV.
The parent prints, per stage, the RSS and its growth over the stage before (min / median / max over the rounds),
next to the KV bytes the stage's pool holds (``kv_bytes_per_token`` x slots).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.host_cpu import cpu_name

MODEL = Path(__file__).resolve().parents[1] / "assets" / "models" / "tinystories-llama"  # the embedded model
ENGINES = (  # (label, options) of the engines built one after the other on the one model
    ("engine 1: 16 x 1024 pages, batch 64", dict(page_size=16, n_pages=1024, max_batch_size=64)),
    ("engine 2 (shares): 16 x 40 pages, batch 8", dict(page_size=16, n_pages=40, max_batch_size=8)),
    ("engine 3 (shares): 16 x 1024 pages, batch 64", dict(page_size=16, n_pages=1024, max_batch_size=64)),
)


def rss_bytes() -> int:
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child() -> None:
    """One round: print a JSON list of [stage, RSS bytes, KV bytes of that stage or null]."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astrai import InferenceEngine
    from astrai.model_runner import kv_bytes_per_token

    stages: list[tuple[str, int, int | None]] = [("imports (torch, transformers, astrai)", rss_bytes(), None)]
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, use_safetensors=True, dtype=torch.float32)
    stages.append(("model and tokenizer loaded", rss_bytes(), None))
    per_token = kv_bytes_per_token(model.config, torch.float32)
    engines = []
    for label, options in ENGINES:
        engines.append(InferenceEngine(model, tokenizer, **options))
        stages.append((label, rss_bytes(), per_token * options["page_size"] * options["n_pages"]))
    assert len({id(e.runner.prepared) for e in engines}) == 1  # one prepared model for all
    for engine in engines:
        engine.generate("Once upon a time", max_tokens=8)
    stages.append(("after one generate on each engine", rss_bytes(), None))
    copy = AutoModelForCausalLM.from_pretrained(MODEL, use_safetensors=True, dtype=torch.float32)
    with torch.inference_mode():  # safetensors maps the file: its weights are resident once a forward reads them
        copy(input_ids=torch.tensor([[1, 2, 3]]))
    stages.append(("for comparison: a second copy of the model, after one forward", rss_bytes(), None))
    del copy
    for engine in engines:
        engine.shutdown()
    print(json.dumps(stages))


def mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def spread(values: list[int]) -> str:
    return " / ".join(mib(f(values)) for f in (min, statistics.median, max))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return
    rounds = []
    for _ in range(args.rounds):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.engine_memory", "--child"], capture_output=True, text=True, check=True
        ).stdout
        rounds.append(json.loads(out.strip().splitlines()[-1]))
    import torch

    print(f"{MODEL.name}, float32, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} fresh")
    print(f"processes; CPU: {cpu_name()}\n")
    print("| stage | RSS MiB (min / median / max) | growth over the stage before, MiB (min / median / max) | KV MiB |")
    print("|---|---|---|---|")
    for i, (label, _, kv) in enumerate(rounds[0]):
        absolute = [r[i][1] for r in rounds]
        growth = [r[i][1] - r[i - 1][1] for r in rounds] if i else None
        print(f"| {label} | {spread(absolute)} | {spread(growth) if growth else '-'} | {mib(kv) if kv else '-'} |")


if __name__ == "__main__":
    main()
