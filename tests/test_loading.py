"""Loading checkpoints: safetensors only, no remote code, clear errors for everything else."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from astrai import InferenceEngine, ModelLoadError
from astrai.testing import make_model, make_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint saved as safetensors, with its tokenizer."""
    path = tmp_path_factory.mktemp("qwen2")
    tokenizer = make_tokenizer()
    make_model("qwen2", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer


def test_a_safetensors_checkpoint_loads_and_serves(checkpoint):
    path, _ = checkpoint
    with InferenceEngine.from_pretrained(str(path), page_size=4, n_pages=64) as engine:
        assert isinstance(engine.generate("Once upon a time", max_tokens=4), str)


def test_an_unknown_model_id_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        InferenceEngine.from_pretrained("no-such-org/no-such-model")


def test_a_directory_without_weights_is_refused(tmp_path, checkpoint):
    _, tokenizer = checkpoint
    make_model("llama", len(tokenizer)).config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="safetensors"):
        InferenceEngine.from_pretrained(str(tmp_path))


def test_a_pickle_only_checkpoint_is_refused(tmp_path, checkpoint):
    _, tokenizer = checkpoint
    model = make_model("llama", len(tokenizer))
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a pickle file, as old checkpoints ship
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "pytorch_model.bin").exists() and not (tmp_path / "model.safetensors").exists()
    with pytest.raises(ModelLoadError, match="safetensors"):
        InferenceEngine.from_pretrained(str(tmp_path))


def test_remote_code_is_refused(tmp_path):
    config = {
        "model_type": "my_custom_lm",
        "auto_map": {"AutoConfig": "modeling_custom.CustomConfig", "AutoModelForCausalLM": "modeling_custom.CustomLM"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        InferenceEngine.from_pretrained(str(tmp_path))


def test_sliding_window_attention_is_refused_at_load(checkpoint):
    _, tokenizer = checkpoint
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    with pytest.raises(ValueError, match="sliding-window"):
        InferenceEngine(MistralForCausalLM(config), tokenizer)


def test_unknown_dtype_is_refused(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="dtype"):
        InferenceEngine.from_pretrained(str(path), dtype="float16")
