"""Benchmark: ``python -m benchmarks.bench`` runs the engine (prefix caching on and off, and with its weights left
unpacked) against transformers' ``generate`` on a padded batch and transformers' continuous batching,
interleaved in one process.

It prints a markdown table per model. Each method gets its own copy of the weights, because every method
switches the model's attention implementation (and the engine its linear layers) to its own.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
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
    longest = max(len(p) for p in work.prompts)
    pad = eos
    input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in work.prompts])
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


class VllmWorker:
    """vLLM CPU, loaded once in its own venv (``benchmarks/vllm_worker.py``), run one workload at a time.

    The venv is ``scripts/serve_vllm.py``'s (made on first use, 2-3 minutes). The checkpoint is saved to a temporary
    folder first, so vLLM loads exactly the weights the other methods run.
    """

    def __init__(self, model: PreTrainedModel, dtype: str, venv: Path):
        launcher = _launcher()
        launcher.ensure_venv(venv)
        self._folder = tempfile.TemporaryDirectory(prefix="astrai-bench-")
        model.save_pretrained(self._folder.name, safe_serialization=True)
        self.name = VLLM_METHOD if dtype == "float32" else f"{VLLM_METHOD} {dtype}"
        self._process = subprocess.Popen(
            [
                str(launcher.venv_python(venv)),
                str(REPO / "benchmarks" / "vllm_worker.py"),
                "--model",
                self._folder.name,
                "--dtype",
                dtype,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=launcher.server_env(launcher.parse_args([])),  # offline, no usage stats, the launcher's KV space
        )
        if not self._answer().get("ready"):
            raise RuntimeError("the vLLM worker did not start")

    def _answer(self) -> dict:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self._process.wait()}); its log is above")
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

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._folder.cleanup()


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
        """(vs transformers generate, vs the best transformers method, vs vLLM in the same dtype), within this block."""
        transformers = [x.tok_s for x in self.results if x.method.startswith("transformers")]
        generate = [x.tok_s for x in self.results if x.method == "transformers generate"]
        vllm = [x.tok_s for x in self.results if x.method.startswith(VLLM_METHOD) and _dtype(x) == _dtype(r)]
        return (
            r.tok_s / generate[0] if generate else None,
            r.tok_s / max(transformers) if transformers else None,
            r.tok_s / vllm[0] if vllm else None,
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
    versus_vllm: bool,
    compiled: bool,
) -> str:
    """Every method on every workload, round after round, after one warm-up run of the first workload each (a
    compiled engine compiles there). ``versus_vllm`` keeps only the default engine and vLLM (each in bfloat16 too
    with ``bf16``); the reference outputs are then the engine's own, which the equivalence tests tie to
    ``generate``'s. ``compiled`` adds the engine with ``compile=True`` in each dtype."""
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
    if versus_vllm:
        variants = {DEFAULT_ENGINE: variants[DEFAULT_ENGINE]}
    if bf16:
        variants["astrai bfloat16, prefix caching on"] = dict(prefix_caching=True, dtype="bfloat16")
    if compiled:
        for dtype in ["float32"] + ["bfloat16"] * bf16:
            label = "" if dtype == "float32" else f" {dtype}"
            variants[f"astrai compiled{label}, prefix caching on"] = dict(dtype=dtype, compile=True)
    engines = {name: InferenceEngine(copy.deepcopy(base), tokenizer, **v, **options) for name, v in variants.items()}
    manager = None
    if not versus_vllm:
        manager = copy.deepcopy(base).init_continuous_batching(
            generation_config=GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos),
            continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=256, num_blocks=64, page_size=256),
        )
        manager.start()
    workers = []
    if vllm_venv is not None:
        workers = [VllmWorker(base, dtype, vllm_venv) for dtype in ["float32"] + ["bfloat16"] * bf16]
    blocks: list[Block] = []
    reference: dict[str, list[list[int]]] = {}
    try:
        for name, engine in engines.items():
            run_engine(engine, workloads[0], name)
        for worker in workers:
            worker.run(workloads[0], eos)
        for _ in range(rounds):
            for work in workloads:  # interleaved: every method runs each workload in turn
                floor = raw_forward_floor(base, vocab)  # re-measured each time: the machine drifts
                results = []
                if manager is not None:
                    results += [run_hf_generate(base, work, eos), run_hf_continuous(manager, work)]
                results += [run_engine(engine, work, name) for name, engine in engines.items()]
                results += [worker.run(work, eos) for worker in workers]
                reference[work.name] = results[0].outputs
                blocks.append(Block(work.name, floor, results))
                print("\n".join(table(title, blocks[-1:], reference).splitlines()[-len(results) :]), flush=True)
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=30)
        for worker in workers:
            worker.close()
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
            f"| {workload} | {method} | {len(values)} | {_spread([r.tok_s for r, _, _ in values], '.1f')} | "
            f"{_spread([r.ttft for r, _, _ in values], '.2f')} | {_spread(vs_vllm, '.2f', 'x')} | "
            f"{_spread([ratios[1] for _, ratios, _ in values if ratios[1] is not None], '.2f', 'x')} | "
            + (f"{statistics.median(decode):.1f} | " if decode else "- | ")
            + (f"{statistics.median(speeds):.2f}x |" if speeds else "- |")
        )
    return "\n".join(lines)


def _spread(values: list[float], fmt: str, unit: str = "") -> str:
    """min / median / max, or the one value."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}}{unit}"
    return " / ".join(f"{v:{fmt}}{unit}" for v in (min(values), statistics.median(values), max(values)))


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
        "--versus-vllm", action="store_true", help="only the default engine against vLLM (with --bf16, both dtypes)"
    )
    parser.add_argument("--compile", action="store_true", help="also run the engine with compile=True")
    parser.add_argument("--vllm-venv", type=Path, help="default: $ASTRAI_VLLM_VENV, else scripts/serve_vllm.py's")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaders = {
        "smollm": ("SmolLM2-135M-shaped Llama (random weights)", smollm_shaped),
        "embedded": ("embedded tinystories-llama", embedded),
    }
    names = args.workloads.split(",")
    print(f"torch {torch.__version__}, {args.threads} threads, float32 unless marked\n")
    for key in args.models.split(","):
        title, load = loaders[key]
        venv = None
        if args.vllm:
            venv = args.vllm_venv or _launcher().parse_args([]).venv  # $ASTRAI_VLLM_VENV, else its default
        text = bench_model(title, load, names, args.rounds, args.bf16, venv, args.versus_vllm, args.compile)
        print(text, "\n", flush=True)


if __name__ == "__main__":
    main()
