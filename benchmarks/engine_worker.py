"""The engine's row of ``bench.py --versus-vllm``: the engine as a user's script drives it, in its own process.

``InferenceEngine.from_pretrained(model, dtype=...)`` at its defaults (``--eager`` adds ``compile=False``), then,
for each JSON line on stdin, from the main thread: ``clear()``, ``generate_ids(prompts, max_tokens=...,
temperature=0.0)`` (the plain call, not a stream) and ``cache_stats()``. It answers one JSON line per job on stdout,
in the same form as ``benchmarks/vllm_worker.py``, so the benchmark drives both alike:

    in:  {"prompts": [[token ids], ...], "new_tokens": 64, "eos": 0}
    out: {"wall": s, "ttfts": [s per request], "decode_ms": ms | null, "prompt_computed": n,
          "generated": n, "outputs": [[token ids], ...]}

Only ``clear()`` and ``generate_ids`` are timed. ``generated`` is the growth of ``cache_stats().generated_tokens``
over the call: the tokens the engine really sampled. After the call (untimed), the finished requests' token ids,
TTFTs and cached prompt tokens come from ``events()`` and ``request_info``, and the decode step (the median step in
which every request decoded) from ``history``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a local checkpoint folder (safetensors and tokenizer)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")  # stdout carries the answers alone; logs go to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import torch  # noqa: PLC0415 - after the redirect

    from astrai import InferenceEngine  # noqa: PLC0415
    from astrai.observation import RequestFinished  # noqa: PLC0415

    started = time.perf_counter()
    options = {"compile": False} if args.eager else {}  # otherwise nothing but the dtype: the defaults
    engine = InferenceEngine.from_pretrained(args.model, dtype=args.dtype, **options)
    setup = {
        "load_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    print(json.dumps({"ready": True, "setup": setup}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        seq = max((e.seq for e in engine.events()), default=0)
        steps, generated = engine.steps, engine.cache_stats().generated_tokens
        started = time.perf_counter()
        engine.clear()  # every run starts cold; hits come only from sharing within the batch
        engine.generate_ids(job["prompts"], max_tokens=job["new_tokens"], temperature=0.0)
        wall = time.perf_counter() - started
        generated = engine.cache_stats().generated_tokens - generated
        ids = sorted(e.request for e in engine.events(after=seq) if isinstance(e, RequestFinished))  # submission order
        infos = engine.request_info(ids)
        if len(infos) != len(job["prompts"]):
            raise RuntimeError(f"{len(infos)} finished requests seen for {len(job['prompts'])} prompts")
        decode = [
            s.duration_s for s in engine.history(after_step=steps) if s.decode_tokens == len(s.requests) == len(ids)
        ]
        answer = {
            "wall": wall,
            "ttfts": [i.ttft for i in infos],
            "decode_ms": statistics.median(decode) * 1000 if decode else None,
            "prompt_computed": sum(i.prompt_tokens - (i.cached_tokens or 0) for i in infos),
            "generated": generated,
            "outputs": [list(i.output_ids) for i in infos],
        }
        print(json.dumps(answer), file=answers, flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
