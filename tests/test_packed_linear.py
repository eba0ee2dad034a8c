"""Packed and fused linear layers compute what nn.Linear computes, and the model comes back exactly as it was."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from astrai import InferenceEngine
from astrai.huge_pages import Arena
from astrai.packed_linear import FusedProduct, PackedLinear, pack_linears, packing_supported, unpack_linears
from tests.support.tiny_models import make_model, reference_generate

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not packing_supported(torch.float32), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    expected = linear(x)
    packed = PackedLinear(FusedProduct([linear], [False], Arena()), 0)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_packed_linear_matches():
    if not packing_supported(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bfloat16 support")
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    packed = PackedLinear(FusedProduct([linear], [False], Arena()), 0)
    torch.testing.assert_close(packed(x), linear(x), rtol=2e-2, atol=2e-2)


def test_a_compiled_packed_product_reads_the_weight_its_handle_names():
    """Under torch.compile a packed product is the ``astrai::packed_linear`` op, its weight named by a handle that
    is an input of the graph: one graph serves two layers of the same shape, each with its own weights (a handle
    baked into the graph as a constant would give the first layer's product for both)."""
    torch.manual_seed(0)
    first, second = nn.Linear(64, 48), nn.Linear(64, 48)
    x = torch.randn(1, 5, 64)
    expected = [first(x), second(x)]
    compiled = torch.compile(lambda layer, t: layer(t), fullgraph=True, dynamic=False)
    torch._dynamo.utils.counters.clear()
    for linear, want in zip((first, second), expected, strict=True):
        packed = PackedLinear(FusedProduct([linear], [False], Arena()), 0)
        torch.testing.assert_close(compiled(packed, x), want, rtol=1e-5, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_product_op_agrees_with_its_fake(bias):
    """The compiled graph allocates and checks each op's output from its fake (shape) function: opcheck compares the
    two, and the op's registration (schema, fake, dispatch) with what torch expects of an opaque op."""
    torch.manual_seed(1)
    group = FusedProduct([nn.Linear(64, 48, bias=bias)], [False], Arena())
    x = torch.randn(1, 5, 64)
    torch.library.opcheck(torch.ops.astrai.packed_linear.default, (x, group.handle, group.bias, 48))


class Attention(nn.Module):
    """The projections of a GQA attention block, named as transformers names them."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(64, 64, bias=bias)
        self.k_proj = nn.Linear(64, 32, bias=bias)
        self.v_proj = nn.Linear(64, 32, bias=bias)
        self.o_proj = nn.Linear(64, 64, bias=False)


@pytest.mark.parametrize("bias", [True, False])
def test_sibling_projections_share_one_product_of_each_input(bias, monkeypatch):
    """q, k and v of one input come from one product; a new input (or a member called twice) gets a new one."""
    torch.manual_seed(0)
    block = Attention(bias)
    x, y = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    expected = {name: (getattr(block, name)(x), getattr(block, name)(y)) for name in ("q_proj", "k_proj", "v_proj")}
    pack_linears(block)
    assert block.q_proj.group is block.k_proj.group is block.v_proj.group
    assert block.o_proj.group is not block.q_proj.group
    products = []
    compute = FusedProduct.product

    def counted(self: FusedProduct, t: torch.Tensor) -> torch.Tensor:
        products.append(t)
        return compute(self, t)

    monkeypatch.setattr(FusedProduct, "product", counted)
    for name in ("k_proj", "q_proj", "v_proj"):  # any member may come first
        torch.testing.assert_close(getattr(block, name)(x), expected[name][0], rtol=1e-5, atol=1e-5)
    assert products == [x]
    torch.testing.assert_close(block.q_proj(y), expected["q_proj"][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.q_proj(y), expected["q_proj"][1], rtol=1e-5, atol=1e-5)  # taken twice
    torch.testing.assert_close(block.v_proj(x), expected["v_proj"][0], rtol=1e-5, atol=1e-5)  # back to x
    assert len(products) == 4


def test_pack_and_unpack_give_the_model_back_exactly(tokenizer):
    model = make_model("llama", len(tokenizer))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {name: p.clone() for name, p in model.named_parameters()}
    linears = {name for name, m in model.named_modules() if type(m) is nn.Linear}

    assert pack_linears(model) == len(linears)
    assert not any(type(m) is nn.Linear for m in model.modules())
    # untied weights are released while packed; the tied output head still serves the embedding
    assert model.model.layers[0].mlp.up_proj.group.originals[1][0].weight.numel() == 0
    assert torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])

    unpack_linears(model)
    assert {name for name, m in model.named_modules() if type(m) is nn.Linear} == linears
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_engine_hands_its_model_back_unpacked(tokenizer):
    model = make_model("qwen2", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False) as engine:
        assert engine.runner.packed_linears > 0
        engine.generate("Once upon a time", max_tokens=8)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert reference_generate(model, tokenizer, "Once upon a time", 8) == expected


def test_a_failure_while_packing_falls_back_to_plain_weights(tokenizer, monkeypatch, caplog):
    """Packing is an optimization: if oneDNN refuses a weight half-way, the engine serves with plain layers."""
    model = make_model("llama", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    made = []

    class FailingOnThird(FusedProduct):
        def __init__(self, linears: list[nn.Linear], release: list[bool], arena: Arena):
            if len(made) == 2:
                raise RuntimeError("simulated oneDNN failure")
            super().__init__(linears, release, arena)
            made.append(self)

    monkeypatch.setattr("astrai.packed_linear.FusedProduct", FailingOnThird)
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=False) as engine:
        assert len(made) == 2 and engine.runner.packed_linears == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        text = engine.generate("Once upon a time", max_tokens=8)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "weight packing failed" in caplog.text
    assert reference_generate(model, tokenizer, "Once upon a time", 8) == expected


def test_every_linear_layer_is_packed_in_either_dtype():
    """Small float32 weights too (measured faster packed on the AMD EPYC, docs/benchmarks.md), as bfloat16 ones."""
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(40, 30))
    assert pack_linears(model) == 2
    assert all(isinstance(layer, PackedLinear) for layer in model)
    unpack_linears(model)
    if packing_supported(torch.bfloat16):
        assert pack_linears(model.to(torch.bfloat16)) == 2


BOUNDED_CACHES = """
import ctypes, torch
from torch import nn
from astrai.huge_pages import Arena
from astrai.packed_linear import FusedProduct, PackedLinear
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
packed = PackedLinear(FusedProduct([nn.Linear(256, 768, bias=False)], [False], Arena()), 0)
with torch.no_grad():
    for rows in range(17, 17 + 300):  # both caches full
        packed(torch.randn(rows, 256))
    before = libc.mallinfo2().uordblks
    for rows in range(400, 800):
        packed(torch.randn(rows, 256))
print((libc.mallinfo2().uordblks - before) / 2**20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="reads glibc's mallinfo2")
def test_onednns_caches_of_row_counts_stay_bounded():
    """Each new row count leaves a oneDNN primitive (about 0.36 MiB for this weight) in two caches of 1,024 entries
    by default: a server that meets every row count grew by hundreds of MiB. Bounded, 400 new row counts after the
    caches are full take nothing more (unbounded: about 140 MiB). In a process of its own: the bound is read once."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run(
        [sys.executable, "-c", BOUNDED_CACHES], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grew_mib = float(done.stdout.split()[-1])
    assert grew_mib < 16, f"the native heap grew {grew_mib:.0f} MiB over 400 new row counts"
