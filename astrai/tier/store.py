"""Where the second tier's pages live: fixed-size slots of raw bytes, copied to and from the pool's KV pages in runs.

A store knows nothing of keys, chains or eviction (``SecondTier`` does). It holds ``slots`` slots of ``page_bytes``
bytes each, and is bound (``bind``) to the pool's KV as *planes*: plane ``j`` is one (layer, K or V, KV head)'s
memory, ``[n_pages, segment_bytes]`` bytes, and a pool page is its row in every plane (``ModelRunner.kv_planes``; a
tenant's pool binds row slices of them, ``plane[offset : offset + n]``). A slot holds a page as one segment per
plane. A *run* is ``count`` consecutive slots to or from ``count`` consecutive pool pages: on the pool's side each
plane's rows of a run are one contiguous range, and each store lays out its slots so a run costs the fewest calls
its medium allows. Bytes are copied as bytes, so a round trip is an exact copy whatever the dtype (bfloat16 too).

* ``MemoryStore``: one preallocated ``uint8`` tensor, plane-major (plane ``j``'s segment of slot ``s`` at byte
  ``(j * slots + s) * segment_bytes``), so a run is one contiguous range per plane on both sides: one copy per plane
  moves the whole run, whatever its length. With the KV on the CPU a copy is a ``memoryview`` slice assignment (a
  ``memcpy`` at a fraction of a microsecond's call cost, where a ``Tensor.copy_`` of a slice costs microseconds:
  most of a one-page load's time). With the KV on a GPU the slots are in pinned host memory and each plane's copy
  is a ``Tensor.copy_(non_blocking=True)``, queued on the current stream, which is synchronized once at the end of a
  run so the pool's pages are ready, and the seconds counted are the copy's, when ``read`` returns (untested here:
  no GPU on the machines this was written on).
* ``FileStore``: one preallocated file on local disk, slot-major (slot ``s`` at byte ``s * page_bytes``, its planes'
  segments in plane order), so a run is one contiguous range of the file: one ``preadv`` / ``pwritev`` moves it,
  straight between the file and the pool's KV (no staging buffer, no second copy), its buffers the run's (page,
  plane) segments, split only where a run has more segments than one call takes (``IOV_MAX``, 1,024 on Linux). A
  system call costs microseconds, so one a run (the old plane-major file took one a plane: 24 for the embedded
  model, 180 for the SmolLM2-135M-shaped one) lets a one-page load run near a sequential read's speed. The calls
  are the C library's, on a table of ``struct iovec`` (one a (page, plane) segment, 16 bytes) built once at
  ``bind``: ``os.preadv`` wants a Python buffer object a segment, and making count x planes of them cost more than
  the copy for long runs (a 63-page run in half the bandwidth). Real system calls, served by the disk or the OS page
  cache (no ``O_DIRECT``: its alignment rules would need a bounce buffer). The KV must be in host memory. The whole
  file is allocated at construction (``posix_fallocate``), so a disk too small or a folder that cannot be written
  fails there, with the path and the size in the message, never later in the middle of a request.

Both raise ``OSError`` (or ``RuntimeError``) on failure; ``SecondTier`` switches the tier off on any error from a
store after construction, so a request never fails because of its tier.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a store touches tensors: the lab's replay uses the tier without torch
    import torch

IOV_MAX = os.sysconf("SC_IOV_MAX")  # the most buffers one ``preadv`` / ``pwritev`` takes


class TierStore(ABC):
    """``slots`` slots of ``page_bytes`` bytes; ``medium`` names where they live (for the stats)."""

    medium: str

    def __init__(self, slots: int, page_bytes: int) -> None:
        if slots < 1 or page_bytes < 1:
            raise ValueError(f"a tier store needs slots >= 1 and page_bytes >= 1, got {slots} and {page_bytes}")
        self.slots = slots
        self.page_bytes = page_bytes
        self.segment_bytes = 0  # one plane's part of a page; set by ``bind``
        self.n_pages = 0  # the pool's pages, set by ``bind``

    def bind(self, planes: Sequence[torch.Tensor]) -> None:
        """Copy to and from these planes of the pool's KV from now on (see the module docstring): ``uint8`` tensors
        of ``[n_pages, segment_bytes]``, contiguous, whose segments add up to ``page_bytes``."""
        if not planes:
            raise ValueError("a tier store needs at least one plane of KV")
        import torch

        n_pages, segment = planes[0].shape
        for plane in planes:
            if plane.dtype != torch.uint8 or plane.shape != (n_pages, segment) or not plane.is_contiguous():
                raise ValueError("the KV planes must be contiguous uint8 tensors of one shape [n_pages, segment]")
        if len(planes) * segment != self.page_bytes:
            raise ValueError(f"a page of this tier is {self.page_bytes} bytes, the planes make {len(planes) * segment}")
        self.segment_bytes, self.n_pages = segment, n_pages
        self._bind(planes)

    @abstractmethod
    def _bind(self, planes: Sequence[torch.Tensor]) -> None: ...

    @abstractmethod
    def read(self, first_slot: int, first_page: int, count: int) -> None:
        """Copy slots ``first_slot ..`` into pool pages ``first_page ..``, ``count`` of each."""

    @abstractmethod
    def write(self, first_slot: int, first_page: int, count: int) -> None:
        """Copy pool pages ``first_page ..`` into slots ``first_slot ..``, ``count`` of each."""

    def close(self) -> None:
        """Give back what the store holds: its hold on the pool's KV, a file's descriptor, the file itself."""
        self._bind([])

    def _check(self, first_slot: int, first_page: int, count: int) -> None:
        if not self.segment_bytes:
            raise RuntimeError("the tier store is not bound to the pool's KV")
        if count < 1 or not 0 <= first_slot <= self.slots - count:
            raise IndexError(f"slots {first_slot}..+{count} are outside the store's {self.slots} slots")
        if not 0 <= first_page <= self.n_pages - count:
            raise IndexError(f"pages {first_page}..+{count} are outside the pool's {self.n_pages} pages")


def flat_bytes(plane: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes as a flat ``memoryview``: slicing and assigning one costs no tensor op."""
    return plane.numpy().data.cast("B")


class MemoryStore(TierStore):
    """The slots in one host tensor, ``data``, plane-major; ``pinned``: page-locked, so a CUDA device copies to and
    from it directly. See the module docstring."""

    def __init__(self, slots: int, page_bytes: int, pinned: bool = False) -> None:
        import torch

        super().__init__(slots, page_bytes)
        self.medium = "pinned host memory" if pinned else "memory"
        self.data = torch.empty(slots * page_bytes, dtype=torch.uint8, pin_memory=pinned)
        self._host: list[tuple[memoryview, memoryview]] = []  # (pool plane, its slots here), KV on the CPU
        self._device: list[tuple[torch.Tensor, torch.Tensor]] = []  # the same as tensors, KV on a GPU

    def _bind(self, planes: Sequence[torch.Tensor]) -> None:
        self._host, self._device = [], []
        if not planes:
            return
        mine = self.data.view(len(planes), self.slots, self.segment_bytes)
        if all(plane.device.type == "cpu" for plane in planes):
            self._host = [(flat_bytes(plane), flat_bytes(mine[j])) for j, plane in enumerate(planes)]
        else:
            self._device = list(zip(planes, mine, strict=True))

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        self._copy(first_slot, first_page, count, into_pool=True)

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        self._copy(first_slot, first_page, count, into_pool=False)

    def _copy(self, first_slot: int, first_page: int, count: int, into_pool: bool) -> None:
        self._check(first_slot, first_page, count)
        segment = self.segment_bytes
        pages = slice(first_page * segment, (first_page + count) * segment)
        slots = slice(first_slot * segment, (first_slot + count) * segment)
        for pool, mine in self._host:
            if into_pool:
                pool[pages] = mine[slots]
            else:
                mine[slots] = pool[pages]
        for plane, held in self._device:
            pool_rows, my_rows = plane[first_page : first_page + count], held[first_slot : first_slot + count]
            if into_pool:
                pool_rows.copy_(my_rows, non_blocking=True)
            else:
                my_rows.copy_(pool_rows, non_blocking=True)
        if self._device:
            self._synchronize()

    def _synchronize(self) -> None:
        """Wait for the run's queued copies: the caller counts their seconds and takes the pages as moved."""
        import torch

        torch.cuda.current_stream(self._device[0][0].device).synchronize()


class FileStore(TierStore):
    """The slots in one file under ``folder`` (created, unlinked on ``close``), slot-major; see the module docstring."""

    medium = "file"

    def __init__(self, folder: str | os.PathLike[str], slots: int, page_bytes: int) -> None:
        super().__init__(slots, page_bytes)
        size = slots * page_bytes
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"the second tier's folder {str(folder)!r} is not a directory")
        try:
            fd, name = tempfile.mkstemp(prefix="astrai-tier-", suffix=".kv", dir=folder)
        except OSError as exc:
            raise ValueError(f"cannot create the second tier's file in {str(folder)!r}: {exc.strerror}") from exc
        self.path = Path(name)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise ValueError(
                f"cannot allocate the second tier's {size / 2**20:.1f} MiB ({slots} pages of {page_bytes} bytes) "
                f"in {str(folder)!r}: {exc.strerror}"
            ) from exc
        self._fd: int | None = fd
        self._preadv, self._pwritev = vectored("preadv"), vectored("pwritev")
        self._planes: list[torch.Tensor] = []  # held while bound: the segment table points into their memory
        self._segments: object = None  # the table: (page, plane)'s segment as a struct iovec at [page, plane]
        self._table = 0  # its address

    def _bind(self, planes: Sequence[torch.Tensor]) -> None:
        if any(plane.device.type != "cpu" for plane in planes):
            raise ValueError('a file tier reads into host memory: with the KV on a GPU, use offload_to="memory"')
        self._planes, self._segments, self._table = list(planes), None, 0
        if planes:
            import numpy as np

            rows = np.arange(self.n_pages, dtype=np.uintp)[:, None] * self.segment_bytes
            table = np.empty((self.n_pages, len(planes), 2), dtype=np.uintp)  # struct iovec: base, length
            table[:, :, 0] = rows + np.array([plane.data_ptr() for plane in planes], dtype=np.uintp)
            table[:, :, 1] = self.segment_bytes
            self._segments, self._table = table, table.ctypes.data

    def _descriptor(self) -> int:
        if self._fd is None:
            raise RuntimeError("the second tier's file is closed")
        return self._fd

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        self._move(self._preadv, "read", first_slot, first_page, count)

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        self._move(self._pwritev, "write", first_slot, first_page, count)

    def _move(self, call: VectoredIO, what: str, first_slot: int, first_page: int, count: int) -> None:
        """The run's segments (pool pages ``first_page ..``, plane by plane) are consecutive iovecs of the table, and
        its slots one contiguous range of the file: one ``call`` per ``IOV_MAX`` segments. A failed or short call
        raises ``OSError`` (a regular file moves all or fails, but a short call must never pass)."""
        self._check(first_slot, first_page, count)
        fd, planes, segment = self._descriptor(), len(self._planes), self.segment_bytes
        at, segments, first_iovec = first_slot * self.page_bytes, count * planes, first_page * planes
        for moved in range(0, segments, IOV_MAX):
            batch = min(IOV_MAX, segments - moved)
            size = batch * segment
            done = call(fd, self._table + (first_iovec + moved) * IOVEC_BYTES, batch, at)
            if done < 0:
                error = ctypes.get_errno()
                raise OSError(error, f"cannot {what} the second tier's file {str(self.path)!r}: {os.strerror(error)}")
            if done != size:
                raise OSError(f"short {what} of the second tier's file: {done} of {size} bytes at byte {at}")
            at += size

    def close(self) -> None:
        super().close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


VectoredIO = Callable[[int, int, int, int], int]  # (fd, address of the first iovec, iovecs, offset) -> bytes or -1
IOVEC_BYTES = 2 * ctypes.sizeof(ctypes.c_void_p)  # struct iovec: a base pointer and a length


@functools.cache
def vectored(name: str) -> VectoredIO:
    """The C library's ``preadv`` or ``pwritev``, called on a table of iovecs built once at ``bind`` (``os.preadv``
    takes Python buffers: one object a segment, whose making costs more than the copy for the pages of a KV)."""
    call = getattr(ctypes.CDLL(None, use_errno=True), name)
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    call.restype = ctypes.c_ssize_t
    return call


def open_store(where: str | os.PathLike[str], slots: int, page_bytes: int, pinned: bool = False) -> TierStore:
    """The store ``InferenceEngine(offload_to=...)`` names: ``"memory"`` (host memory, ``pinned`` for a CUDA
    engine), else a folder on local disk for a ``FileStore``. A ``ValueError`` says what is wrong with it."""
    if where == "memory":
        return MemoryStore(slots, page_bytes, pinned)
    if not isinstance(where, (str, os.PathLike)):
        raise ValueError(f'offload_to must be "memory" or a folder on local disk, got {where!r}')
    return FileStore(where, slots, page_bytes)
