"""The C attention kernels (``kernels/paged_attention.c``): built on first use, loaded with ctypes.

Two kernels read the K and V rows where they live in the pages, through each request's page table:

- **Decode** (``attend``): one query token per request. Through PyTorch, a decode step's attention first gathered
  every request's context out of the pages into a contiguous copy (``index_select``), then attended over the copy.
  On a SmolLM2-135M-shaped model (8 requests at 300 tokens) the gather and the attention call were about a quarter
  of a float32 decode step and a third of a bfloat16 one, on one thread (docs/benchmarks.md); inductor turned the
  same computation either into the gather again or into a loop that read the values with scattered loads.
- **Prefill** (``prefill``): every multi-token chunk of a step, causally, in one call. Through PyTorch each chunk
  was one ``scaled_dot_product_attention`` call, a chunk after a cached prefix with its context gathered and an
  additive mask. The kernel made W1's 512-token step (a 256-token prefix, then seven 32-token suffixes that share
  it) 1.11x faster on the embedded model in float32, 1.48x in bfloat16, and 1.20-1.21x on a SmolLM2-135M-shaped
  model in bfloat16 (2-core AMD EPYC, no AMX; 3 rounds, docs/benchmarks.md).

No library op attends over a page table on the CPU. Both run on torch's own OpenMP threads (the C file says how
it shares torch's runtime): whole eager decode steps of the SmolLM2-135M-shaped model were 1.08-1.11x faster in
float32 and 1.06-1.09x in bfloat16 than with the decode kernel on one thread (2 threads, 3 rounds of 20
interleaved steps, docs/benchmarks.md).

``native.py`` builds it once per machine. Where there is no compiler, or the build or load fails,
``load_paged_kernel`` returns None and the engine attends through PyTorch as before: the kernels are only a speed-up.
"""

from __future__ import annotations

import ctypes
import functools
from typing import overload

import torch

from astrai import native

MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # the C code's fixed buffers (and it takes D in whole 16-float vectors)


class PagedKernel:
    """``attend`` and ``prefill`` compute what the PyTorch decode and prefill paths compute, from the pages in place."""

    def __init__(self, library: ctypes.CDLL):
        self.decode_functions = {}
        self.prefill_functions = {}
        rows = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # a pointer, its row and head strides
        for dtype, suffix in native.DTYPES.items():
            prefill = getattr(library, f"paged_prefill_{suffix}")
            prefill.restype = ctypes.c_int
            prefill.argtypes = [
                *rows,  # query
                *[ctypes.c_void_p] * 3,  # k_cache, v_cache, pages
                ctypes.c_int64,  # the page table's width
                ctypes.c_void_p,  # chunks
                ctypes.c_int64,  # their count
                ctypes.c_void_p,  # out
                *[ctypes.c_int64] * 6,  # out's row stride, kv_heads, groups, head_dim, cache_slots, page_size
                ctypes.c_float,
                ctypes.c_int,
            ]
            self.prefill_functions[dtype] = prefill
            function = getattr(library, f"paged_decode_{suffix}")
            function.restype = ctypes.c_int
            function.argtypes = [
                *rows * 3,  # query, new keys, new values
                *[ctypes.c_void_p] * 3,  # k_cache, v_cache, pages
                ctypes.c_int64,  # the page table's width
                *[ctypes.c_void_p] * 2,  # lengths, out
                *[ctypes.c_int64] * 6,  # batch, kv_heads, groups, head_dim, cache_slots, page_size
                ctypes.c_float,
                ctypes.c_int,
            ]
            self.decode_functions[dtype] = function

    def supports(self, dtype: torch.dtype, groups: int, head_dim: int) -> bool:
        fits = groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0
        return dtype in self.decode_functions and fits

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        lengths: torch.Tensor,
        page_size: int,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """query [1, H, B, D], as the attention hook gets it; caches [KVH, S, D]; pages [B, P] int64, each request's
        page table, of which the pages holding its first ``lengths[b]`` positions are read. ``new_kv``: this step's
        keys and values [1, KVH, B, D], written into the slot of position ``lengths[b] - 1`` before any request
        attends. Returns [B, H, D].

        Query and new rows are read in place through their strides (the model's transposed layouts: no copies)
        where each row's D values lie side by side; the caches, pages and lengths must be contiguous; all of one
        float dtype but pages and lengths (int64). The C code indexes raw memory: these are checked per call. That
        every page read lies below S holds by construction (page tables come from the engine's pool), so it is
        not. This runs once per layer and step: it stays lean (no profiler range, no views), as its Python cost
        was about as large as the kernel's own time on the embedded model.
        """
        _, heads, batch, head_dim = query.shape
        kv_heads, cache_slots, _ = k_cache.shape
        query = _rows_in_place(query)
        new_k, new_v = (None, None) if new_kv is None else (_rows_in_place(new_kv[0]), _rows_in_place(new_kv[1]))
        if not all(t.is_contiguous() for t in (k_cache, v_cache, pages, lengths)):
            raise ValueError("the decode kernel needs contiguous caches, pages and lengths")
        dtype = k_cache.dtype
        if not (query.dtype == v_cache.dtype == dtype and pages.dtype == lengths.dtype == torch.long) or (
            new_kv is not None and not new_kv[0].dtype == new_kv[1].dtype == dtype  # as given: a copy keeps its dtype
        ):
            raise ValueError("the decode kernel needs query, rows and caches of one dtype, and int64 pages and lengths")
        out = torch.empty((batch, heads, head_dim), dtype=dtype)
        status = self.decode_functions[dtype](
            *_rows(query),
            *_rows(new_k),
            *_rows(new_v),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            pages.data_ptr(),
            pages.shape[1],
            lengths.data_ptr(),
            out.data_ptr(),
            batch,
            kv_heads,
            heads // kv_heads,
            head_dim,
            cache_slots,
            page_size,
            scale,
            torch.get_num_threads(),
        )
        _check("decode", status, heads // kv_heads, head_dim)
        return out

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: torch.Tensor,
        chunks: torch.Tensor,
        page_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of the step's multi-token chunks, written into their rows of ``out`` [T, H, D]
        (contiguous). query [1, H, T, D], as the attention hook gets it; caches [KVH, S, D], already holding every
        chunk's new K and V rows; chunks [C, 3] int64, each (first row, rows, tokens computed before it); pages
        [C, P] int64, each chunk's page table. Checked as ``attend``'s inputs are."""
        heads, head_dim = query.shape[1], query.shape[3]
        kv_heads, cache_slots, _ = k_cache.shape
        query = _rows_in_place(query)
        if not all(t.is_contiguous() for t in (k_cache, v_cache, pages, chunks, out)):
            raise ValueError("the prefill kernel needs contiguous caches, pages, chunks and output")
        dtype = k_cache.dtype
        if not (query.dtype == v_cache.dtype == out.dtype == dtype and pages.dtype == chunks.dtype == torch.long):
            raise ValueError("the prefill kernel needs query, caches and output of one dtype, int64 pages and chunks")
        status = self.prefill_functions[dtype](
            *_rows(query),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            pages.data_ptr(),
            pages.shape[1],
            chunks.data_ptr(),
            chunks.shape[0],
            out.data_ptr(),
            out.stride(0),
            kv_heads,
            heads // kv_heads,
            head_dim,
            cache_slots,
            page_size,
            scale,
            torch.get_num_threads(),
        )
        _check("prefill", status, heads // kv_heads, head_dim)


def _check(kernel: str, status: int, groups: int, head_dim: int) -> None:
    """Raise what a kernel's status says: -2, out of memory; any other non-zero, a shape it does not take."""
    if status == -2:
        raise MemoryError(f"the {kernel} kernel could not allocate its per-thread buffers")
    if status != 0:
        raise RuntimeError(f"the {kernel} kernel refused {groups} groups of head size {head_dim}")


@overload
def _rows_in_place(rows: torch.Tensor) -> torch.Tensor: ...
@overload
def _rows_in_place(rows: None) -> None: ...
def _rows_in_place(rows: torch.Tensor | None) -> torch.Tensor | None:
    """``rows`` as it is where each row's D values lie side by side (the model's layouts), else a copy."""
    return rows if rows is None or rows.stride(-1) == 1 else rows.contiguous()


def _rows(rows: torch.Tensor | None) -> tuple[int | None, int, int]:
    """A [1, heads, B, D] tensor as the C code takes it: its address, and its row (B) and head strides."""
    return (None, 0, 0) if rows is None else (rows.data_ptr(), rows.stride(2), rows.stride(1))


@functools.cache
def load_paged_kernel() -> PagedKernel | None:
    """The kernels, built if this machine has not built them yet; None (logged once) where that is not possible."""
    library = native.load("paged_attention", "attending through PyTorch")
    return None if library is None else PagedKernel(library)
