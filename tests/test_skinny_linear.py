"""The skinny product kernel computes what nn.Linear computes, and a packed layer hands it exactly its few-row
products."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from astrai import InferenceEngine
from astrai.huge_pages import Arena
from astrai.packed_linear import FusedProduct, PackedLinear, packing_supported
from astrai.paged_kernel import load_paged_kernel
from astrai.skinny_linear import SKINNY_ROWS, SkinnyWeight, load_skinny_kernel
from tests.support.tiny_models import make_model, reference_generate

kernel = load_skinny_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the skinny kernel does not build here (no C compiler)")
DTYPES = [torch.float32, *([torch.bfloat16] if kernel is not None and kernel.supports(torch.bfloat16, 2) else [])]


@pytest.fixture(params=[1, 3])
def threads(request):
    """Its column blocks are split over torch's threads: one, and more than some of the cases below have."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16])
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (160, 96), (16, 34)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_matches_nn_linear(dtype, rows, out_features, in_features, bias, threads):
    """Row counts around its block of 8 rows, column counts not a multiple of its 16-column blocks (nor of its
    items of two blocks), an odd count of k pairs, with and without bias; rows given as a strided view."""
    torch.manual_seed(rows * 1000 + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    x = torch.randn(rows, in_features + 6, dtype=dtype)[:, 3 : 3 + in_features]  # each row's values side by side
    got = kernel.bind(linear.weight, Arena()).multiply(x, linear.bias)
    expected = nn.functional.linear(x.float(), linear.weight.float(), None if not bias else linear.bias.float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
    assert got.shape == (rows, out_features) and got.dtype == dtype


@pytest.mark.skipif(not packing_supported(torch.float32), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_layer_sends_only_few_rows_to_the_kernel(dtype, monkeypatch):
    """Up to SKINNY_ROWS rows (a decode step) the product is the kernel's; more (a prefill) oneDNN's: both agree."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    layer = PackedLinear(FusedProduct([linear], [False], Arena()), 0)
    assert layer.group.skinny is not None
    calls = []
    real = SkinnyWeight.multiply
    monkeypatch.setattr(SkinnyWeight, "multiply", lambda *args: calls.append(args) or real(*args))
    for rows, through_kernel in ((1, True), (SKINNY_ROWS, True), (SKINNY_ROWS + 1, False)):
        calls.clear()
        x = torch.randn(1, rows, 64, dtype=dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x), linear(x), rtol=tolerance, atol=tolerance)
        assert bool(calls) == through_kernel, rows


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """An empty kernel cache and no C compiler; both kernels' loaders asked afresh (each answers once per process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    for loader in (load_skinny_kernel, load_paged_kernel):
        loader.cache_clear()
    yield
    for loader in (load_skinny_kernel, load_paged_kernel):
        loader.cache_clear()


def test_without_a_compiler_every_product_goes_through_onednn(no_compiler, caplog, tokenizer):
    model = make_model("llama", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    with (
        caplog.at_level(logging.WARNING, logger="astrai"),
        InferenceEngine(model, tokenizer, n_pages=64, compile=False) as engine,
    ):
        groups = [m for m in model.modules() if isinstance(m, FusedProduct)]
        assert groups and all(group.skinny is None for group in groups)
        text = engine.generate("Once upon a time", max_tokens=8)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "skinny_linear kernel unavailable" in caplog.text
