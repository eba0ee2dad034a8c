"""The model's forward compiled by ``torch.compile``, once per machine and model: later starts load it from disk.

What is compiled is ``logits``: the whole model over one step, its fused, packed projections as
``astrai::packed_linear`` and its attention as ``astrai::paged_attention`` (opaque ops), in one graph whose token
and row counts are unbacked symbols, so that every step, prefill or decode, of any size, runs that one graph.

Why a cache of its own: inductor's freezing, which had folded the packed oneDNN weights into the graph as
constants, cannot be cached by torch (the AOTAutograd cache refuses a frozen graph, the FX graph cache cannot pickle
oneDNN tensors), so each start compiled afresh: 26 s on the embedded model, 93 s on a SmolLM2-135M-shaped one on 2
cores. Without freezing, every weight is a graph input and a packed one reaches its op through a handle tensor
(``packed_linear.py``), so nothing compiled depends on a weight's value or on the process that packed it. torch's
precompile API (``torch.compile(...).aot_compile``, ``torch.compiler.load_compiled_function``) then saves the whole
result, dynamo's bytecode and guards with AOTAutograd's and inductor's output: a warm start traces nothing (dynamo's
tracing alone takes seconds on 2 cores). The artifact holds the source of inductor's C++ kernels, not the built
libraries, so inductor's cache directory is pointed beside it during the compile and every load: the libraries are
built once and found there again.

Invariants:

* An artifact is used only under its key (``cache_key``): the torch, transformers and Python versions, the CPU (its
  model and flags) and torch's thread count (which its guards check), the model as prepared (its config, its module
  tree with which layers are fused and packed, and every parameter and buffer's name, shape and dtype) and the
  source of what the graph calls (this module, the two ops and their kernels, the C kernels and their flags). Weight
  *values* are not in it: they are inputs, never constants, so one artifact serves any model of the same shape (a
  test serves one model's weights through another's artifact).
* Guards: those that travel between processes are kept (tensor metadata, global state, the shape environment;
  ``torch.compiler.keep_portable_guards_unsafe``), those that cannot (object identities) are dropped, which the
  key makes safe. They run in full at the first call, and again only when torch's global state changed
  (``GlobalStateChecked``). A call that fails them raises ``GraphNoLongerFits``; nothing is recompiled behind
  the engine's back.
* Any failure (no C++ compiler, a model the compiler cannot take whole, a stale artifact that does not load) ends
  in a logged warning and ``None``: the engine then serves eager, as with ``compile=False``. A corrupt or stale
  artifact is compiled again and replaced (written whole, then renamed).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import transformers
from torch._dynamo.aot_compile import AOTCompiledFunction
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from transformers import PreTrainedModel

from astrai import native
from astrai.disk_cache import cache_dir, cpu_identity

log = logging.getLogger("astrai")

SOURCES = [
    Path(__file__),
    *(Path(__file__).with_name(name) for name in ("attention.py", "packed_linear.py", "skinny_linear.py", "ops.py")),
]
ARTIFACT = "forward.bin"

CompiledForward = Callable[[PreTrainedModel, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Progress = Callable[[str], None]

_lock = threading.Lock()  # one compile or load at a time: inductor's cache directory is a process-wide setting


class GraphNoLongerFits(RuntimeError):
    """The compiled graph's guards failed: the process changed what it was compiled for (its global state)."""


class GlobalStateChecked:
    """A compiled forward whose guards run in full at its first call, then only when torch's global state changed.

    Why: the guards check every tensor the graph takes, and every weight is one (43 on the embedded model), on
    every call: letting them run measured 0.1-0.3 ms more per forward of an embedded float32 decode step of
    2.4-2.8 ms (AMD EPYC, 2 cores, 5 alternations of 300 steps, one process). Between two calls nothing they check
    can change but torch's global state: the runner builds the step's inputs the same way every step, and the
    weights are those of a model prepared once, read-only while it serves (``model_runner.PreparedModel``), whose
    names, shapes and dtypes are in the cache key (and inductor's own code still asserts each input's size and
    stride). The global state (grad and inference mode, thread count, deterministic algorithms, ...) is compared on
    every call by dynamo's ``GlobalStateGuard`` (a C++ comparison, under a microsecond); where it changed, the full
    guards run again, and a failure raises ``GraphNoLongerFits``.
    """

    def __init__(self, function: AOTCompiledFunction):
        function.disable_guard_check()
        self._function = function
        self._passed: torch._C._dynamo.guards.GlobalStateGuard | None = None  # the state the guards last passed in

    def __call__(
        self, model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        if self._passed is None or not self._passed.check():
            if not self._function.guard_check(model, tokens, positions, rows):
                changed = self._passed.reason() if self._passed is not None else "the first call"
                raise GraphNoLongerFits(f"the compiled graph's guards failed ({changed.strip()})")
            self._passed = torch._C._dynamo.guards.GlobalStateGuard()
        return self._function(model, tokens, positions, rows)


@dataclass(frozen=True)
class Compiled:
    """A compiled forward and how this process got it."""

    forward: CompiledForward
    loaded: bool  # from the cache; else compiled now (and saved, where the cache is writable)
    seconds: float | None  # what the load or the compile took; None: compiled lazily, by the first steps (CUDA)


def logits(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """The logits of ``rows`` of one step: what is compiled (a module-level function, so an artifact can name it)."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=rows).logits


def load_or_compile(model: PreTrainedModel, progress: Progress | None = None) -> Compiled | None:
    """``logits`` compiled for ``model`` as it is prepared now: loaded from the cache, else compiled and saved
    there (``progress`` and the log say so, and how long it took); None, logged, where it cannot be compiled."""
    if (missing := _missing_compiler()) is not None:
        log.warning("torch.compile needs a C++ compiler and %s; serving the model eager", missing)
        return None
    folder = cache_dir("compiled") / cache_key(model)
    with _lock, temporary_cache_dir(str(folder / "inductor")), torch.inference_mode():
        return _load(folder) or _compile_and_save(model, folder, progress)


def load(model: PreTrainedModel) -> Compiled | None:
    """``logits`` compiled for ``model`` as it is prepared now, if this machine's cache holds it; else None. It never
    compiles, so it never traces the model: it reads the model's structure for the key, and nothing else, which is
    why it may run on another thread while the model serves eager (``PreparedModel.compile``, in the background)."""
    folder = cache_dir("compiled") / cache_key(model)
    if not (folder / ARTIFACT).exists():
        return None
    with _lock, temporary_cache_dir(str(folder / "inductor")), torch.inference_mode():
        return _load(folder)


def _load(folder: Path) -> Compiled | None:
    artifact = folder / ARTIFACT
    if not artifact.exists():
        return None
    started = time.perf_counter()
    try:
        with artifact.open("rb") as file:
            # typed as any callable, it returns an AOTCompiledFunction (``AOTCompiledFunction.deserialize``)
            loaded = cast(AOTCompiledFunction, torch.compiler.load_compiled_function(file))
    except Exception:
        log.warning("could not load the compiled forward in %s; compiling it again", folder, exc_info=True)
        return None
    seconds = time.perf_counter() - started
    log.info("compiled forward loaded from %s in %.1f s", folder, seconds)
    return Compiled(GlobalStateChecked(loaded), loaded=True, seconds=seconds)


def _compile_and_save(model: PreTrainedModel, folder: Path, progress: Progress | None) -> Compiled | None:
    name = type(model).__name__
    _tell(progress, f"Compiling {name} for this CPU, once per machine and model (20-80 s on 2 cores), into {folder}…")
    started = time.perf_counter()
    try:
        compiled = _compile(model)
    except Exception:
        log.warning("torch.compile failed; serving the model eager", exc_info=True)
        return None
    try:
        compiled.save_compiled_function(str(folder / ARTIFACT))  # written aside, then renamed
    except Exception:
        log.warning("could not save the compiled forward in %s; next start compiles again", folder, exc_info=True)
    # A compile leaves hundreds of thousands of objects behind (about 700,000 tracked ones on the embedded model),
    # and Python's next full collection scanned them in the middle of a run: 451 ms of one W2 run's 814 (the
    # others took about 330). Collected now, at start-up, it costs about 0.5 s of a cold start's 27.
    gc.collect()
    seconds = time.perf_counter() - started
    _tell(progress, f"Compiled {name} in {seconds:.0f} s.")
    return Compiled(GlobalStateChecked(compiled), loaded=False, seconds=seconds)


def compile_on_gpu(model: PreTrainedModel) -> Compiled:
    """A model on CUDA: ``torch.compile`` of its forward in this process, compiled lazily by the first steps and not
    cached. The cache above is the CPU's: its key names the CPU, its example inputs live on the host, and torch's
    precompile API it saves with is missing from the torch of the GPU measured (2.11). This is the path measured on
    an H200 (docs/benchmarks.md: 1.31-1.60x transformers in float32, medians), inductor freezing included (the
    weights become constants). Token and row counts are unbacked at each call, so one graph serves every step."""
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(
        _model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        for tensor, dim in ((tokens, 1), (positions, 1), (rows, 0)):
            torch._dynamo.decorators.mark_unbacked(tensor, dim)
        with torch._inductor.config.patch(freezing=True):
            return compiled(input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=rows).logits

    return Compiled(forward, loaded=False, seconds=None)


def cache_key(model: PreTrainedModel) -> str:
    """What the compiled forward depends on, hashed (see the module's docstring)."""
    digest = hashlib.sha256()
    for part in _key_parts(model):
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:24]


def _key_parts(model: PreTrainedModel) -> Iterator[str | bytes]:
    # the thread count is global state the artifact's guards check: loaded into a process of another count, every
    # call failed ("GLOBAL_STATE changed: num_threads"), so each count gets an artifact of its own
    yield from (torch.__version__, transformers.__version__, sys.version, cpu_identity(), f"{torch.get_num_threads()}")
    yield model.config.to_json_string()
    yield repr(model)
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        yield f"{name} {tuple(tensor.shape)} {tensor.dtype}"
    for source in [*SOURCES, *native.SOURCES.values(), *native.HEADERS]:
        yield source.read_bytes()
    yield " ".join(native.FLAGS)


class _Precompilable(Protocol):
    """What ``torch.compile(..., fullgraph=True)`` returns, with the ``aot_compile`` that dynamo attaches to it at
    run time (its declared type, the compiled function's own, has no such attribute)."""

    def aot_compile(self, example_inputs: tuple[tuple[Any, ...], dict[str, Any]]) -> AOTCompiledFunction: ...


def _compile(model: PreTrainedModel) -> AOTCompiledFunction:
    """Trace and compile ``logits`` on example inputs whose token and row counts are unbacked: the graph then
    holds for any count (a count of 1 would otherwise be specialized, and another count recompile)."""
    tokens = torch.zeros(1, 2, dtype=torch.long)
    positions = torch.arange(2).unsqueeze(0)
    rows = torch.tensor([1])
    for tensor, dim in ((tokens, 1), (positions, 1), (rows, 0)):
        torch._dynamo.decorators.mark_unbacked(tensor, dim)
    options: dict[str, str | int | bool | Callable[..., Any]] = {
        "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe
    }
    compiler = cast(_Precompilable, torch.compile(logits, fullgraph=True, dynamic=False, options=options))
    return compiler.aot_compile(((model, tokens, positions, rows), {}))


def _missing_compiler() -> str | None:
    """None if inductor finds its C++ compiler, else what is missing."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception:  # InvalidCxxCompiler, or a broken one
        return f"none was found ({torch._inductor.config.cpp.cxx[-1]} or $CXX)"
    return None


def _tell(progress: Progress | None, text: str) -> None:
    log.info("%s", text)
    if progress is not None:
        progress(text)
