"""An engine's start, cold and warm: ``python -m benchmarks.startup --rounds 3 [--models embedded,smollm]
[--dtypes float32,bfloat16]``.

Every start is a fresh process (``--child``): it loads the model (the embedded one, or the random SmolLM2-135M-shaped
Llama of ``bench.py``), builds an engine at its defaults (compiled) and generates one token. A *cold* start has an
empty cache (``XDG_CACHE_HOME`` an empty folder): it compiles the model (and builds the C attention kernels); a *warm*
one reuses the folder that the cold start before it filled. Each round runs, per model and dtype, a cold start and
then a warm one. Printed per model, dtype and kind, min / median / max over the rounds: the compile (or the load of
the compiled forward) alone, the engine's construction (preparing the model, then compiling or loading), and the
process from its spawn to its first token (imports and model loading included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.host_cpu import cpu_name

MODELS = ("embedded", "smollm")
DTYPES = ("float32", "bfloat16")
FIGURES = {"compile_s": "compile or load s", "engine_s": "engine built s", "process_s": "spawn to first token s"}


def child(model_name: str, dtype: str, spawned: float) -> None:
    """One start: print a JSON object of its figures and whether the compiled forward was loaded."""
    from astrai import InferenceEngine
    from benchmarks.bench import embedded, smollm_shaped

    model, tokenizer = smollm_shaped() if model_name == "smollm" else embedded()
    started = time.perf_counter()
    engine = InferenceEngine(model, tokenizer, dtype=dtype, max_batch_size=8)
    built = time.perf_counter()
    engine.generate_ids([[1, 2, 3, 4]], max_tokens=1)
    ready = time.time()
    compiled = engine.runner.compiled
    engine.shutdown()
    if compiled is None:
        raise SystemExit("the engine serves eager: nothing compiled to time (see its warning)")
    figures = {"compile_s": compiled.seconds, "engine_s": built - started, "process_s": ready - spawned}
    print(json.dumps({"loaded": compiled.loaded, **figures}))


def start(model_name: str, dtype: str, cache: str) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=cache)
    command = [sys.executable, "-m", "benchmarks.startup", "--child", model_name, dtype, str(time.time())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} {dtype} start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "DTYPE", "SPAWNED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, dtype, spawned = args.child
        child(model_name, dtype, float(spawned))
        return
    cases = [(m, d) for m in args.models.split(",") for d in args.dtypes.split(",")]
    results: dict[tuple[str, str, str], list[dict]] = {(m, d, kind): [] for m, d in cases for kind in ("cold", "warm")}
    for round_ in range(args.rounds):
        for model_name, dtype in cases:
            cache = tempfile.mkdtemp(prefix="astrai-startup-")
            try:
                for kind in ("cold", "warm"):
                    result = start(model_name, dtype, cache)
                    if result["loaded"] != (kind == "warm"):
                        raise RuntimeError(f"a {kind} start {'loaded' if result['loaded'] else 'compiled'}")
                    results[model_name, dtype, kind].append(result)
                    print(f"round {round_ + 1}: {model_name} {dtype} {kind} {result}", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"CPU: {cpu_name()}\n{args.rounds} fresh processes each, min / median / max\n")
    print("| model | dtype | start | " + " | ".join(FIGURES.values()) + " |")
    print("|---" * (3 + len(FIGURES)) + "|")
    for (model_name, dtype, kind), runs in results.items():
        cells = []
        for figure in FIGURES:
            values = [run[figure] for run in runs]
            cells.append(f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}")
        print(f"| {model_name} | {dtype} | {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
