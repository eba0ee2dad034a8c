"""CPU memory on 2 MiB pages (Linux transparent huge pages) for the tensors a decode step streams.

Why: a decode step reads every weight of the model once, and its requests' KV pages, for a handful of rows: it is
bound by reading memory. On 4 KiB pages that stream needs a new address translation every 4 KiB (the TLB holds a
few thousand; a SmolLM2-135M-shaped model's weights are 270 MB in bfloat16), on 2 MiB pages one every 2 MiB. On a
2-core AMD EPYC (AVX512-BF16, no AMX), whole decode steps of 8 requests at 300 tokens were 1.02-1.03x faster with
the laid-out weights and the KV pool on huge pages on a SmolLM2-135M-shaped model (bfloat16 and float32), and
1.09-1.14x on the embedded one (``python -m benchmarks.decode_step --variants default,plain-pages``, 3 rounds each).

torch can put its own large allocations on huge pages (the ``THP_MEM_ALLOC_ENABLE`` environment variable), but reads
that variable once, at the process's first allocation: a library imported after torch cannot switch it on. So the
tensors that pay are carved out of an ``Arena`` of anonymous mappings that asks the kernel for huge pages
(``madvise(MADV_HUGEPAGE)``, which the default ``madvise`` setting of
``/sys/kernel/mm/transparent_hugepage/enabled`` honours). Many small tensors share one mapping, so the rounding to
2 MiB costs at most one partly used huge page per mapping. Where huge pages are not offered (another OS, or
``never``), the same code gives plain memory: it is only a speed-up. ``ASTRAI_HUGE_PAGES=0`` in the environment
asks for plain pages too (``ENABLED``), where memory is tight: a huge page is backed whole once touched.
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # bytes: the x86-64 huge page
CHUNK = 32 * HUGE_PAGE  # bytes an arena maps at a time, unless one tensor needs more
ALIGNMENT = 64  # bytes: each tensor starts on a cache line, as torch's allocator starts its own
ENABLED = os.environ.get("ASTRAI_HUGE_PAGES", "1") != "0"  # read when an arena maps memory


class Arena:
    """Hands out CPU tensors from huge-page mappings, one after the other; never reuses memory.

    A tensor keeps its mapping alive (its storage holds the mapping), so the arena itself can be dropped once the
    tensors it gave are made: it lives as long as one model's packing, or one pool's KV tensors."""

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # bytes of the current mapping, from its first 2 MiB boundary
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` (contiguous)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._chunk is None or start + nbytes > self._chunk.numel():
            self._chunk, start = _map(max(CHUNK, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)), 0
        self._used = start + nbytes
        return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeros, every page touched now (fresh mappings read as zeros, but are backed only when first written): a
        pool too large for memory fails here, as with ``torch.zeros``, not in the middle of a run."""
        return self.empty(shape, dtype).zero_()


def _map(nbytes: int) -> torch.Tensor:
    """``nbytes`` (a multiple of 2 MiB) of fresh anonymous memory as a uint8 tensor starting on a 2 MiB boundary."""
    if not (ENABLED and hasattr(mmap, "MADV_HUGEPAGE")):  # switched off, or not Linux: torch's own memory
        return torch.empty(nbytes, dtype=torch.uint8)
    # private: a shared anonymous mapping is shmem, which the huge page setting for shmem governs (usually never)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # its storage holds ``mapping`` until the last view dies
    offset = -whole.data_ptr() % HUGE_PAGE
    return whole[offset : offset + nbytes]
