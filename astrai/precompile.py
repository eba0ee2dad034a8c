"""``python -m astrai.precompile CHECKPOINT --dtype D [--threads N]``: compile a checkpoint's forward for this machine
into the on-disk cache (``compiled_forward.py``), or find it there, then exit; one JSON line at the end says which.

Why a process of its own: a cold compile takes 20-80 s on 2 cores, most of it Python (dynamo's tracing, inductor's
code generation) holding the GIL, and under ``compiled_forward``'s process-wide lock. In the serving process every
visitor's stream, poll and engine loop then waited on it; and dynamo traces the model's modules as they are, while
the packed layers keep per-call state that a forward running beside it changes. Compiled here, at a lower
priority, it costs the serving process little; the serving process then loads the artifact (the cache key covers
the model as prepared, the CPU and the thread count, which is why ``--threads`` must be the serving process's).

``in_child`` is how a serving process uses it: a ``BackgroundCompile`` for ``InferenceEngine(background_compile=)``,
run on the engine's background thread while it serves eager.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch
from transformers import PreTrainedModel

from astrai import compiled_forward
from astrai.checkpoints import load_checkpoint
from astrai.compiled_forward import Compiled
from astrai.engine import InferenceEngine
from astrai.model_runner import BackgroundCompile

log = logging.getLogger("astrai")
TIMEOUT_S = 900.0  # a cold compile of a hub model takes minutes on 2 cores; past this, the child is stopped
NICE = 10  # how much lower the child's priority is: on 2 cores the serving process's visitors come first


def in_child(checkpoint: str, dtype: str) -> BackgroundCompile:
    """Build ``checkpoint``'s compiled forward (in ``dtype``) for the model it is called with: loaded from the cache
    where this machine has it, else compiled by ``python -m astrai.precompile`` in a child process at a lower
    priority and then loaded. It never traces the model in this process; None where the child could not compile
    (its lines, such as a missing C++ compiler, go to the log)."""

    def build(model: PreTrainedModel) -> Compiled | None:
        found = compiled_forward.load(model)
        if found is not None:
            return found
        run_child(checkpoint, dtype)
        return compiled_forward.load(model)

    return build


def run_child(checkpoint: str, dtype: str, progress: compiled_forward.Progress | None = None) -> int | None:
    """Run the compile of ``checkpoint`` in a child process at a lower priority and wait for it; its lines go to the
    log and to ``progress``. Its exit status, or None where it could not be started. The child ends with this
    process (it exits when its stdin, a pipe from here, closes) and is killed after ``TIMEOUT_S``."""
    command = [sys.executable, "-m", "astrai.precompile", checkpoint, "--dtype", dtype]
    command += ["--threads", str(torch.get_num_threads()), "--nice", str(NICE), "--exit-with-parent"]
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as exc:
        log.warning("could not start the precompile of %s: %s", checkpoint, exc)
        return None
    with child:
        watchdog = threading.Timer(TIMEOUT_S, child.kill)
        watchdog.start()
        try:
            assert child.stdout is not None
            for line in child.stdout:
                if line.strip():
                    log.info("precompile: %s", line.rstrip())
                    if progress is not None:
                        progress(line.strip()[:200])
        finally:
            watchdog.cancel()
    log.info("precompile of %s (%s) exited %s after %.0f s", checkpoint, dtype, child.returncode,
             time.monotonic() - started)  # fmt: skip
    return child.returncode


def _exit_when_stdin_closes() -> None:
    """The parent holds our stdin's other end: EOF means it is gone, and a compile for nobody only takes its CPU."""
    sys.stdin.read()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a local checkpoint directory or a hub name (safetensors only)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the serving process's count")
    parser.add_argument("--nice", type=int, default=NICE, help="lower this process's priority by this much first")
    parser.add_argument("--exit-with-parent", action="store_true", help="exit once stdin closes (the parent's pipe)")
    args = parser.parse_args(argv)
    if args.exit_with_parent:
        threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
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
