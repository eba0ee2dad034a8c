"""Benchmark: ``python -m benchmarks.bench`` runs the engine (prefix caching on and off, and with its weights left
unpacked) against transformers' ``generate`` on a padded batch and transformers' continuous batching,
interleaved in one process.

It prints a markdown table per model, after a line naming the CPU (``benchmarks/host_cpu.py``). Each method gets
its own copy of the weights, because every method switches the model's attention implementation (and the engine its
linear layers) to its own. vLLM CPU (its own venv) runs in two set-ups, ``VLLM_SETUPS``: its offline engine core
in-process and tuned, and its multiprocess engine at its defaults; "vs vLLM" is against the faster of the two.

``--versus-vllm`` is the engine against vLLM alone, every method in a process of its own, fresh each round: the
engine as a user's script drives it (``benchmarks/engine_worker.py``: ``InferenceEngine.from_pretrained`` at its
defaults, then ``clear()``, ``generate_ids`` and ``cache_stats()`` from the main thread), with the tokens each run
really generated; see ``versus_vllm``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from astrai import InferenceEngine
from benchmarks.host_cpu import cpu_name
from benchmarks.vllm_worker import descendants

DEFAULT_ENGINE = "astrai, prefix caching on"
REPO = Path(__file__).resolve().parents[1]
EMBEDDED = REPO / "assets" / "models" / "tinystories-llama"
VLLM_METHOD = "vLLM CPU"


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: int


@dataclass
class Result:
    method: str
    wall: float
    generated: int
    ttft: float
    prompt_computed: int
    decode_ms: float | None
    peak_rss_mb: float | None
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall


class RssSampler:
    """Peak resident memory while a method runs, sampled from /proc (ru_maxrss never goes back down)."""

    def __enter__(self) -> RssSampler:
        self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ----- models and workloads -------------------------------------------------------------------------------
def smollm_shaped() -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A random-initialized Llama with SmolLM2-135M's shape, and a word-level tokenizer over its vocab."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t0", pad_token="t0")
    return model, hf_tokenizer


def embedded() -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED, use_safetensors=True).eval()
    return model, AutoTokenizer.from_pretrained(EMBEDDED)


def make_workloads(vocab: int, seed: int = 0) -> list[Workload]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    prefix = ids(256)
    shared = [prefix + ids(32) for _ in range(8)]
    lengths = [16 + (300 - 16) * i // 7 for i in range(8)]
    return [
        Workload("W1", shared, 64),
        Workload("W2", [ids(n) for n in lengths], 64),
        Workload("W1-16", shared, 16),
    ]


# ----- methods --------------------------------------------------------------------------------------------
def run_engine(engine: InferenceEngine, work: Workload, name: str) -> Result:
    engine.clear()  # every run starts cold; hits come only from sharing within the batch
    steps_before = engine.steps
    with RssSampler() as rss:
        started = time.perf_counter()
        stream = engine.generate_ids(work.prompts, max_tokens=work.new_tokens, stream=True)
        for _ in stream:
            pass
        wall = time.perf_counter() - started
    infos = engine.request_info(stream.request_ids)
    steps = engine.history(after_step=steps_before)
    decode = [s.duration_s for s in steps if s.decode_tokens == len(s.requests) == len(work.prompts)]
    return Result(
        method=name,
        wall=wall,
        generated=sum(i.generated_tokens for i in infos),
        ttft=statistics.median(i.ttft for i in infos),
        prompt_computed=sum(i.prompt_tokens - (i.cached_tokens or 0) for i in infos),
        decode_ms=statistics.median(decode) * 1000 if decode else None,
        peak_rss_mb=rss.peak,
        outputs=[list(i.output_ids) for i in infos],
    )


class _StepClock(LogitsProcessor):
    """Time stamps each generate step (the processor runs once per step, after the forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf_generate(model: PreTrainedModel, work: Workload, eos: int) -> Result:
    """``generate`` on a left-padded batch, greedy, on the model's device."""
    longest = max(len(p) for p in work.prompts)
    pad = eos
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in work.prompts]).to(model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in work.prompts]).to(model.device)
    clock = _StepClock()
    with RssSampler() as rss, torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=work.new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
            logits_processor=LogitsProcessorList([clock]),
        )
        if out.is_cuda:
            torch.cuda.synchronize(out.device)  # the run ends when the GPU has done its work, not when it is queued
        wall = time.perf_counter() - started
    outputs = [_until_eos(row[longest:].tolist(), eos) for row in out]
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    return Result(
        method="transformers generate",
        wall=wall,
        generated=sum(len(o) for o in outputs),
        ttft=clock.times[0] - started,
        prompt_computed=input_ids.numel(),
        decode_ms=statistics.median(steps) * 1000 if steps else None,
        peak_rss_mb=rss.peak,
        outputs=outputs,
    )


def run_hf_continuous(manager, work: Workload) -> Result:
    with RssSampler() as rss:
        started = time.perf_counter()
        ids = manager.add_requests(work.prompts, max_new_tokens=work.new_tokens, record_timestamps=True)
        results = {}
        deadline = time.monotonic() + 1800
        while len(results) < len(ids) and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
        wall = time.perf_counter() - started
    ordered = [results[i] for i in ids]
    gaps = [b - a for r in ordered for a, b in zip(r.timestamps, r.timestamps[1:], strict=False)]
    return Result(
        method="transformers continuous batching",
        wall=wall,
        generated=sum(len(r.generated_tokens) for r in ordered),
        ttft=statistics.median(r.timestamps[0] - started for r in ordered),
        prompt_computed=sum(len(p) for p in work.prompts),
        decode_ms=statistics.median(gaps) * 1000,
        peak_rss_mb=rss.peak,
        outputs=[list(r.generated_tokens) for r in ordered],
    )


# ----- the methods in processes of their own -----------------------------------------------------------------
VLLM_IN_PROCESS = "in-process tuned"
VLLM_MULTIPROCESS = "multiprocess defaults"
VLLM_SETUPS = (VLLM_IN_PROCESS, VLLM_MULTIPROCESS)
TUNED = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD")
TCMALLOC = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64")


def vllm_preloads(venv: Path) -> tuple[list[Path], list[str]]:
    """What vLLM's CPU docs ask to preload, where found: tcmalloc (Debian: ``apt-get install libtcmalloc-minimal4``)
    and the ``libiomp5.so`` that vllm-cpu installs into its venv's ``lib/``. Returns (found, what is missing)."""
    tcmalloc = next((Path(d, n) for n in TCMALLOC for d in (venv / "lib", *LIBRARY_DIRS) if Path(d, n).exists()), None)
    iomp = venv / "lib" / "libiomp5.so"
    found = [p for p in (tcmalloc, iomp if iomp.exists() else None) if p is not None]
    missing = [] if tcmalloc else ["tcmalloc (apt-get install libtcmalloc-minimal4)"]
    return found, missing + ([] if iomp.exists() else [f"libiomp5.so (not in {venv / 'lib'})"])


def vllm_env(setup: str, venv: Path) -> dict[str, str]:
    """The environment of a vLLM worker: ``scripts/serve_vllm.py``'s (offline, no usage stats, its KV space), and

    - ``VLLM_IN_PROCESS``: the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model runs on
      the caller's thread, on torch's default threads, one per core), no core reserved for a scheduler process
      (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), tcmalloc and vLLM's libiomp5 in ``LD_PRELOAD`` where found;
    - ``VLLM_MULTIPROCESS``: vLLM's defaults (the engine core and the model in processes of their own; on x86 one
      core is reserved for the scheduler, so on 2 cores the model runs on one OpenMP thread).
    """
    launcher = _launcher()
    env = launcher.server_env(launcher.parse_args([]))
    for name in TUNED:
        env.pop(name, None)
    if setup == VLLM_IN_PROCESS:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        found, _ = vllm_preloads(venv)
        if found:
            env["LD_PRELOAD"] = ":".join(map(str, found))
    elif setup != VLLM_MULTIPROCESS:
        raise ValueError(f"unknown vLLM set-up {setup!r}; one of {VLLM_SETUPS}")
    return env


class Worker:
    """One method in a process of its own, loaded once, run one workload at a time: one JSON line in (the job),
    one out (the run), as ``benchmarks/vllm_worker.py`` and ``benchmarks/engine_worker.py`` answer. Its first line
    says it is ready, and how it is set up (``setup``)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]):
        self.name = name
        started = time.perf_counter()
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._answer()
        if not ready.get("ready"):
            raise RuntimeError(f"{name}: the worker did not start")
        self.setup: dict = {"start_s": round(time.perf_counter() - started, 1), **ready.get("setup", {})}

    def _answer(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited (code {self._process.wait()}); its log is above")
        return json.loads(line)

    def run(self, work: Workload, eos: int) -> Result:
        job = {"prompts": work.prompts, "new_tokens": work.new_tokens, "eos": eos}
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        out = self._answer()
        return Result(
            method=self.name,
            wall=out["wall"],
            generated=out["generated"],
            ttft=statistics.median(out["ttfts"]),
            prompt_computed=out["prompt_computed"],
            decode_ms=out["decode_ms"],
            peak_rss_mb=None,  # another process tree, not comparable with the in-process methods
            outputs=out["outputs"],
        )

    def cpu_seconds(self) -> float:
        """CPU time used so far by every thread of the worker's processes (vLLM's engine core and model workers)."""
        return sum(_process_cpu_seconds(pid) for pid in [self._process.pid, *descendants(self._process.pid)])

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _process_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # a process that ended meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all its threads


IDLE_SHARE = 0.1  # of one core, over IDLE_WINDOW_S: a worker that uses less is idle
IDLE_WINDOW_S = 0.25
IDLE_TIMEOUT_S = 15.0


def wait_until_idle(workers: list[Worker]) -> float:
    """Wait until no worker uses a CPU; return the seconds waited.

    Why: vLLM's multiprocess engine keeps about one core busy for a second after each run (its processes measured
    1.0 core for 1 s, then none, on the 2-core AMD EPYC). The method whose turn came next ran on the other core
    alone, and the rotation put the engine right after it in every round: its warm-up and first timed run took the
    loss (a W1 bfloat16 run at 540 tok/s against about 2,000 for the others). Each method now starts on an idle
    machine; its own runs still follow each other as its users' would."""
    started = time.perf_counter()
    while time.perf_counter() - started < IDLE_TIMEOUT_S:
        before = [w.cpu_seconds() for w in workers]
        time.sleep(IDLE_WINDOW_S)
        busy = [w.cpu_seconds() - b for w, b in zip(workers, before, strict=True)]
        if max(busy, default=0.0) < IDLE_SHARE * IDLE_WINDOW_S:
            break
    return time.perf_counter() - started


def vllm_method(setup: str, dtype: str) -> str:
    return f"{VLLM_METHOD}{'' if dtype == 'float32' else ' ' + dtype} ({setup})"


def vllm_worker(folder: str, dtype: str, venv: Path, setup: str) -> Worker:
    """vLLM CPU in its own venv (``scripts/serve_vllm.py``'s, made on first use, 2-3 minutes) on the checkpoint
    in ``folder`` (the weights the other methods run, saved as safetensors), in one of ``VLLM_SETUPS``."""
    launcher = _launcher()
    launcher.ensure_venv(venv)
    command = [str(launcher.venv_python(venv)), str(REPO / "benchmarks" / "vllm_worker.py"), "--model", folder]
    return Worker(vllm_method(setup, dtype), [*command, "--dtype", dtype], vllm_env(setup, venv))


def engine_worker(folder: str, dtype: str, eager: bool) -> Worker:
    """The engine at its defaults (``eager``: with ``compile=False``) in a plain script of its own
    (``benchmarks/engine_worker.py``)."""
    name = f"astrai{' eager' if eager else ''}{'' if dtype == 'float32' else ' ' + dtype} (defaults)"
    command = [sys.executable, "-m", "benchmarks.engine_worker", "--model", folder, "--dtype", dtype]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return Worker(name, command + ["--eager"] * eager, dict(os.environ, PYTHONPATH=path))


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, folder: str) -> None:
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _launcher():  # noqa: ANN202 - a module
    """``scripts/serve_vllm.py``, which owns the vLLM venv (a script, not a package: loaded by path)."""
    path = REPO / "scripts" / "serve_vllm.py"
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def raw_forward_floor(model: PreTrainedModel, vocab: int, context: int = 300, batch: int = 8, reps: int = 8) -> float:
    """Median ms of one batched single-token decode through a DynamicCache at ``context``: the floor."""
    gen = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.randint(1, vocab, (batch, context), generator=gen), cache=cache, use_cache=True)
        for _ in range(reps):
            token = torch.randint(1, vocab, (batch, 1), generator=gen)
            started = time.perf_counter()
            model(input_ids=token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


# ----- the report -----------------------------------------------------------------------------------------
@dataclass
class Block:
    """One workload run by every method in turn, with the floor measured just before."""

    workload: str
    floor_ms: float
    results: list[Result]

    def ratios(self, r: Result) -> tuple[float | None, float | None, float | None]:
        """(vs transformers generate, vs the best transformers method, vs the faster vLLM set-up in the same dtype),
        within this block."""
        transformers = [x.tok_s for x in self.results if x.method.startswith("transformers")]
        generate = [x.tok_s for x in self.results if x.method == "transformers generate"]
        vllm = [x.tok_s for x in self.results if x.method.startswith(VLLM_METHOD) and _dtype(x) == _dtype(r)]
        return (
            r.tok_s / generate[0] if generate else None,
            r.tok_s / max(transformers) if transformers else None,
            r.tok_s / max(vllm) if vllm else None,
        )


def _dtype(r: Result) -> str:
    return "bfloat16" if "bfloat16" in r.method else "float32"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(title: str, blocks: list[Block], reference: dict[str, list[list[int]]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| workload | method | wall s | tok/s | TTFT s | prompt tokens computed | decode step ms | floor ms | "
        "step / floor | peak RSS MB | vs generate | vs best transformers | vs vLLM | greedy = reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for block in sorted(blocks, key=lambda b: list(reference).index(b.workload)):
        for r in block.results:
            same = sum(a == b for a, b in zip(r.outputs, reference[block.workload], strict=True))
            decode = f"{r.decode_ms:.1f}" if r.decode_ms else "-"
            ratio = f"{r.decode_ms / block.floor_ms:.2f}" if r.decode_ms else "-"
            vs_generate, vs_best, vs_vllm = block.ratios(r)
            rss = "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}"
            lines.append(
                f"| {block.workload} | {r.method} | {r.wall:.2f} | {r.tok_s:.1f} | {r.ttft:.2f} | "
                f"{r.prompt_computed} | {decode} | {block.floor_ms:.1f} | {ratio} | {rss} | "
                f"{_ratio(vs_generate)} | {_ratio(vs_best)} | {_ratio(vs_vllm)} | {same}/{len(r.outputs)} |"
            )
    return "\n".join(lines)


def bench_model(
    title: str,
    load: Callable,
    names: list[str],
    rounds: int,
    bf16: bool,
    vllm_venv: Path | None,
    eager: bool,
) -> str:
    """Every method on every workload, round after round, after one warm-up run of the first workload each. vLLM
    runs in both ``VLLM_SETUPS``; "vs vLLM" is against the faster one. ``eager`` adds the engine with
    ``compile=False`` in each dtype (the engines compile, or load their compiled forward, as they are built)."""
    base, tokenizer = load()
    eos = tokenizer.eos_token_id
    vocab = base.config.vocab_size
    workloads = [w for w in make_workloads(vocab) if w.name in names]
    options = dict(page_size=16, n_pages=1024, max_batch_size=8, max_batched_tokens=512)
    variants = {  # each engine gets its own copy: an engine casts, packs and re-wires its model in place
        DEFAULT_ENGINE: dict(prefix_caching=True),
        "astrai, prefix caching off": dict(prefix_caching=False),
        "astrai, caching on, plain weights": dict(prefix_caching=True, packed_weights=False),
    }
    if bf16:
        variants["astrai bfloat16, prefix caching on"] = dict(prefix_caching=True, dtype="bfloat16")
    if eager:
        for dtype in ["float32"] + ["bfloat16"] * bf16:
            label = "" if dtype == "float32" else f" {dtype}"
            variants[f"astrai eager{label}, prefix caching on"] = dict(dtype=dtype, compile=False)
    engines = {name: InferenceEngine(copy.deepcopy(base), tokenizer, **v, **options) for name, v in variants.items()}
    manager = copy.deepcopy(base).init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos),
        continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=256, num_blocks=64, page_size=256),
    )
    manager.start()
    workers = []
    folder = tempfile.TemporaryDirectory(prefix="astrai-bench-")
    if vllm_venv is not None:
        save_checkpoint(base, tokenizer, folder.name)
        for dtype in ["float32"] + ["bfloat16"] * bf16:
            workers += [vllm_worker(folder.name, dtype, vllm_venv, setup) for setup in VLLM_SETUPS]
    blocks: list[Block] = []
    reference: dict[str, list[list[int]]] = {}
    try:
        for name, engine in engines.items():
            run_engine(engine, workloads[0], name)
        for worker in workers:
            worker.run(workloads[0], eos)
        for _ in range(rounds):
            for work in workloads:  # interleaved: every method runs each workload in turn
                wait_until_idle(workers)  # a vLLM set-up may still be busy after its run (wait_until_idle)
                floor = raw_forward_floor(base, vocab)  # re-measured each time: the machine drifts
                results = [run_hf_generate(base, work, eos), run_hf_continuous(manager, work)]
                results += [run_engine(engine, work, name) for name, engine in engines.items()]
                for worker in workers:
                    wait_until_idle(workers)
                    results.append(worker.run(work, eos))
                reference[work.name] = results[0].outputs
                blocks.append(Block(work.name, floor, results))
                print("\n".join(table(title, blocks[-1:], reference).splitlines()[-len(results) :]), flush=True)
    finally:
        manager.stop(block=True, timeout=30)
        for worker in workers:
            worker.close()
        folder.cleanup()
        for engine in engines.values():
            engine.shutdown()
    return table(title, blocks, reference) + "\n\nMin / median / max over rounds:\n\n" + summary(blocks)


def summary(blocks: list[Block]) -> str:
    """Min / median / max over rounds; each ratio is taken within its own block (one workload, one round).

    "decode speed vs engine" compares a method's decode step with the default engine's (float32, packed weights,
    caching on) in the same block: it is how the bfloat16 and plain-weight rows are judged.
    """
    rows: dict[tuple[str, str], list[tuple[Result, tuple[float, float, float | None], float | None]]] = {}
    for block in blocks:
        engine_ms = next(r.decode_ms for r in block.results if r.method == DEFAULT_ENGINE)
        for r in block.results:
            speed = engine_ms / r.decode_ms if engine_ms and r.decode_ms else None
            rows.setdefault((block.workload, r.method), []).append((r, block.ratios(r), speed))
    lines = [
        "| workload | method | rounds | tok/s | TTFT s | vs vLLM (same dtype) | vs best transformers | "
        "median decode ms | median decode speed vs engine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (workload, method), values in rows.items():
        decode = [r.decode_ms for r, _, _ in values if r.decode_ms]
        speeds = [s for _, _, s in values if s]
        vs_vllm = [ratios[2] for _, ratios, _ in values if ratios[2] is not None]
        lines.append(
            f"| {workload} | {method} | {len(values)} | {spread([r.tok_s for r, _, _ in values], '.1f')} | "
            f"{spread([r.ttft for r, _, _ in values], '.2f')} | {spread(vs_vllm, '.2f', 'x')} | "
            f"{spread([ratios[1] for _, ratios, _ in values if ratios[1] is not None], '.2f', 'x')} | "
            + (f"{statistics.median(decode):.1f} | " if decode else "- | ")
            + (f"{statistics.median(speeds):.2f}x |" if speeds else "- |")
        )
    return "\n".join(lines)


def spread(values: list[float], fmt: str, unit: str = "") -> str:
    """min / median / max, or the one value."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}}{unit}"
    return " / ".join(f"{v:{fmt}}{unit}" for v in (min(values), statistics.median(values), max(values)))


# ----- --versus-vllm: every method in a process of its own, fresh each round ------------------------------------
@dataclass
class Sample:
    """One method's timed runs of one workload in one process (after one warm-up run there)."""

    round: int
    workload: str
    dtype: str
    method: str
    runs: list[Result]

    @property
    def tok_s(self) -> float:
        """The median run's."""
        return statistics.median(r.tok_s for r in self.runs)

    @property
    def is_vllm(self) -> bool:
        return self.method.startswith(VLLM_METHOD)


def versus_vllm(
    title: str, load: Callable, names: list[str], rounds: int, dtypes: list[str], venv: Path, eager: bool, runs: int
) -> str:
    """The engine at its defaults, as a user's script drives it (``benchmarks/engine_worker.py``), against vLLM CPU
    in both ``VLLM_SETUPS``, on one checkpoint saved once.

    Each round, for each dtype, starts one fresh process per method (so the rounds sample the process-to-process
    spread too), then runs the workloads in turn: in each process one warm-up run of the workload, then ``runs``
    timed runs, method after method (their order rotates from round to round), each method starting once every worker
    is idle (``wait_until_idle``). A method's figure in a round is its
    median run; the ratio is the engine's over the faster vLLM set-up's, within the round."""
    model, tokenizer = load()
    eos = tokenizer.eos_token_id
    workloads = [w for w in make_workloads(model.config.vocab_size) if w.name in names]
    found, missing = vllm_preloads(venv)
    header = [
        f"### {title}: astrai against vLLM CPU",
        "",
        f"CPU: {cpu_name()}. vLLM {VLLM_IN_PROCESS}: LD_PRELOAD {':'.join(map(str, found)) or 'none'}"
        + (f" (missing: {', '.join(missing)})" if missing else "")
        + f". Rounds: {rounds}, each a fresh process per method; per process and workload a warm-up, then {runs} "
        "timed runs.",
    ]
    print("\n".join(header), flush=True)
    samples: list[Sample] = []
    setups: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="astrai-bench-") as folder:
        save_checkpoint(model, tokenizer, folder)
        del model  # the workers load their own copies
        for round_ in range(1, rounds + 1):
            for dtype in dtypes:
                starts: list[bool | str] = [False, *[True] * eager, *VLLM_SETUPS]  # eager=..., or a set-up
                shift = (round_ - 1) % len(starts)
                workers: list[Worker] = []
                try:
                    for start in starts[shift:] + starts[:shift]:
                        if isinstance(start, bool):
                            workers.append(engine_worker(folder, dtype, start))
                        else:
                            workers.append(vllm_worker(folder, dtype, venv, start))
                        setups.setdefault(workers[-1].name, workers[-1].setup)
                    for work in workloads:
                        for worker in workers:
                            wait_until_idle(workers)
                            worker.run(work, eos)  # the warm-up
                            timed = [worker.run(work, eos) for _ in range(runs)]
                            samples.append(Sample(round_, work.name, dtype, worker.name, timed))
                            print(sample_line(samples[-1]), flush=True)
                        print(ratio_line(samples[-1], samples), flush=True)
                finally:
                    for worker in workers:
                        worker.close()
    lines = header + ["", "Set-ups, as each worker reported its first start (start_s: to ready, seen from here):", ""]
    lines += [f"- {name}: {json.dumps(setup)}" for name, setup in setups.items()]
    return "\n".join(lines + ["", versus_table(samples, runs)])


def round_of(sample: Sample, samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if (s.round, s.workload, s.dtype) == (sample.round, sample.workload, sample.dtype)]


def faster_vllm(sample: Sample, samples: list[Sample]) -> Sample | None:
    """The faster vLLM set-up in ``sample``'s round, workload and dtype."""
    vllm = [s for s in round_of(sample, samples) if s.is_vllm]
    return max(vllm, key=lambda s: s.tok_s) if vllm else None


def sample_line(sample: Sample) -> str:
    runs = ", ".join(f"{r.tok_s:.1f}" for r in sample.runs)
    generated = ", ".join(str(r.generated) for r in sample.runs)
    return f"round {sample.round} {sample.workload} {sample.method}: tok/s {runs}; tokens generated {generated}"


def ratio_line(sample: Sample, samples: list[Sample]) -> str:
    """The engine's ratio to the faster vLLM set-up in ``sample``'s round, workload and dtype."""
    best = faster_vllm(sample, samples)
    engines = [s for s in round_of(sample, samples) if not s.is_vllm]
    ratios = ", ".join(f"{e.method} {e.tok_s / best.tok_s:.2f}x" for e in engines)
    return f"round {sample.round} {sample.workload} {sample.dtype}: faster vLLM: {best.method}; {ratios}"


def count_range(values: list[int]) -> str:
    """``n``, or ``min-max`` where the values differ."""
    return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def versus_table(samples: list[Sample], runs: int) -> str:
    """Per workload, dtype and engine method: the ratio to the faster vLLM set-up in each round and its min / median
    / max; which set-up was faster; every run's tok/s (min / median / max); the tokens each run really generated."""
    lines = [
        "| workload | dtype | astrai | astrai / faster vLLM, per round | min / median / max | faster vLLM, per round "
        "| astrai tok/s | "
        + " | ".join(f"vLLM {setup} tok/s" for setup in VLLM_SETUPS)
        + " | tokens per run: astrai; "
        + "; ".join(f"vLLM {setup}" for setup in VLLM_SETUPS)
        + " | astrai greedy = vLLM |",
        "|---" * (9 + len(VLLM_SETUPS)) + "|",
    ]
    keys = list(dict.fromkeys((s.workload, s.dtype, s.method) for s in samples if not s.is_vllm))
    for workload, dtype, method in keys:
        mine = [s for s in samples if (s.workload, s.dtype, s.method) == (workload, dtype, method)]
        best = [faster_vllm(s, samples) for s in mine]
        ratios = [s.tok_s / b.tok_s for s, b in zip(mine, best, strict=True) if b is not None]
        vllm = {setup: vllm_method(setup, dtype) for setup in VLLM_SETUPS}
        vllm = {
            setup: [s for s in samples if (s.workload, s.dtype, s.method) == (workload, dtype, name)]
            for setup, name in vllm.items()
        }
        same = [
            sum(a == b for a, b in zip(s.runs[0].outputs, b.runs[0].outputs, strict=True))
            for s, b in zip(mine, best, strict=True)
            if b is not None
        ]
        faster = [b.method.split("(")[-1].rstrip(")") if b else "-" for b in best]
        cells = [
            workload,
            dtype,
            method,
            ", ".join(f"{r:.2f}" for r in ratios),
            spread(ratios, ".2f", "x"),
            ", ".join(faster),
            spread([r.tok_s for s in mine for r in s.runs], ".1f"),
            *(spread([r.tok_s for s in vllm[setup] for r in s.runs], ".1f") for setup in VLLM_SETUPS),
            "; ".join(
                count_range([r.generated for s in group for r in s.runs]) if group else "-"
                for group in [mine, *vllm.values()]
            ),
            f"{min(same)}/{len(mine[0].runs[0].outputs)}" if same else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (
        f"\n\nRatios are the engine's median run over the faster vLLM set-up's median run, within each round ({runs} "
        "timed runs per process, after a warm-up); tok/s columns are min / median / max over every timed run; "
        '"tokens per run" counts the tokens really generated (the engine\'s from cache_stats); "greedy = vLLM" the '
        "prompts whose first timed output equals the faster vLLM set-up's, in the worst round."
    )
    return "\n".join(lines) + notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="smollm,embedded", help="comma list of: smollm, embedded")
    parser.add_argument("--workloads", default="W1,W2,W1-16")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="also run the engine in bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add vLLM CPU rows (its venv is made on first use, like scripts/serve_vllm.py's)",
    )
    parser.add_argument(
        "--versus-vllm",
        action="store_true",
        help="only the engine at its defaults (a plain script in its own process) against vLLM in-process, tuned, "
        "and multiprocess at its defaults, fresh processes each round (with --bf16, both dtypes)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="--versus-vllm: timed runs per process and workload, after a warm-up"
    )
    parser.add_argument("--eager", action="store_true", help="also run the engine with compile=False")
    parser.add_argument("--vllm-venv", type=Path, help="default: $ASTRAI_VLLM_VENV, else scripts/serve_vllm.py's")
    args = parser.parse_args()
    if args.versus_vllm and not args.vllm:
        parser.error("--versus-vllm needs vLLM (drop --no-vllm)")
    torch.set_num_threads(args.threads)
    loaders = {
        "smollm": ("SmolLM2-135M-shaped Llama (random weights)", smollm_shaped),
        "embedded": ("embedded tinystories-llama", embedded),
    }
    names = args.workloads.split(",")
    threads = "each process at its defaults" if args.versus_vllm else f"{args.threads} threads"
    print(f"CPU: {cpu_name()}\ntorch {torch.__version__}, {threads}, float32 unless marked\n", flush=True)
    for key in args.models.split(","):
        title, load = loaders[key]
        venv = None
        if args.vllm:
            venv = args.vllm_venv or _launcher().parse_args([]).venv  # $ASTRAI_VLLM_VENV, else its default
        if args.versus_vllm:
            dtypes = ["float32"] + ["bfloat16"] * args.bf16
            text = versus_vllm(title, load, names, args.rounds, dtypes, venv, args.eager, args.runs)
        else:
            text = bench_model(title, load, names, args.rounds, args.bf16, venv, args.eager)
        print(text, "\n", flush=True)


if __name__ == "__main__":
    main()
