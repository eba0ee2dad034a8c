"""Linear layers served from weights laid out once for speed: sibling projections fused, and packed for oneDNN.

Why: a decode step multiplies a handful of rows (one per request) by every weight matrix of the model. Such
skinny products are bound by streaming the weights and by each call's fixed cost, so three things pay:

- **Packing.** torch's default CPU GEMM re-lays a weight out on every call and leaves most of the memory bandwidth
  unused; oneDNN with a weight packed ahead of time streams it. On a 2-core machine (2026-12-02; that run did not
  record its CPU) this made a SmolLM2-135M-shaped float32 decode step 1.4-1.6x faster, and 512-row products
  (prefill chunks) 1.3-1.5x (``docs/benchmarks.md``, "Packed linear weights").
  torch's inductor packs CPU linear weights the same way when it freezes a model, and vLLM's CPU backend packs
  every dense projection. Every weight is packed, the small float32 ones too: on a 2-core AMD EPYC (no AMX) the
  embedded model's compiled float32 decode step was 1.07-1.08x faster with its query-key-value (384x256), output
  (256x256) and down (256x576) weights packed than plain, and its 512-token prefill step 1.04-1.05x
  (``docs/benchmarks.md``).
- **Fusing siblings.** Attention applies its query, key and value projections, and a gated MLP its gate and up
  projections, to one and the same input. Computed as one product over the rows of their weights stacked, each
  group costs one call instead of two or three, and its small members (a GQA model's key and value projections)
  ride on the large one's efficiency. vLLM's model definitions fuse the same groups (its QKV and merged gate-up
  layers); here the fusion is in the weights only: transformers' modules still call ``q_proj``, ``k_proj`` and
  ``v_proj`` one by one, and the first call computes the whole group's product, which the others then take their
  columns of.
- **Few rows, no call overhead.** A product of few rows (a decode step's) goes to the C kernel of
  ``skinny_linear.py``, which reads a second copy of the weight laid out for it: torch's call into oneDNN costs more
  than such a product. Products of more rows (prefills) stay oneDNN's.

The model's architecture is untouched: each ``nn.Linear`` module is swapped for a ``PackedLinear`` that computes
the same product, and ``unpack_linears`` puts the original modules, with their exact weights, back. The two oneDNN
ops are torch-internal (``torch.ops.mkldnn``, the ones inductor uses; torch is pinned); where packing fails, the runner
falls back to the model's own layers.

Under ``torch.compile`` a packed product is one opaque op, ``astrai::packed_linear(x, handle, bias, out_features)``,
as vLLM's CPU backend wraps its prepacked oneDNN weights in its own op. A packed weight is a oneDNN (``mkldnn``
layout) tensor, which a graph can take neither as an input (the compiler cannot trace it) nor as a constant that a
cache can store (it cannot be pickled). So the graph gets a *handle* instead: a small integer tensor, a module
buffer and so an input of the graph like any weight, whose value indexes this process's table of packed weights.
It is never an integer baked into the graph (an index valid in one process only), which is what lets a graph
compiled in one process serve a model packed in another (``compiled_forward.py``).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections import Counter

import torch
from torch import nn

from astrai import ops
from astrai.huge_pages import Arena
from astrai.skinny_linear import SKINNY_ROWS, SkinnyWeight, load_skinny_kernel

BATCH_HINT = 8  # rows oneDNN tunes the packed layout for; any row count works
# oneDNN keeps a primitive for each shape it has multiplied (each row count, for each weight shape), and torch's
# ideep layer keeps an LRU of its own over them: 1,024 entries each by default. A serving engine meets every row
# count from ``SKINNY_ROWS`` + 1 to its batch in decode steps, and any in prefills, so both fill up, and on the
# embedded model an entry holds about 0.36 MiB: over one lesson walked by a class of 30, the playground's native heap
# grew by about 450 MiB (glibc's ``malloc_stats``; all of it in use, none of it Python's). 256 entries each bound
# that near 110 MiB (measured); a row count evicted from both costs about 0.8 ms per weight shape to build again
# (measured on a 2-core Intel Xeon with AMX). Read once, at oneDNN's first primitive: set here, on import, before
# any product.
ONEDNN_CACHE_ENTRIES = "256"
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)  # ideep's (and torch's mkldnn weight caches)
# child names of the projections that one module applies to one input (transformers' Llama-style naming)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


# handle -> its layer's weights, while that layer lives (a proxy: the table never keeps a layer alive)
_packed_weights: dict[int, weakref.CallableProxyType[FusedProduct]] = {}
_next_handle = itertools.count()


def _packed_product(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ W^T + bias`` with ``W`` the packed weight that ``handle`` names; ``out_features`` is its row count."""
    return _packed_weights[int(handle)].multiply(x, bias, out_features)


def _packed_product_shape(
    x: torch.Tensor, handle: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


packed_linear = ops.define(
    "packed_linear(Tensor x, Tensor handle, Tensor? bias, int out_features) -> Tensor",
    _packed_product,
    _packed_product_shape,
    "CPU",  # oneDNN's packed weights are CPU tensors
)


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN ships in torch's CPU builds; bfloat16 also needs the CPU's support for it."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class FusedProduct(nn.Module):
    """One product for sibling linear layers that read the same input: ``x @ [W_1; W_2; ...]^T``, split by columns.

    Invariant: a member's output is the product of the input it was called with. The group's product is computed
    when a member is called with an input the group has not computed yet (a different tensor object, or one whose
    part that member already took), and dropped once every member took its part, so no step's activations outlive
    it. Inputs are compared by identity: the model's modules do not modify their input between sibling calls, and
    the engine runs the model on one thread. Under ``torch.compile`` the same logic is traced once: the graph
    computes each group's product once and slices it (a packed product as one ``astrai::packed_linear`` op). Each
    member's original ``nn.Linear`` is kept (unregistered, so the model's parameters are not listed twice) for
    ``unpack``; its weight's storage is released while fused unless another module shares it (a tied embedding).
    The copy laid out for the skinny kernel is taken from ``arena``, one per model: its weights side by side on
    huge pages (``huge_pages.py``).
    """

    bias: torch.Tensor | None  # buffers (registered below): typed here, as nn.Module's __getattr__ cannot say
    handle: torch.Tensor

    def __init__(self, linears: list[nn.Linear], release: list[bool], arena: Arena):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        # buffers, so that a compiled graph takes them as inputs; not persistent: the state_dict is unchanged
        self.register_buffer("bias", bias, persistent=False)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)  # not a buffer (above)
        # the same weight laid out for products of few rows (decodes), where the C kernel builds, in ``arena``'s
        # huge pages; not a buffer either: the graph reaches it through the handle, as the packed one
        skinny = load_skinny_kernel()
        self.skinny: SkinnyWeight | None = None
        if skinny is not None and skinny.supports(weight.dtype, weight.shape[1]):
            self.skinny = skinny.bind(weight, arena)
        handle = next(_next_handle)
        _packed_weights[handle] = weakref.proxy(self)
        weakref.finalize(self, _packed_weights.pop, handle, None)  # the table never outlives the layer
        self.register_buffer("handle", torch.tensor(handle), persistent=False)
        self.widths = [linear.out_features for linear in linears]
        self.originals = list(zip(linears, release, strict=True))  # a plain list: not registered as submodules
        self._input: weakref.ref[torch.Tensor] | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()
        for linear, released in self.originals:
            if released:
                linear.weight.data = linear.weight.data.new_empty(0)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, sum(self.widths))
        return self.multiply(x, self.bias, sum(self.widths))  # eager: without the op's dispatch

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """The product itself: few rows through the skinny kernel where it serves this weight, else oneDNN."""
        if self.skinny is not None and x.numel() <= SKINNY_ROWS * x.shape[-1]:
            return self.skinny.multiply(x, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if len(self.widths) == 1:
            return self.product(x)
        if self._input is None or self._input() is not x or index in self._taken:
            self._parts = self.product(x).split(self.widths, dim=-1)
            self._input, self._taken = weakref.ref(x), set()
        self._taken.add(index)
        part = self._parts[index]
        if len(self._taken) == len(self.widths):
            self._input, self._parts = None, ()
        return part

    def extra_repr(self) -> str:
        return f"widths={self.widths}"

    def unpacked(self) -> list[nn.Linear]:
        dense = self.packed_weight.to_dense()
        for (linear, released), rows in zip(self.originals, dense.split(self.widths), strict=True):
            if released:
                linear.weight.data = rows.clone()
        return [linear for linear, _ in self.originals]


class PackedLinear(nn.Module):
    """Stands in for one ``nn.Linear``: its columns of a ``FusedProduct`` (a group of one when it has no siblings)."""

    def __init__(self, group: FusedProduct, index: int):
        super().__init__()
        self.group = group
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)


def pack_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` for a ``PackedLinear``, siblings fused; return how many."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    arena = Arena()  # the model's laid-out weights side by side, on as few huge pages as they fill
    packed = 0
    for members in _groups(model):
        linears = list(members.values())
        group = FusedProduct(linears, [uses[id(linear.weight)] == 1 for linear in linears], arena)
        for index, name in enumerate(members):
            _set_submodule(model, name, PackedLinear(group, index))
        packed += len(members)
    return packed


def _groups(model: nn.Module) -> list[dict[str, nn.Linear]]:
    """The model's plain ``nn.Linear`` modules by name, siblings that can share one product together."""
    # subclasses (quantized layers, say) compute something else
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    groups = []
    for siblings in SIBLINGS:
        for name, _ in model.named_modules():
            names = [f"{name}.{child}" if name else child for child in siblings]
            members = [linears[n] for n in names if n in linears]
            if len(members) == len(names) and _fusable(members):
                groups.append(dict(zip(names, members, strict=True)))
                for n in names:
                    del linears[n]
    return groups + [{name: linear} for name, linear in linears.items()]


def _fusable(linears: list[nn.Linear]) -> bool:
    first = linears[0]
    return all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )


def unpack_linears(model: nn.Module) -> None:
    """Put back the original ``nn.Linear`` modules, with their exact weights."""
    restored: dict[int, list[nn.Linear]] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            if id(module.group) not in restored:
                restored[id(module.group)] = module.group.unpacked()
            _set_submodule(model, name, restored[id(module.group)][module.index])


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
