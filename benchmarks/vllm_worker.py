"""The vLLM row of the benchmark: runs inside vLLM's own virtualenv, driven by ``benchmarks/bench.py``.

vLLM pins an older transformers than the engine, so it cannot share the benchmark's process. This worker loads
one checkpoint once (a vLLM start costs about a minute), then answers one JSON line per workload on stdin with one
JSON line on stdout, so the benchmark can interleave vLLM with the other methods round after round:

    in:  {"prompts": [[token ids], ...], "new_tokens": 64, "eos": 0}
    out: {"wall": s, "ttfts": [s per request], "decode_ms": ms | null, "prompt_computed": n,
          "generated": n, "outputs": [[token ids], ...]}

Its environment (offline, the KV space) is the one ``scripts/serve_vllm.py`` gives a server, set by the caller.
Every run starts with a cold prefix cache (``reset_prefix_cache``), as the engine's runs do. Prompts go in as token
ids (no tokenizer is loaded) and decoding is greedy, stopping at ``eos`` as ``generate`` does. TTFT is each request's
first token as seen by this client; the decode step is the median time between two consecutive engine steps in
which every request received a token. Everything else is vLLM's defaults for the CPU, with prefix caching on; the
caller picks the set-up through the environment (``bench.VLLM_SETUPS``: the in-process engine core, tuned, or the
multiprocess engine at its defaults). The ready line says where the model runs, on how many OpenMP threads and
CPUs, and with what ``LD_PRELOAD``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a local checkpoint folder (safetensors)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    # vLLM logs to stdout, and so do the engine processes it starts: keep stdout for the JSON answers alone
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    from vllm import LLM, SamplingParams  # noqa: PLC0415 - only importable inside vLLM's venv
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        seed=0,
    )
    engine = llm.llm_engine
    print(json.dumps({"ready": True, "setup": setup()}), file=answers, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print(json.dumps(run(engine, job, SamplingParams, TokensPrompt)), file=answers, flush=True)


def setup() -> dict:
    """Where vLLM's model runs, as this process sees it: in this process (the in-process engine core), or in its
    ``VLLM::Worker`` process (the multiprocess engine); that process's OpenMP threads, CPUs and ``LD_PRELOAD``."""
    import vllm  # noqa: PLC0415 - only importable inside vLLM's venv

    info = {
        "vllm": vllm.__version__,
        "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0",
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
    }
    worker = next((pid for pid in descendants(os.getpid()) if "VLLM::Worker" in _read(f"/proc/{pid}/cmdline")), None)
    if worker is None:  # the model runs here, on the caller's thread
        import torch  # noqa: PLC0415

        info.update(
            model_process="this one",
            torch_threads=torch.get_num_threads(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
            cpus=sorted(os.sched_getaffinity(0)),
            ld_preload=os.environ.get("LD_PRELOAD", ""),
        )
        return info
    environ = dict(item.split("=", 1) for item in _read(f"/proc/{worker}/environ").split("\0") if "=" in item)
    status = dict(line.split(":\t", 1) for line in _read(f"/proc/{worker}/status").splitlines() if ":\t" in line)
    info.update(
        model_process="VLLM::Worker",
        omp_num_threads=environ.get("OMP_NUM_THREADS"),
        cpus=status.get("Cpus_allowed_list", "?").strip(),
        ld_preload=environ.get("LD_PRELOAD", ""),
    )
    return info


def descendants(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in _read(f"/proc/{pid}/task/{task}/children").split():
            found += [int(child), *descendants(int(child))]
    return found


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as file:
            return file.read()
    except OSError:  # a process that ended meanwhile
        return ""


def run(engine, job: dict, sampling_params, tokens_prompt) -> dict:  # noqa: ANN001 - vLLM's types, see main
    engine.reset_prefix_cache()
    params = sampling_params(
        max_tokens=job["new_tokens"], temperature=0.0, stop_token_ids=[job["eos"]], detokenize=False
    )
    count = len(job["prompts"])
    started = time.perf_counter()
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(str(i), tokens_prompt(prompt_token_ids=prompt), params)
    first: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}

    def seen(out, now: float) -> bool:  # noqa: ANN001 - a vLLM RequestOutput
        i = int(out.request_id)
        ids = list(out.outputs[0].token_ids)
        if ids and i not in first:
            first[i] = now - started
        grew = len(ids) > len(tokens.get(i, []))
        tokens[i] = ids
        cached[i] = out.num_cached_tokens or 0
        return grew

    gaps = full_step_gaps(engine, count, seen)
    wall = time.perf_counter() - started
    return {
        "wall": wall,
        "ttfts": [first[i] for i in range(count)],
        "decode_ms": statistics.median(gaps) * 1000 if gaps else None,
        "prompt_computed": sum(len(p) - cached.get(i, 0) for i, p in enumerate(job["prompts"])),
        "generated": sum(len(tokens[i]) for i in range(count)),
        "outputs": [tokens[i] for i in range(count)],
    }


def full_step_gaps(
    engine,  # noqa: ANN001 - vLLM's LLMEngine
    count: int,
    seen: Callable[[Any, float], bool],
    on_full_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Step ``engine`` until its requests are done; return the seconds between consecutive *full* steps, those in
    which every one of the ``count`` requests received a token (the first full step computed the prompts).

    This is the decode step both vLLM benchmarks report. ``seen(output, now)`` takes each request output of a step
    and says whether its request grew; ``on_full_step(n)`` is told of the n-th full step as it ends.
    """
    last_full_step: float | None = None
    gaps: list[float] = []
    full_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        grew = sum(seen(out, now) for out in outputs)
        if grew == count:
            if last_full_step is not None:
                gaps.append(now - last_full_step)
            last_full_step = now
            full_steps += 1
            if on_full_step is not None:
                on_full_step(full_steps)
        elif grew:
            last_full_step = None
    return gaps


if __name__ == "__main__":
    main()
