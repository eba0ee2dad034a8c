"""``python -m astrai.precompile CHECKPOINT --dtype D [--threads N]``: compile a checkpoint's forward for this machine
into the on-disk cache (``compiled_forward.py``), or find it there, then exit; one JSON line at the end says which.

Why a process of its own: a cold compile takes 20-80 s on 2 cores, most of it Python (dynamo's tracing, inductor's
code generation) holding the GIL, and under ``compiled_forward``'s process-wide lock. In the playground's process
every visitor's stream, poll and engine loop then waited on it. Compiled here, at a lower priority, it costs the
serving process nothing; the engine the playground then builds finds the artifact and loads it in seconds (the
cache key covers the model as prepared, the CPU and the thread count, which is why ``--threads`` must be the
serving process's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from astrai.checkpoints import load_checkpoint
from astrai.engine import InferenceEngine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a local checkpoint directory or a hub name (safetensors only)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the serving process's count")
    parser.add_argument("--nice", type=int, default=10, help="lower this process's priority by this much first")
    args = parser.parse_args(argv)
    os.nice(args.nice)  # the serving process's visitors come first; inductor's compile workers inherit it
    torch.set_num_threads(args.threads)
    model, tokenizer = load_checkpoint(args.checkpoint, args.dtype)
    with InferenceEngine(
        model, tokenizer, n_pages=8, dtype=args.dtype, compile=True, progress=lambda line: print(line, flush=True)
    ) as engine:
        compiled = engine.runner.compiled
    result = {"compiled": compiled is not None, "loaded": bool(compiled and compiled.loaded)}
    print(json.dumps(result | {"seconds": compiled.seconds if compiled else None}), flush=True)
    return 0 if compiled is not None else 1


if __name__ == "__main__":
    sys.exit(main())
