"""Runs one step of a transformers causal LM over the paged KV cache.

The model definition is transformers' own; serving it takes two parts. ``PreparedModel`` prepares the model in
place, once for every engine built on it: it moves its weights to the engine's device and dtype, switches its
attention implementation to ours and, on the CPU unless told not to, fuses and packs its linear weights
(``packed_linear.py``), picks the C kernel to attend decodes where it builds (``paged_kernel.py``), and (on the CPU
unless told not to, on CUDA when asked) compiles the whole model, those layers included, into one graph, or loads
it already compiled from disk (``compiled_forward.py``). ``ModelRunner`` is one engine's: it owns that engine's KV
tensors (on the device), flattens its scheduled requests into one ``[1, T]`` row and computes logits just for the
rows that sample, through the prepared model it shares with any other engine on the same model object.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from astrai.attention import ATTN_IMPLEMENTATION, PagedBatch, build_paged_batch, serving
from astrai.compiled_forward import Compiled, GraphNoLongerFits, Progress, compile_on_gpu, load_or_compile, logits
from astrai.device import resolve_cpu_speedup, to_device, uses_openmp
from astrai.huge_pages import Arena
from astrai.model_thread import SharedForwards
from astrai.observation import Forward
from astrai.packed_linear import pack_linears, packing_supported, unpack_linears
from astrai.paged_kernel import PagedKernel, load_paged_kernel
from astrai.request import Request

log = logging.getLogger("astrai")

# Builds a model's compiled forward on a background thread, while the model serves eager (``PreparedModel.compile``):
# None where it cannot. It must not trace or run the model (that thread runs beside the model's forwards, and the
# packed layers keep per-call state): ``precompile.in_child`` compiles in a child process and only loads here.
BackgroundCompile = Callable[[PreTrainedModel], Compiled | None]

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_supported(config: PretrainedConfig) -> None:
    """Refuse, at load, an architecture whose attention the paged hook would compute wrongly."""
    name = type(config).__name__
    layer_types = getattr(config, "layer_types", None) or []
    if hasattr(config, "use_sliding_window"):  # Qwen-style: a window size may be set but switched off
        sliding = bool(config.use_sliding_window)
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    if sliding or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{name}: sliding-window attention is not supported by the paged attention hook")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{name}: attention logit soft-capping is not supported by the paged attention hook")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: only decoder-only causal LMs are supported")


def _place(model: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Move the model's parameters and buffers to ``device`` and cast the floating ones to ``dtype``, in place;
    return (tensor, original data) for each one changed.

    The originals are kept so ``PreparedModel.restore`` hands the exact weights back, where they were: a float32
    model served in bfloat16 holds both copies while it serves (1.5x its weights, however many engines share it),
    and a CPU model served on a GPU keeps its host copy. A model handed over already in the serving dtype and on the
    serving device changes nothing (``InferenceEngine.from_pretrained`` moves its fresh model before serving it).
    All or nothing: a tensor that cannot move (a GPU too small for the model) puts back those moved before it.
    """
    changed = []
    try:
        for tensor in [*model.parameters(), *model.buffers()]:
            target = dtype if tensor.is_floating_point() else tensor.dtype
            if tensor.dtype != target or tensor.device != device:
                moved = tensor.data.to(device=device, dtype=target)
                changed.append((tensor, tensor.data))
                tensor.data = moved
    except BaseException:
        for tensor, original in changed:
            tensor.data = original
        raise
    return changed


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Preparation:
    """How a model is prepared for serving: what every engine sharing one model must agree on.

    The CPU-only speed-ups are resolved already (``device.resolve_cpu_speedup``): never True off the CPU.
    """

    dtype: torch.dtype
    device: torch.device
    packed_weights: bool
    attention_kernel: bool
    compile: bool

    @classmethod
    def resolve(
        cls,
        dtype: torch.dtype,
        device: torch.device,
        packed_weights: bool | None = None,
        attention_kernel: bool | None = None,
        compile: bool | None = None,
    ) -> Preparation:
        """The engine's options as a preparation: ``None`` speed-ups on where they apply, refused where they do not
        (``ValueError``, ``device.resolve_cpu_speedup``). ``compile=None`` compiles on the CPU, where the compiled
        forward is cached on disk and measured faster; on CUDA only when asked (its cache has not been measured
        there)."""
        packed = resolve_cpu_speedup("packed_weights", packed_weights, device)
        kernel = resolve_cpu_speedup("attention_kernel", attention_kernel, device)
        compiled = device.type == "cpu" if compile is None else bool(compile)
        return cls(dtype, device, packed, kernel, compiled)

    def differences(self, other: Preparation) -> list[str]:
        """``name=asked (serving: name=held)`` for each option that differs from ``other`` (the one being served)."""
        names = {v: k for k, v in SUPPORTED_DTYPES.items()}
        found = []
        for field in ("dtype", "device", "packed_weights", "attention_kernel", "compile"):
            asked, held = getattr(self, field), getattr(other, field)
            if asked != held:
                found.append(f"{field}={names.get(asked, asked)!s} (it serves with {names.get(held, held)!s})")
        return found


_prepared: dict[int, PreparedModel] = {}  # id(model) -> its preparation; the entry keeps the model alive
_prepared_lock = threading.Lock()  # _prepared and every PreparedModel's users; never held during a forward


class PreparedModel:
    """One transformers model prepared in place for serving, shared by every engine built on it with the same
    ``Preparation``, reference-counted, and handed back as it came by the last one to release it.

    Who owns what, under which lock:

    * The **preparation** (the weights moved to the device and dtype, and the original tensors, the attention
      implementation, the packed layers, the attention kernels' choice) is made by the first ``acquire`` and undone
      by the last ``release``, both under the module's ``_prepared_lock``, which also guards the registry of prepared
      models and each one's count of users. Between the two it is read-only: no engine changes the model while
      another uses it.
    * The **compiled forward** is made by the first ``compile`` (each engine calls it after ``acquire``), under
      the model's own ``_compile_lock``, not ``_prepared_lock``: a cold compile takes a minute, during which
      engines on other models start and stop freely; an engine on this model waits for it, then finds it made.
      Or, given a ``BackgroundCompile``, the first ``compile`` returns at once and the model serves eager
      (``forward_kind`` "compiling") while a thread builds it; that thread sets ``compiled`` and ``forward_kind``
      under the ``SharedForwards`` lock, so the switch falls between two forwards, and every engine on the model
      (one built later too: its ``compile`` finds it tried) serves the same forward from that step on.
    * The **forward** goes through ``forwards`` (``SharedForwards``, ``model_thread.py``): one at a time, and while
      several engines on the model are busy, on its one model thread: the packed layers'
      ``FusedProduct`` keeps per-call state, a compiled graph is not safe for two threads at once, and one thread
      keeps one OpenMP pool (two pools throttle each other). On a machine of few cores two concurrent forwards would
      not be faster anyway (each already runs on every core).
      Engines sharing a model thus take turns at the forward and at nothing else: each schedules and samples on its
      own loop thread.
    * The **KV tensors** are not here: each engine's ``ModelRunner`` owns its own, written only by forwards of that
      engine (the paged batch reaches attention through the ``serving`` ContextVar of the thread calling the model).

    ``_prepared_lock`` is never taken on the model thread: the last release, which stops it, happens once no engine
    is left to call a forward.
    """

    def __init__(self, model: PreTrainedModel, preparation: Preparation):
        """Prepare ``model`` in place; callers go through ``acquire`` (under ``_prepared_lock``)."""
        config = model.config
        dtype = preparation.dtype
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.model = model
        self.preparation = preparation
        self.groups = heads // kv_heads
        self.users = 0
        kernel = load_paged_kernel() if preparation.attention_kernel else None
        self.paged_kernel: PagedKernel | None = (
            kernel if kernel is not None and kernel.supports(dtype, self.groups, head_dim) else None
        )
        self.was_training = model.training
        self.original_tensors = _place(model, dtype, preparation.device)
        model.eval()
        self.previous_attn = config._attn_implementation
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        pack = preparation.packed_weights and packing_supported(dtype)
        self.packed_linears = self._pack() if pack else 0
        self.compiled: Compiled | None = None
        self.forward_kind: Forward = "eager"  # what serves: written with ``compiled`` (``_serve``)
        self._compile_lock = threading.Lock()
        self._compile_tried = False
        self._restored = False  # given back: a background compile that ends later is dropped (under forwards.lock)
        # last: nothing above can fail and leave it
        self.forwards = SharedForwards(f"astrai-model-{id(model):x}", uses_openmp(preparation.device))

    @staticmethod
    def check(model: PreTrainedModel, preparation: Preparation) -> None:
        """Raise ``ValueError`` if ``model`` cannot serve another engine prepared as ``preparation``."""
        with _prepared_lock:
            _check_locked(model, preparation)

    @staticmethod
    def acquire(model: PreTrainedModel, preparation: Preparation) -> PreparedModel:
        """The model's preparation, made now if no engine holds it yet; counts one more user."""
        with _prepared_lock:
            prepared = _check_locked(model, preparation)
            if prepared is None:
                prepared = _prepared[id(model)] = PreparedModel(model, preparation)
            prepared.users += 1
            return prepared

    def release(self) -> None:
        """One user fewer; the last one gives the model back as it came (``restore``). Call once per ``acquire``,
        with none of that user's forwards running."""
        with _prepared_lock:
            self.users -= 1
            if self.users == 0:
                del _prepared[id(self.model)]
                self.restore()

    def compile(self, progress: Progress | None = None, background: BackgroundCompile | None = None) -> None:
        """Compile the forward (or load it compiled) if asked for and not tried yet; the engine serves eager where
        it cannot be compiled. With ``background`` (on the CPU), return at once: the model serves eager while a
        thread builds the forward with it, and switches to it between two forwards. Call between ``acquire`` and
        ``release``."""
        with self._compile_lock:
            if not self.preparation.compile or self._compile_tried:
                return
            self._compile_tried = True
            if self.preparation.device.type != "cpu":  # compiled lazily, by the first steps: nothing to wait for
                self._serve(compile_on_gpu(self.model))
            elif background is None:
                self._serve(load_or_compile(self.model, progress))
            else:
                self.forward_kind = "compiling"
                name = f"astrai-compile-{id(self.model):x}"
                threading.Thread(target=self._compile_in_background, args=(background,), name=name, daemon=True).start()

    def _compile_in_background(self, build: BackgroundCompile) -> None:
        try:
            compiled = build(self.model)
        except Exception:
            log.warning("building the compiled forward failed; serving the model eager", exc_info=True)
            compiled = None
        with self.forwards.lock:  # between two forwards: none sees half a switch
            if self._restored:
                return
            self._serve(compiled)
        log.info("the model serves %s from this step on", "compiled" if compiled is not None else "eager")

    def _serve(self, compiled: Compiled | None) -> None:
        """Serve ``compiled``, or eager (``forward_kind`` "failed") if None. Before the model serves or under
        ``forwards.lock``."""
        self.compiled = compiled
        self.forward_kind = "compiled" if compiled is not None else "failed"

    def _pack(self) -> int:
        """Packing is only a speed-up: where oneDNN refuses a weight, the model keeps its own layers."""
        try:
            return pack_linears(self.model)
        except Exception:
            unpack_linears(self.model)
            log.warning("oneDNN weight packing failed; serving with the model's own linear layers", exc_info=True)
            return 0

    def restore(self) -> None:
        """Give the model back as it came: attention, linear layers, exact weights, dtype and train/eval mode."""
        unpack_linears(self.model)
        for tensor, original in self.original_tensors:
            tensor.data = original
        self.original_tensors = []
        with self.forwards.lock:
            self._restored = True
            self.compiled = None
        self.forwards.stop()
        self.model.train(self.was_training)
        self.model.set_attn_implementation(self.previous_attn)

    def forward(
        self, caller: object, batch: PagedBatch, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The model over one engine's step (``batch`` in that engine's KV tensors), for ``caller`` (its runner),
        one at a time with every other engine's, on the thread ``SharedForwards`` picks."""
        return self.forwards.run(caller, lambda: self._forward(batch, tokens, positions, rows))

    @torch.inference_mode()
    def _forward(
        self, batch: PagedBatch, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        # eager, ``logits`` calls the model itself (so a wrapper put on its forward later, as the soak's faults, runs)
        compiled = self.compiled
        with serving(batch):
            if compiled is not None:
                try:
                    return compiled.forward(self.model, tokens, positions, rows)[0]
                except GraphNoLongerFits as exc:
                    # the process changed what the graph was compiled for (torch.set_num_threads, say): serve
                    # eager from here on rather than fail every step; forwards run one at a time, so no race
                    log.warning("the compiled forward no longer fits this process (%s); serving eager", exc)
                    self._serve(None)
            return logits(self.model, tokens, positions, rows)[0]


def _check_locked(model: PreTrainedModel, preparation: Preparation) -> PreparedModel | None:
    """The model's live preparation if it matches ``preparation``, None if it has none; else ``ValueError``."""
    prepared = _prepared.get(id(model))
    if prepared is None:
        if model.config._attn_implementation == ATTN_IMPLEMENTATION:
            raise ValueError(
                "this model's layers are already wired for astrai, but no InferenceEngine serves it (a copy of a "
                "serving model?): pass the model as loaded"
            )
        return None
    differences = preparation.differences(prepared.preparation)
    if differences:
        raise ValueError(
            "this model already serves another InferenceEngine, prepared differently: this one asks for "
            f"{', '.join(differences)}. Engines sharing one model must agree on dtype, device, packed_weights, "
            "attention_kernel and compile: pass the same, shut the other engine down, or pass a copy of the model"
        )
    return prepared


class ModelRunner:
    """One engine's runner: its own KV tensors, over a ``PreparedModel`` it may share with other engines.

    The engine's loop thread is the only one to call ``step`` and ``release``; ``step`` builds the paged batch on
    that thread and runs the forward on the prepared model's thread.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        n_pages: int,
        page_size: int,
        preparation: Preparation,
        progress: Progress | None = None,
        background_compile: BackgroundCompile | None = None,
    ):
        config = model.config
        check_supported(config)
        PreparedModel.check(model, preparation)  # a conflict is refused before any memory is taken
        dtype, device = preparation.dtype, preparation.device
        self.page_size = page_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        slots = n_pages * page_size
        # the KV tensors first: a pool too large for memory fails here, before the model is touched
        shape = (kv_heads, slots, head_dim)
        arena = Arena()  # on the CPU, the pool on huge pages: a decode step reads its requests' pages of every layer

        def zeros() -> torch.Tensor:
            return arena.zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

        self.kv_cache = [(zeros(), zeros()) for _ in range(config.num_hidden_layers)]
        self.prepared = PreparedModel.acquire(model, preparation)
        self._released = False
        self.prepared.compile(progress, background_compile)

    @property
    def model(self) -> PreTrainedModel:
        return self.prepared.model

    @property
    def device(self) -> torch.device:
        return self.prepared.preparation.device

    @property
    def paged_kernel(self) -> PagedKernel | None:
        return self.prepared.paged_kernel

    @property
    def packed_linears(self) -> int:
        return self.prepared.packed_linears

    @property
    def compiled(self) -> Compiled | None:
        return self.prepared.compiled

    @property
    def forward_kind(self) -> Forward:
        return self.prepared.forward_kind

    def release(self) -> None:
        """Drop this engine's KV tensors and its share of the model; the last engine on the model gives it back
        as it came (``PreparedModel.restore``). Idempotent; call with no forward of this runner running."""
        if self._released:
            return
        self._released = True
        self.kv_cache = []
        self.prepared.forwards.forget(self)
        self.prepared.release()

    def kv_planes(self) -> list[torch.Tensor]:
        """The KV pages' bytes as planes, for the second tier (``astrai.tier.store``): one per (layer, K or V, KV
        head), each a ``uint8`` view ``[n_pages, page_size * head_dim * itemsize]`` of the KV tensors (no copy), in
        which page ``p`` is row ``p``; a page is its row in every plane. Views of the live KV: a copy into them is a
        copy into the pool."""
        n_pages = self.kv_cache[0][0].shape[1] // self.page_size
        return [head.view(torch.uint8).view(n_pages, -1) for pair in self.kv_cache for kv in pair for head in kv]

    @torch.inference_mode()
    def step(self, work: list[tuple[Request, int]]) -> torch.Tensor:
        """Compute ``count`` tokens of each request; return logits [R, V] (on the device) for the requests that
        reach their end. Nothing here waits for the device: the step's inputs are copied to it without a sync."""
        input_ids, positions, sample_rows = array("q"), array("q"), array("q")
        for req, count in work:
            start = req.num_computed
            input_ids.extend(req.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            if start + count == len(req.token_ids):
                sample_rows.append(len(input_ids) - 1)
        batch = build_paged_batch(
            self.kv_cache,
            [(_kv_pages(req), req.num_computed, count) for req, count in work],
            self.page_size,
            self.paged_kernel,
        )
        device = self.device
        tokens = to_device(_long_tensor(input_ids).view(1, -1), device)
        positions_t = to_device(_long_tensor(positions).view(1, -1), device)
        rows = to_device(_long_tensor(sample_rows), device)
        return self.prepared.forward(self, batch, tokens, positions_t, rows)


def _kv_pages(req: Request) -> list[int]:
    """The request's page table as pages of the engine's KV tensors: its tenant's numbers moved by its offset."""
    return [page + req.page_offset for page in req.pages] if req.page_offset else req.pages


def _long_tensor(values: array) -> torch.Tensor:
    """An int64 tensor over ``values``' own buffer (it keeps the array alive): contiguous, at offset 0, and 16-byte
    aligned as CPython allocates it, so the compiled graph takes it as it took ``torch.tensor``'s.

    Why: ``torch.tensor`` of a Python list inspects every element; an ``array('q')`` is already int64 memory, so
    ``frombuffer`` only wraps it. ``frombuffer`` refuses an empty buffer: a step in which no request samples has no
    rows."""
    return torch.frombuffer(values, dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
