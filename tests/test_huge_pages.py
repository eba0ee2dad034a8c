"""The tensors a decode step streams (laid-out weights, KV pools) lie on huge pages where Linux offers them."""

from __future__ import annotations

import gc
import itertools
import mmap
from pathlib import Path

import pytest
import torch

from astrai import huge_pages
from astrai.model_runner import ModelRunner, Preparation
from astrai.packed_linear import FusedProduct
from astrai.skinny_linear import load_skinny_kernel
from tests.support.tiny_models import make_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
offered = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or not THP.exists() or "[never]" in THP.read_text(),
    reason="this system offers no transparent huge pages",
)


def huge_kib(tensor: torch.Tensor) -> int:
    """The kB of huge pages backing the mapping that holds ``tensor``'s first byte (``/proc/self/smaps``)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_an_arena_hands_out_aligned_separate_tensors_that_outlive_it():
    arena = huge_pages.Arena()
    tensors = [arena.zeros((n, 3), torch.float32) for n in (5, 1, huge_pages.CHUNK // 12 + 1, 7)]  # one past a chunk
    assert all(t.data_ptr() % huge_pages.ALIGNMENT == 0 and t.is_contiguous() for t in tensors)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no two overlap
    del arena
    gc.collect()
    for value, tensor in enumerate(tensors):  # their mappings live as long as they do
        tensor.fill_(value)
    assert [t.unique().tolist() for t in tensors] == [[0.0], [1.0], [2.0], [3.0]]


@offered
def test_arena_memory_lies_on_huge_pages_unless_switched_off(monkeypatch):
    tensor = huge_pages.Arena().zeros((4 * huge_pages.HUGE_PAGE,), torch.uint8)
    assert huge_kib(tensor) >= 2048
    if "[madvise]" in THP.read_text():  # with "always", the system puts plain memory on huge pages too
        monkeypatch.setattr(huge_pages, "ENABLED", False)
        assert huge_kib(huge_pages.Arena().zeros((4 * huge_pages.HUGE_PAGE,), torch.uint8)) == 0


@offered
def test_a_runners_kv_pool_and_laid_out_weights_lie_on_huge_pages(tokenizer):
    model = make_model("llama", len(tokenizer))
    runner = ModelRunner(model, 64, 16, Preparation.resolve(torch.float32, torch.device("cpu"), compile=False))
    assert huge_kib(runner.kv_cache[0][0]) >= 2048
    if load_skinny_kernel() is not None:
        layer = next(m for m in runner.model.modules() if isinstance(m, FusedProduct))
        assert huge_kib(layer.skinny.laid_out) >= 2048
    runner.release()
