"""Where the second tier's pages live: fixed-size slots of raw bytes, written and read whole.

A store knows nothing of keys, chains or eviction (``SecondTier`` does): it holds ``slots`` slots of ``page_bytes``
bytes each, and copies one page's bytes into a slot or out of it. A page is handed over as a contiguous CPU tensor
of any dtype, read and written as its bytes, so a round trip is an exact copy whatever the dtype (bfloat16 too).

* ``MemoryStore``: one preallocated ``uint8`` tensor (pinned host memory where asked: a CUDA engine's tier), for
  tests and for a tier in host memory.
* ``FileStore``: one preallocated file on local disk, slot ``s`` at byte ``s * page_bytes``, written with
  ``os.pwrite`` and read with ``os.preadv`` straight into the page's buffer: a load is a real system call per page,
  served by the disk or the OS page cache (no ``O_DIRECT``: its alignment rules would need a bounce buffer).
  The whole file is allocated at construction (``posix_fallocate``), so a disk too small or a folder that cannot be
  written fails there, with the path and the size in the message, never later in the middle of a request.

Both raise ``OSError`` (or ``RuntimeError``) on failure; ``SecondTier`` switches the tier off on any error from a
store after construction, so a request never fails because of its tier.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path

import torch


class TierStore(ABC):
    """``slots`` slots of ``page_bytes`` bytes; ``medium`` names where they live (for the stats)."""

    medium: str

    def __init__(self, slots: int, page_bytes: int) -> None:
        if slots < 1 or page_bytes < 1:
            raise ValueError(f"a tier store needs slots >= 1 and page_bytes >= 1, got {slots} and {page_bytes}")
        self.slots = slots
        self.page_bytes = page_bytes

    @abstractmethod
    def write(self, slot: int, page: torch.Tensor) -> None:
        """Copy ``page`` (contiguous, on the CPU, ``page_bytes`` bytes) into ``slot``."""

    @abstractmethod
    def read(self, slot: int, out: torch.Tensor) -> None:
        """Copy ``slot`` into ``out`` (contiguous, on the CPU, ``page_bytes`` bytes)."""

    def close(self) -> None:  # noqa: B027 - a store in memory holds nothing to give back
        """Give back what the store holds outside Python (a file's descriptor, the file itself)."""

    def _bytes(self, page: torch.Tensor) -> torch.Tensor:
        """``page``'s bytes as a flat ``uint8`` tensor over its own memory (no copy); checks its size and place."""
        if page.device.type != "cpu" or not page.is_contiguous():
            raise ValueError("a tier store copies contiguous CPU tensors only")
        flat = page.view(-1).view(torch.uint8)
        if flat.numel() != self.page_bytes:
            raise ValueError(f"a page of this tier is {self.page_bytes} bytes, got {flat.numel()}")
        return flat

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is outside the store's {self.slots} slots")


class MemoryStore(TierStore):
    """The slots in one host tensor; ``pinned``: page-locked, so a CUDA device copies to and from it directly."""

    def __init__(self, slots: int, page_bytes: int, pinned: bool = False) -> None:
        super().__init__(slots, page_bytes)
        self.medium = "pinned host memory" if pinned else "memory"
        self._data = torch.empty((slots, page_bytes), dtype=torch.uint8, pin_memory=pinned)

    def write(self, slot: int, page: torch.Tensor) -> None:
        self._check(slot)
        self._data[slot].copy_(self._bytes(page))

    def read(self, slot: int, out: torch.Tensor) -> None:
        self._check(slot)
        self._bytes(out).copy_(self._data[slot])


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

    def _descriptor(self) -> int:
        if self._fd is None:
            raise RuntimeError("the second tier's file is closed")
        return self._fd

    def write(self, slot: int, page: torch.Tensor) -> None:
        self._check(slot)
        data = self._bytes(page).numpy().data
        done = os.pwrite(self._descriptor(), data, slot * self.page_bytes)
        if done != self.page_bytes:  # a regular file writes all or raises, but a short write must never pass
            raise OSError(f"short write to the second tier's file: {done} of {self.page_bytes} bytes")

    def read(self, slot: int, out: torch.Tensor) -> None:
        self._check(slot)
        buffer = self._bytes(out).numpy().data
        done = os.preadv(self._descriptor(), [buffer], slot * self.page_bytes)
        if done != self.page_bytes:
            raise OSError(f"short read from the second tier's file: {done} of {self.page_bytes} bytes")

    def close(self) -> None:
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
