"""One vLLM CPU decode step, op by op: ``python -m benchmarks.vllm_profile [--dtype bfloat16] [--batch 8]
[--context 300] [--steps 10]``.

It saves the SmolLM2-135M-shaped model (random weights) as safetensors to a temporary folder, then runs this file
again with the python of vLLM's venv (``scripts/serve_vllm.py``'s: ``$ASTRAI_VLLM_VENV``, else its default, made on
first use), with the environment that script gives a server. There, with vLLM's defaults for the CPU (its
multiprocess engine: the model runs in a worker process, bound to the cores vLLM picks) and prefix caching on, it
computes one full ``generate`` to warm up, then runs ``--batch`` prompts of ``--context`` random token ids (greedy,
``ignore_eos``) with ``add_request`` and ``step``, twice from a cold prefix cache: once unprofiled, timing the
decode steps as ``benchmarks/vllm_worker.py`` does (the time between two consecutive steps in which every request
received a token), and once with vLLM's own torch profiler (``profiler_config``, ``start_profile``) in the worker
for ``--steps`` decode steps in which all requests decode. Back here it reads the worker's trace and prints a
markdown table of one decode step: the self CPU time of the worker's ops per step, in groups (the matmuls split by
projection, from the shapes the profiler recorded), with the unprofiled median step beside it.

The compiled model's fused C++ kernels (norms, rotary, SiLU) are not profiler ops: their time is the self time of
``## Call CompiledFxGraph ##``. Recording shapes costs a little per op, so the op times run a few per cent high.
vLLM compiles the model at every start: a run takes a few minutes.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP_DECODE_STEPS = 3  # unprofiled decode steps before the profiler starts
STEP_ANNOTATION = "execute_context_"  # the worker's model-runner step: execute_context_0(0)_generation_8(8)
# Op name patterns per group, first match wins; the rest is other.
GROUPS = [
    ("GEMM", r"^_C::onednn_mm$|^aten::(mm|addmm|bmm|linear|matmul)$"),
    ("attention", r"^_C::cpu_attention_with_kv_cache$|^vllm::unified_attention_with_output$|^_C::get_scheduler"),
    ("KV write", r"^vllm::unified_kv_cache_update$|^_C::cpu_attn_reshape_and_cache$|^_C::compute_slot_mapping"),
    ("Inductor-fused kernels", r"^## Call CompiledFxGraph"),
    ("sampling", r"argmax|sampl|top_?[kp]|softmax"),
    ("Python glue", rf"^{STEP_ANNOTATION}|^Pregraph bytecode$|^AOTDispatcher|^Torch-Compiled Region"),
]


# ----- inside vLLM's venv: stdlib and vllm only ------------------------------------------------------------------
def profile_in_vllm(folder: Path, dtype: str, batch: int, context: int, steps: int) -> None:
    """Time and profile the decode steps; write ``result.json`` (and the trace under ``trace/``) to ``folder``."""
    from vllm import LLM, SamplingParams  # noqa: PLC0415 - only importable inside vLLM's venv
    from vllm.inputs import TokensPrompt  # noqa: PLC0415
    from vllm_worker import full_step_gaps  # noqa: PLC0415 - run as a script, this file's folder is on sys.path

    model = folder / "model"
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(context)] for _ in range(batch)]
    new_tokens = max(64, WARMUP_DECODE_STEPS + steps + 8)
    llm = LLM(
        model=str(model),
        dtype=dtype,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        seed=0,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(folder / "trace"),
            "torch_profiler_record_shapes": True,
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": False,
            "ignore_frontend": True,
        },
    )
    engine = llm.llm_engine

    def params() -> SamplingParams:  # a fresh one per use: generate() changes the one it is given
        return SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(tag: str, profile: bool) -> list[float]:
        """The batch from a cold prefix cache; the seconds between consecutive steps where every request grew."""
        engine.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=prompt), params())
        counts: dict[str, int] = {}

        def seen(out, now: float) -> bool:  # noqa: ANN001 - a vLLM RequestOutput
            grew = len(out.outputs[0].token_ids) > counts.get(out.request_id, 0)
            counts[out.request_id] = len(out.outputs[0].token_ids)
            return grew

        def profile_window(full_steps: int) -> None:  # the first full step computed the prompts
            if full_steps == 1 + WARMUP_DECODE_STEPS:
                llm.start_profile()
            elif full_steps == 1 + WARMUP_DECODE_STEPS + steps:
                llm.stop_profile()  # the worker has written its trace when this returns

        return full_step_gaps(engine, batch, seen, profile_window if profile else None)

    try:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(), use_tqdm=False)
        gaps = run("timed", profile=False)
        run("profiled", profile=True)
        trace = next((folder / "trace").glob("*.pt.trace.json"))
        events = json.loads(trace.read_text())["traceEvents"]
        worker = next(e["pid"] for e in events if e.get("cat") == "cpu_op")
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{worker}/environ").read_text().split("\0") if "=" in item
        )
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{worker}/status").read_text().splitlines())
        result = {
            "decode_s": gaps,
            "trace": str(trace),
            "omp_num_threads": environ.get("OMP_NUM_THREADS"),
            "cpus": status["Cpus_allowed_list"],
        }
        (folder / "result.json").write_text(json.dumps(result))
    finally:
        engine.engine_core.shutdown()


# ----- back in the benchmark's python: the trace, summarised ------------------------------------------------------
def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each op and step annotation with its self time (its duration less its children's), in µs."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in spans:
        by_thread[e["pid"], e["tid"]].append(e)
    own = {id(e): e["dur"] for e in spans}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in thread:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[id(stack[-1])] -= e["dur"]
            stack.append(e)
    return [(e, own[id(e)]) for e in spans]


def projections(config) -> dict[tuple[int, int], str]:  # noqa: ANN001 - a transformers LlamaConfig
    """The model's matmuls by (in, out) features, as vLLM fuses them (q/k/v and gate/up are one product each)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = hidden // heads
    names: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for shape, name in [
        ((hidden, (heads + 2 * kv_heads) * head_dim), "qkv_proj"),
        ((heads * head_dim, hidden), "o_proj"),
        ((hidden, 2 * config.intermediate_size), "gate_up_proj"),
        ((config.intermediate_size, hidden), "down_proj"),
        ((hidden, config.vocab_size), "lm_head"),
    ]:
        names[shape].append(name)
    return {shape: " / ".join(n) for shape, n in names.items()}


def report(trace: Path, result: dict, config, args: argparse.Namespace) -> str:  # noqa: ANN001 - a LlamaConfig
    from benchmarks.host_cpu import cpu_name  # noqa: PLC0415 - this file also runs as a script in vLLM's venv

    data = json.loads(trace.read_text())
    timed = self_times(data["traceEvents"])
    expected = f"execute_context_0(0)_generation_{args.batch}({args.batch})"
    annotations = [e["name"] for e, _ in timed if e["name"].startswith(STEP_ANNOTATION)]
    if not annotations or any(name != expected for name in annotations):
        raise SystemExit(f"the profiled steps are not all decode steps of the whole batch: {annotations}")
    steps = len(annotations)
    total = sum(t for _, t in timed)
    groups: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    gemms: dict[str, list[float]] = collections.defaultdict(list)
    names = projections(config)
    for e, t in timed:
        name = e["name"]
        group = next((g for g, pattern in GROUPS if re.search(pattern, name)), "other")
        groups[group][name].append(t)
        if name == "_C::onednn_mm":  # (out, input, bias, handler): out is M x N, input M x K
            dims = e["args"]["Input Dims"]
            shape = (dims[1][-1], dims[0][-1])
            gemms[f"{names.get(shape, '?')} ({shape[0]}→{shape[1]})"].append(t)

    def row(label: str, ops: str, times: list[float]) -> str:
        ms = sum(times) / steps / 1000
        return f"| {label} | {ops} | {len(times) / steps:.0f} | {ms:.2f} | {100 * sum(times) / total:.1f} |"

    decode_ms = [s * 1000 for s in result["decode_s"]]
    lines = [
        f"CPU: {cpu_name()}",
        f"vLLM {data.get('vllm_version', '?')} CPU, {args.dtype}: SmolLM2-135M-shaped Llama (random weights), "
        f"{args.batch} requests of {args.context} random prompt tokens, greedy",
        f"- decode step, unprofiled: median {statistics.median(decode_ms):.1f} ms over {len(decode_ms)} steps "
        f"(min {min(decode_ms):.1f}, max {max(decode_ms):.1f})",
        f"- worker process: OMP_NUM_THREADS={result['omp_num_threads']} (torch's thread count), bound to CPUs "
        f"{result['cpus']}",
        f"- profiled: {steps} decode steps, {len(timed) / steps:.0f} ops and annotations per step, their self time "
        f"{total / steps / 1000:.1f} ms per step",
        "",
        "| group | top ops | calls/step | ms/step | % of op time |",
        "|---|---|---|---|---|",
    ]
    for group, members in sorted(groups.items(), key=lambda kv: -sum(map(sum, kv[1].values()))):
        top = sorted(members, key=lambda name: -sum(members[name]))[:3]
        lines.append(row(group, ", ".join(f"`{name}`" for name in top), [t for ts in members.values() for t in ts]))
        if group == "GEMM":
            for label, times in sorted(gemms.items(), key=lambda kv: -sum(kv[1])):
                lines.append(row(f"↳ {label}", f"{statistics.median(times):.0f} µs/call", times))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    parser.add_argument("--inside-vllm", type=Path, help=argparse.SUPPRESS)  # the folder, in vLLM's venv
    args = parser.parse_args()
    if args.inside_vllm:
        profile_in_vllm(args.inside_vllm, args.dtype, args.batch, args.context, args.steps)
        return

    from benchmarks.bench import _launcher, smollm_shaped  # noqa: PLC0415 - not importable inside vLLM's venv

    launcher = _launcher()
    settings = launcher.parse_args([])  # $ASTRAI_VLLM_VENV, else its default; the server's KV space
    launcher.ensure_venv(settings.venv)
    model, _ = smollm_shaped()
    with tempfile.TemporaryDirectory(prefix="astrai-vllm-profile-") as name:
        folder = Path(name)
        model.save_pretrained(folder / "model", safe_serialization=True)
        command = [str(launcher.venv_python(settings.venv)), __file__, "--inside-vllm", name, "--dtype", args.dtype]
        command += ["--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps)]
        # vLLM logs to stdout, and so do its engine processes: keep stdout for the table
        subprocess.run(command, env=launcher.server_env(settings), stdout=sys.stderr, check=True)
        result = json.loads((folder / "result.json").read_text())
        print(report(Path(result["trace"]), result, model.config, args))


if __name__ == "__main__":
    main()
