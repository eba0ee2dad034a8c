"""The C decode-attention kernel (``kernels/paged_decode.c``): built on first use, loaded with ctypes.

Why a kernel of our own: a decode step's attention through PyTorch first gathers every request's context out of
the pages into a contiguous copy (``index_select``), then attends over the copy; the kernel reads each K and V row
where it lives, once. On a SmolLM2-135M-shaped model (8 requests at 300 tokens) the gather and the attention call
were about a quarter of a float32 decode step and a third of a bfloat16 one, on one thread (docs/benchmarks.md);
no library op attends over a page table on the CPU, and inductor turned the same computation either into the
gather again or into a loop that read the values with scattered loads (slower than the gather).

It runs its (request, KV head) pairs on torch's own OpenMP threads (the C file says how it shares torch's runtime):
whole eager decode steps of the SmolLM2-135M-shaped model were 1.08-1.11x faster in float32 and 1.06-1.09x in
bfloat16 than with the kernel on one thread (2 threads, 3 rounds of 20 interleaved steps, docs/benchmarks.md).

It is plain C, no PyTorch headers: ``gcc`` builds it in under a second, into ``~/.cache/astrai/kernels`` under a
name that hashes the source, the flags and this CPU's model and flags (``-march=native``; ``disk_cache.py``).
Where there is no compiler, or the build or load fails, ``load_decode_kernel`` returns None and the engine attends
through PyTorch as before: the kernel is only a speed-up.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from astrai.disk_cache import cache_dir, cpu_identity

log = logging.getLogger("astrai")

SOURCE = Path(__file__).with_name("kernels") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: "paged_decode_float32", torch.bfloat16: "paged_decode_bfloat16"}
MAX_GROUPS, MAX_HEAD_DIM = 16, 256  # the C code's fixed buffers (and it takes D in whole 16-float vectors)


class DecodeKernel:
    """``attend`` computes what the PyTorch decode path computes, from the pages in place."""

    def __init__(self, library: ctypes.CDLL):
        self.functions = {}
        rows = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]  # a pointer, its row and head strides
        for dtype, name in DTYPES.items():
            function = getattr(library, name)
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
            self.functions[dtype] = function

    def supports(self, dtype: torch.dtype, groups: int, head_dim: int) -> bool:
        return dtype in self.functions and groups <= MAX_GROUPS and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0

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
        query, new_k, new_v = (_rows_in_place(t) for t in (query, *(new_kv or (None, None))))
        if not all(t.is_contiguous() for t in (k_cache, v_cache, pages, lengths)):
            raise ValueError("the decode kernel needs contiguous caches, pages and lengths")
        dtype = k_cache.dtype
        if not (query.dtype == v_cache.dtype == dtype and pages.dtype == lengths.dtype == torch.long) or (
            new_k is not None and not new_k.dtype == new_v.dtype == dtype
        ):
            raise ValueError("the decode kernel needs query, rows and caches of one dtype, and int64 pages and lengths")
        out = torch.empty((batch, heads, head_dim), dtype=dtype)
        status = self.functions[dtype](
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
        if status == -2:
            raise MemoryError("the decode kernel could not allocate its per-thread scores")
        if status != 0:
            raise RuntimeError(f"the decode kernel refused {heads // kv_heads} groups of head size {head_dim}")
        return out


def _rows_in_place(rows: torch.Tensor | None) -> torch.Tensor | None:
    """``rows`` as it is where each row's D values lie side by side (the model's layouts), else a copy."""
    return rows if rows is None or rows.stride(-1) == 1 else rows.contiguous()


def _rows(rows: torch.Tensor | None) -> tuple[int | None, int, int]:
    """A [1, heads, B, D] tensor as the C code takes it: its address, and its row (B) and head strides."""
    return (None, 0, 0) if rows is None else (rows.data_ptr(), rows.stride(2), rows.stride(1))


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built if this machine has not built it yet; None (logged once) where that is not possible."""
    try:
        return DecodeKernel(ctypes.CDLL(str(_build())))
    except Exception as error:  # no compiler, a read-only cache, an unknown CPU: PyTorch attends instead
        detail = error.stderr.decode(errors="replace") if isinstance(error, subprocess.CalledProcessError) else error
        log.warning("decode attention kernel unavailable (%s); attending through PyTorch", detail)
        return None


def _build() -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + cpu_identity().encode()).hexdigest()[:16]
    cache = cache_dir("kernels")
    library = cache / f"paged_decode-{key}.so"
    if library.exists():
        return library
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # built aside, then renamed: never half a library
        built = Path(scratch) / library.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], check=True, capture_output=True)
        os.replace(built, library)
    return library
