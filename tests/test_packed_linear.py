"""Packed linear layers compute what nn.Linear computes, and the model comes back exactly as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from astrai import InferenceEngine
from astrai.packed_linear import PackedLinear, pack_linears, packing_supported, unpack_linears
from tests.support.tiny_models import make_model, reference_generate

pytestmark = [
    pytest.mark.skipif(not packing_supported(torch.float32), reason="this torch build has no oneDNN"),
    pytest.mark.usefixtures("pack_every_layer"),
]


@pytest.mark.parametrize("rows", [1, 8, 37])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(1, rows, 96)
    expected = linear(x)
    packed = PackedLinear(linear, release=False)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_packed_linear_matches():
    if not packing_supported(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bfloat16 support")
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(linear, release=False)(x), linear(x), rtol=2e-2, atol=2e-2)


def test_pack_and_unpack_give_the_model_back_exactly(tokenizer):
    model = make_model("llama", len(tokenizer))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    before = {name: p.clone() for name, p in model.named_parameters()}
    linears = {name for name, m in model.named_modules() if type(m) is nn.Linear}

    assert pack_linears(model) == len(linears)
    assert not any(type(m) is nn.Linear for m in model.modules())
    # untied weights are released while packed; the tied output head still serves the embedding
    assert model.model.layers[0].mlp.up_proj._original[0].weight.numel() == 0
    assert torch.equal(model.model.embed_tokens.weight, before["model.embed_tokens.weight"])

    unpack_linears(model)
    assert {name for name, m in model.named_modules() if type(m) is nn.Linear} == linears
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_engine_hands_its_model_back_unpacked(tokenizer):
    model = make_model("qwen2", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64) as engine:
        assert engine.runner.packed_linears > 0
        engine.generate("Once upon a time", max_tokens=8)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert reference_generate(model, tokenizer, "Once upon a time", 8) == expected


def test_a_failure_while_packing_falls_back_to_plain_weights(tokenizer, monkeypatch, caplog):
    """Packing is an optimization: if oneDNN refuses a weight half-way, the engine serves with plain layers."""
    model = make_model("llama", len(tokenizer))
    expected = reference_generate(model, tokenizer, "Once upon a time", 8)
    made = []

    class FailingOnThird(PackedLinear):
        def __init__(self, linear: nn.Linear, release: bool):
            if len(made) == 2:
                raise RuntimeError("simulated oneDNN failure")
            super().__init__(linear, release)
            made.append(self)

    monkeypatch.setattr("astrai.packed_linear.PackedLinear", FailingOnThird)
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64) as engine:
        assert len(made) == 2 and engine.runner.packed_linears == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        text = engine.generate("Once upon a time", max_tokens=8)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)
    assert "weight packing failed" in caplog.text
    assert reference_generate(model, tokenizer, "Once upon a time", 8) == expected


def test_only_float32_weights_large_enough_to_pay_are_packed(monkeypatch):
    """In float32 a small weight runs faster through torch's own GEMM than through a oneDNN call; bfloat16 packs all."""
    monkeypatch.setattr("astrai.packed_linear.MIN_FLOAT32_ELEMENTS", 1000)
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(40, 30))  # 100 and 1,200 weights
    assert pack_linears(model) == 1
    assert type(model[0]) is nn.Linear and isinstance(model[1], PackedLinear)
    unpack_linears(model)
    if packing_supported(torch.bfloat16):
        assert pack_linears(model.to(torch.bfloat16)) == 2
