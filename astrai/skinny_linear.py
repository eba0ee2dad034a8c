"""Products of a step's few rows by a packed layer's weight, in C (``kernels/skinny_linear.c``), beside oneDNN.

A packed layer (``packed_linear.py``) multiplies through oneDNN, and torch's call into it costs more than a decode
step's product itself: in one profiled run of the embedded model's bfloat16 decode step (8 rows), its 25 products
took 0.33 ms inside oneDNN (``ONEDNN_VERBOSE``) and about 0.8 ms as torch's calls. This kernel has no such cost: it
reads a second copy of the weight, laid out once for it, in a loop of vector multiply-adds (AVX512-BF16 dot products
in bfloat16) on torch's OpenMP threads. Each layer keeps its oneDNN weight too, for products of more rows
(prefills), where oneDNN's blocked GEMM is the faster: the weights are held twice, the price of the speed.

Measured on a 2-core AMD EPYC with AVX512-BF16, no AMX (``python -m benchmarks.skinny_ab --model M --dtype D
--shapes``; 3 rounds of 100 decode steps of 8 requests at 300 tokens, the kernel switched on and off step by step
in one runner, oneDNN's time over the kernel's):

- whole decode steps: embedded model 1.355-1.380x in bfloat16, 1.305-1.309x in float32; SmolLM2-135M-shaped model
  1.197-1.241x in bfloat16, 1.288-1.302x in float32 (measured before ``SkinnyWeight`` bound each weight once, which
  took a product's Python from 7.5 to 5.6 us);
- each weight alone (one run each), at 8 rows: 1.03-1.78x on the embedded model, 1.01-1.41x on the
  SmolLM2-shaped one; at ``SKINNY_ROWS`` (16) rows 0.96-1.60x, oneDNN ahead only on the widest float32 weights; at
  32 rows oneDNN was ahead on more of them. The SmolLM2-shaped LM head (49,152 x 576) in bfloat16 for one row is
  the one case below 16 rows where oneDNN led (0.89x): streaming its 56 MB, it reads memory faster than this loop.

Where the kernel cannot be built (no compiler), ``load_skinny_kernel`` says so and every product stays oneDNN's; so
does every bfloat16 product where the CPU lacks AVX512-BF16 (``supports``).
"""

from __future__ import annotations

import ctypes
import functools
from _ctypes import CFuncPtr  # ctypes' function type (ctypes names it _CFuncPtr, which its stubs do not export)

import torch

from astrai import native
from astrai.huge_pages import Arena

SKINNY_ROWS = 16  # the most rows a product takes through this kernel; more go to oneDNN
BLOCK = 16  # output columns per block of the laid-out weight (the C code's LANES)


class SkinnyKernel:
    """The built library: ``bind`` a weight to it once, then ``multiply`` any few rows by the result."""

    def __init__(self, library: ctypes.CDLL):
        self.functions = {}
        for dtype, suffix in native.DTYPES.items():
            function = getattr(library, f"skinny_linear_{suffix}")
            function.restype = ctypes.c_int
            function.argtypes = [
                ctypes.c_void_p,  # x
                ctypes.c_int64,  # its row stride
                *[ctypes.c_void_p] * 3,  # weight (laid out), bias, out
                *[ctypes.c_int64] * 4,  # out's row stride, rows, out_features, in_features
                ctypes.c_int,  # threads
            ]
            self.functions[dtype] = function
        library.skinny_bfloat16_dot.restype = ctypes.c_int
        self.bfloat16_dot = bool(library.skinny_bfloat16_dot())

    def supports(self, dtype: torch.dtype, in_features: int) -> bool:
        if dtype == torch.bfloat16:
            return self.bfloat16_dot and in_features % 2 == 0  # the C code takes k in pairs
        return dtype == torch.float32

    def bind(self, weight: torch.Tensor, arena: Arena) -> SkinnyWeight:
        """``weight`` [N, K] laid out for this kernel (a copy, in ``arena``'s huge pages), ready to ``multiply`` by."""
        return SkinnyWeight(self.functions[weight.dtype], lay_out(weight, arena), *weight.shape)


class SkinnyWeight:
    """One weight laid out for the kernel: ``multiply`` any few rows by it.

    Everything fixed about the weight is resolved here once (its C function, address and sizes): a decode step makes
    one call per packed layer, and each call's Python was most of its cost beside the kernel's few microseconds.
    Deliberately not callable: torch.compile's cache pickles the callable attributes of the model's modules (the
    others it leaves out), and this holds a ctypes function, which cannot be pickled: the compile then failed."""

    __slots__ = ("function", "laid_out", "address", "out_features", "in_features", "dtype")

    def __init__(self, function: CFuncPtr, laid_out: torch.Tensor, out_features: int, in_features: int):
        self.function = function
        self.laid_out = laid_out  # kept alive: the C code reads it through ``address``
        self.address = laid_out.data_ptr()
        self.out_features = out_features
        self.in_features = in_features
        self.dtype = laid_out.dtype

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T + bias``: x [..., K] of the weight's dtype, bias [N] or None."""
        if x.dtype != self.dtype or x.shape[-1] != self.in_features:
            wanted = f"[..., {self.in_features}] {self.dtype}"
            raise ValueError(f"the skinny product takes {wanted}, got {list(x.shape)} {x.dtype}")
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype)
        status = self.function(
            x.data_ptr(),
            self.in_features,
            self.address,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            self.out_features,
            x.numel() // self.in_features,
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"the skinny product refused in_features={self.in_features} in {x.dtype}")
        return out


def lay_out(weight: torch.Tensor, arena: Arena) -> torch.Tensor:
    """``weight`` [N, K] as the C code reads it (its layouts: see the C file), N padded with zero rows, in ``arena``:
    a decode step streams every laid-out weight, which huge pages make faster (``huge_pages.py``)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // BLOCK) * BLOCK
    weight = torch.nn.functional.pad(weight.detach(), (0, 0, 0, padded - out_features))
    if weight.dtype == torch.bfloat16:  # [N/16, 16, K/2, 2] -> [N/16, K/2, 16, 2]
        blocked = weight.view(padded // BLOCK, BLOCK, in_features // 2, 2).transpose(1, 2)
    else:
        blocked = weight.view(padded // BLOCK, BLOCK, in_features).transpose(1, 2)
    return arena.empty(blocked.shape, blocked.dtype).copy_(blocked)


@functools.cache
def load_skinny_kernel() -> SkinnyKernel | None:
    """The kernel, built if this machine has not built it yet; None (logged once) where that is not possible."""
    library = native.load("skinny_linear", "every product goes through oneDNN")
    return None if library is None else SkinnyKernel(library)
