"""Linear layers with their weights pre-packed once into oneDNN's blocked layout.

Why: a decode step multiplies a handful of rows (one per request) by every weight matrix of the model. For such
skinny products, torch's default CPU GEMM re-lays the weight out on every call and leaves most of the memory
bandwidth unused; oneDNN with a weight packed ahead of time streams it. On a 2-core machine this makes a
SmolLM2-135M-shaped float32 decode step 1.4-1.6x faster, and 512-row products (prefill chunks) 1.3-1.5x
(``docs/benchmarks.md``). torch's inductor packs CPU linear weights the same way when it freezes a model.

Only where it pays: a oneDNN call has a fixed cost (about 40 us here), so in float32 a weight of fewer than
``MIN_FLOAT32_ELEMENTS`` runs faster through torch's own GEMM. Measured per matrix at 8 and 64 rows (one run, the
median of 200 calls each): a 256x256 weight took 55 us packed against 31 us plain, a 576x576 one 124 against 149,
the 4096x256 output head 295 against 415. The embedded model's float32 decode step is 1.2x faster packing only its
output head than packing all 43 layers (3 interleaved rounds), and the SmolLM2-shaped one is unchanged (its 192x576
key and value projections stay plain). In bfloat16 packing won at every size measured (1.2-1.5x), so every layer is
packed.

The model's architecture is untouched: each ``nn.Linear`` module is swapped for a ``PackedLinear`` that computes
the same product, and ``unpack_linears`` puts the original modules, with their exact weights, back. The two oneDNN
ops are torch-internal (``torch.ops.mkldnn``, the ones inductor uses; torch is pinned); where packing fails, the runner
falls back to the model's own layers.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

BATCH_HINT = 8  # rows oneDNN tunes the packed layout for; any row count works
MIN_FLOAT32_ELEMENTS = 1 << 18  # smaller float32 weights stay plain (see above)


def packing_supported(dtype: torch.dtype) -> bool:
    """oneDNN ships in torch's CPU builds; bfloat16 also needs the CPU's support for it."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """Computes ``linear(x)`` from a packed copy of its weight.

    The original module is kept (unregistered, so the model's parameters are not listed twice) for ``unpack``.
    Its weight's storage is released while packed unless another module shares it (a tied embedding, say).
    """

    def __init__(self, linear: nn.Linear, release: bool):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = linear.bias
        self._original = (linear, release)
        if release:
            linear.weight.data = linear.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def unpacked(self) -> nn.Linear:
        linear, released = self._original
        if released:
            linear.weight.data = self.packed_weight.to_dense()
        return linear


def worth_packing(linear: nn.Linear) -> bool:
    return linear.weight.dtype != torch.float32 or linear.weight.numel() >= MIN_FLOAT32_ELEMENTS


def pack_linears(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` that is worth packing for a ``PackedLinear``; return how many
    were swapped."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    swapped = 0
    for name, module in list(model.named_modules()):
        # subclasses (quantized layers, say) compute something else
        if type(module) is nn.Linear and worth_packing(module):
            _set_submodule(model, name, PackedLinear(module, release=uses[id(module.weight)] == 1))
            swapped += 1
    return swapped


def unpack_linears(model: nn.Module) -> None:
    """Put back the original ``nn.Linear`` modules, with their exact weights."""
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedLinear):
            _set_submodule(model, name, module.unpacked())


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
