"""The C kernels attend as PyTorch does, from the pages in place; without a compiler the engine still runs."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from astrai import InferenceEngine, native
from astrai.paged_kernel import load_paged_kernel
from tests.support.tiny_models import reference_generate


def reference(query, k_cache, v_cache, slots, lengths, scale):
    """Each request alone: its context gathered, its query heads attending their KV group's heads."""
    groups = query.shape[1] // k_cache.shape[0]
    out = []
    for q, row, length in zip(query, slots, lengths.tolist(), strict=True):
        context = row[:length]
        k = k_cache[:, context].repeat_interleave(groups, dim=0).float()  # [H, L, D]
        v = v_cache[:, context].repeat_interleave(groups, dim=0).float()
        out.append(F.scaled_dot_product_attention(q.float()[:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out).to(query.dtype)


def random_caches(kv_heads, head_dim, pages, page_size, dtype):
    """K and V caches [KVH, pages * page_size, D] of random rows."""
    return tuple(torch.randn(kv_heads, pages * page_size, head_dim, dtype=dtype) for _ in "kv")


@pytest.fixture
def kernel():
    built = load_paged_kernel()
    assert built is not None, "gcc is on this machine: the kernels must build"
    return built


@pytest.fixture(params=[1, 3])
def threads(request):
    """The kernel splits its (request, KV head) pairs over torch's intra-op threads: one, and more than the pairs
    of some cases below."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "groups", "head_dim"), [(3, 3, 64), (2, 1, 32), (1, 8, 128), (2, 4, 32), (2, 3, 48)]
)
@pytest.mark.parametrize("writes", [False, True], ids=["attends", "writes-then-attends"])
def test_kernel_matches_pytorch_attention(kernel, dtype, kv_heads, groups, head_dim, writes, threads):
    torch.manual_seed(head_dim)
    page_size, pages = 16, 60
    k_cache, v_cache = random_caches(kv_heads, head_dim, pages, page_size, dtype)
    lengths = torch.tensor([1, 37, 150, 16, 90])
    order = torch.randperm(pages)  # requests' pages scattered over the pool, as the allocator leaves them
    tables = torch.stack([order[i * 10 : (i + 1) * 10] for i in range(len(lengths))])
    slots = torch.zeros(len(lengths), int(lengths.max()), dtype=torch.long)  # the reference's gather
    for i, length in enumerate(lengths.tolist()):
        positions = torch.arange(length)
        slots[i, :length] = tables[i][positions // page_size] * page_size + positions % page_size
    # the query and the new rows as the hook gets them, [1, heads, B, D]: transposed views of [1, B, heads, D]
    batch = len(lengths)
    query = torch.randn(1, batch, kv_heads * groups, head_dim, dtype=dtype).transpose(1, 2)
    new_kv = None
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    if writes:  # each request's newest token: its K and V go into the slot of position length - 1
        new_kv = tuple(torch.randn(1, batch, kv_heads, head_dim, dtype=dtype).transpose(1, 2) for _ in "kv")
        last = slots[torch.arange(batch), lengths - 1]
        k_expected[:, last], v_expected[:, last] = new_kv[0][0], new_kv[1][0]
    scale = head_dim**-0.5
    got = kernel.attend(query, k_cache, v_cache, tables, lengths, page_size, scale, new_kv)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    expected = reference(query[0].transpose(0, 1), k_expected, v_expected, slots, lengths, scale)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "groups", "head_dim"), [(3, 3, 64), (2, 1, 32), (1, 8, 128), (2, 4, 16)])
def test_prefill_kernel_matches_causal_pytorch_attention(kernel, dtype, kv_heads, groups, head_dim, threads):
    """Chunks of every shape the engine makes: a prompt from scratch, a suffix after a cached prefix (a hit), a
    later chunk of a long prompt, one shorter than a query block and one longer than several, ending mid-page."""
    torch.manual_seed(head_dim)
    page_size, pages = 16, 100
    k_cache, v_cache = random_caches(kv_heads, head_dim, pages, page_size, dtype)
    chunks = [(2, 0), (37, 0), (20, 256), (5, 3), (70, 33)]  # (tokens computed now, tokens computed before)
    order = torch.randperm(pages)
    tables = torch.stack([order[i * 20 : (i + 1) * 20] for i in range(len(chunks))])
    rows = sum(count for count, _ in chunks)
    query = torch.randn(1, rows, kv_heads * groups, head_dim, dtype=dtype).transpose(1, 2)  # [1, H, T, D] view
    scale = head_dim**-0.5
    spans, expected, row = [], torch.empty(rows, kv_heads * groups, head_dim, dtype=dtype), 0
    for table, (count, done) in zip(tables, chunks, strict=True):
        positions = torch.arange(done + count)
        context = table[positions // page_size] * page_size + positions % page_size
        k = k_cache[:, context].repeat_interleave(groups, dim=0).float()  # [H, L, D]
        v = v_cache[:, context].repeat_interleave(groups, dim=0).float()
        causal = positions <= positions[done:, None]  # query done + r sees positions 0 .. done + r
        attended = F.scaled_dot_product_attention(query[0, :, row : row + count].float(), k, v, causal, scale=scale)
        expected[row : row + count] = attended.transpose(0, 1).to(dtype)
        spans.append([row, count, done])
        row += count
    got = torch.full_like(expected, float("nan"))
    kernel.prefill(query, k_cache, v_cache, tables, torch.tensor(spans), page_size, scale, got)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_kernel_runs_on_torchs_own_openmp_runtime():
    """The kernel's parallel loop uses the OpenMP runtime torch already loaded (so the same worker pool), not a
    second one, whose workers would fight torch's for the cores."""
    assert load_paged_kernel() is not None
    symbols = subprocess.run(
        ["nm", "-D", "--undefined-only", str(native.build("paged_attention"))], capture_output=True, text=True
    )
    assert "GOMP_parallel" in symbols.stdout, "the kernel was built without OpenMP"
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


@pytest.fixture
def fresh_kernel_cache(monkeypatch, tmp_path):
    """An empty kernel cache, and ``load_paged_kernel`` asked afresh (it answers once per process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    load_paged_kernel.cache_clear()
    yield tmp_path
    load_paged_kernel.cache_clear()


def test_the_kernel_is_built_once_per_machine(fresh_kernel_cache, monkeypatch):
    assert load_paged_kernel() is not None
    built = list(fresh_kernel_cache.glob("astrai/kernels/paged_attention-*.so"))
    assert len(built) == 1
    load_paged_kernel.cache_clear()
    monkeypatch.setenv("CC", "no-such-compiler")  # a second load must not compile
    assert load_paged_kernel() is not None


def test_a_kernel_is_rebuilt_when_a_header_it_includes_changes(fresh_kernel_cache, monkeypatch):
    """The shared header (bfloat16.h) is compiled into both libraries: its text is part of each one's cache key."""
    before = native.build("paged_attention")
    edited = fresh_kernel_cache / "bfloat16.h"
    edited.write_bytes(native.HEADERS[0].read_bytes() + b"\n")
    monkeypatch.setattr(native, "HEADERS", [edited])
    assert native.build("paged_attention") != before


def test_without_a_compiler_the_engine_attends_through_pytorch(fresh_kernel_cache, monkeypatch, caplog, tokenizer):
    from tests.support.tiny_models import make_model

    monkeypatch.setenv("CC", "no-such-compiler")
    model = make_model("llama", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    with (
        caplog.at_level(logging.WARNING, logger="astrai"),
        InferenceEngine(model, tokenizer, n_pages=64, compile=False) as engine,
    ):
        assert engine.runner.paged_kernel is None
        text = engine.generate("Once upon a time", max_tokens=8)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "paged_attention kernel unavailable" in caplog.text


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(
    "items",
    [[([0], 3, 1), ([1], 2, 1), ([2], 1, 1)], [([0, 1], 0, 6), ([2], 3, 1)], [([0, 1], 2, 4), ([2], 3, 1)]],
)
def test_the_attention_op_agrees_with_its_fake(groups, items):
    """The compiled graph checks each op's output against its fake's size and strides: through PyTorch attention
    (the path on CUDA, or with attention_kernel=False), decodes of heads without query groups gave a view with the
    heads' stride, which the graph refused on an H200 (opcheck finds the same on the CPU)."""
    from astrai.attention import build_paged_batch, serving

    kv_heads, head_dim, rows = 2, 8, sum(count for _, _, count in items)
    kv_cache = [(torch.randn(kv_heads, 16, head_dim), torch.randn(kv_heads, 16, head_dim))]
    batch = build_paged_batch(kv_cache, items, page_size=4)
    query = torch.randn(1, kv_heads * groups, rows, head_dim)
    key, value = torch.randn(1, kv_heads, rows, head_dim), torch.randn(1, kv_heads, rows, head_dim)
    with serving(batch):
        torch.library.opcheck(torch.ops.astrai.paged_attention.default, (query, key, value, 0, head_dim**-0.5))
