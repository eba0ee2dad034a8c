"""Where the second tier's pages live: fixed-size slots of raw bytes, copied to and from the pool's KV pages in runs.

A store knows nothing of keys, chains or eviction (``SecondTier`` does). It holds ``slots`` slots of ``page_bytes``
bytes each, and is bound (``bind``) to the pool's KV as *planes*: plane ``j`` is one (layer, K or V, KV head)'s
memory, ``[n_pages, segment_bytes]`` bytes, and a pool page is its row in every plane (``ModelRunner.kv_planes``).
A slot is laid out as the page is: one segment per plane. Stores keep each plane's segments together, slot after
slot, so a *run* (``count`` consecutive slots to or from ``count`` consecutive pool pages) is one contiguous range
per plane on both sides: one system call or one copy per plane moves the whole run, whatever its length. Bytes are
copied as bytes, so a round trip is an exact copy whatever the dtype (bfloat16 too).

* ``MemoryStore``: one preallocated ``uint8`` tensor (pinned host memory where asked: a CUDA engine's tier), copied
  with ``Tensor.copy_`` (host to device directly from pinned memory).
* ``FileStore``: one preallocated file on local disk, plane ``j``'s segment of slot ``s`` at byte
  ``(j * slots + s) * segment_bytes``; a run is one ``os.preadv`` / ``os.pwritev`` per plane, straight between the
  file and the pool's KV memory (no staging buffer, no second copy): real system calls, served by the disk or the OS
  page cache (no ``O_DIRECT``: its alignment rules would need a bounce buffer). The KV must be in host memory. The
  whole file is allocated at construction (``posix_fallocate``), so a disk too small or a folder that cannot be
  written fails there, with the path and the size in the message, never later in the middle of a request.

Both raise ``OSError`` (or ``RuntimeError``) on failure; ``SecondTier`` switches the tier off on any error from a
store after construction, so a request never fails because of its tier.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a store touches tensors: the lab's replay uses the tier without torch
    import torch


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


class MemoryStore(TierStore):
    """The slots in one host tensor; ``pinned``: page-locked, so a CUDA device copies to and from it directly."""

    def __init__(self, slots: int, page_bytes: int, pinned: bool = False) -> None:
        import torch

        super().__init__(slots, page_bytes)
        self.medium = "pinned host memory" if pinned else "memory"
        self._data = torch.empty(slots * page_bytes, dtype=torch.uint8, pin_memory=pinned)
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pool plane, its slots here)

    def _bind(self, planes: Sequence[torch.Tensor]) -> None:
        mine = self._data.view(len(planes), self.slots, self.segment_bytes) if planes else None
        self._planes = [(plane, mine[j]) for j, plane in enumerate(planes)] if mine is not None else []

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        self._check(first_slot, first_page, count)
        for pool, mine in self._planes:
            pool[first_page : first_page + count].copy_(mine[first_slot : first_slot + count])

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        self._check(first_slot, first_page, count)
        for pool, mine in self._planes:
            mine[first_slot : first_slot + count].copy_(pool[first_page : first_page + count])


class FileStore(TierStore):
    """The slots in one file under ``folder`` (created, unlinked on ``close``); see the module docstring."""

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
        self._planes: list[memoryview] = []  # each plane's bytes, flat: slicing one costs no tensor op

    def _bind(self, planes: Sequence[torch.Tensor]) -> None:
        if any(plane.device.type != "cpu" for plane in planes):
            raise ValueError('a file tier reads into host memory: with the KV on a GPU, use offload_to="memory"')
        self._planes = [plane.numpy().data.cast("B") for plane in planes]

    def _descriptor(self) -> int:
        if self._fd is None:
            raise RuntimeError("the second tier's file is closed")
        return self._fd

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        self._check(first_slot, first_page, count)
        fd, segment = self._descriptor(), self.segment_bytes
        start, size = first_page * segment, count * segment
        for j, plane in enumerate(self._planes):
            done = os.preadv(fd, [plane[start : start + size]], (j * self.slots + first_slot) * segment)
            if done != size:
                raise OSError(f"short read from the second tier's file: {done} of {size} bytes")

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        self._check(first_slot, first_page, count)
        fd, segment = self._descriptor(), self.segment_bytes
        start, size = first_page * segment, count * segment
        for j, plane in enumerate(self._planes):
            done = os.pwritev(fd, [plane[start : start + size]], (j * self.slots + first_slot) * segment)
            if done != size:  # a regular file writes all or raises, but a short write must never pass
                raise OSError(f"short write to the second tier's file: {done} of {size} bytes")

    def close(self) -> None:
        super().close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)


def open_store(where: str | os.PathLike[str], slots: int, page_bytes: int, pinned: bool = False) -> TierStore:
    """The store ``InferenceEngine(offload_to=...)`` names: ``"memory"`` (host memory, ``pinned`` for a CUDA
    engine), else a folder on local disk for a ``FileStore``. A ``ValueError`` says what is wrong with it."""
    if where == "memory":
        return MemoryStore(slots, page_bytes, pinned)
    if not isinstance(where, (str, os.PathLike)):
        raise ValueError(f'offload_to must be "memory" or a folder on local disk, got {where!r}')
    return FileStore(where, slots, page_bytes)
