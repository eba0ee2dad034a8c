"""Loading checkpoints: safetensors only, no remote code, clear errors for everything else."""

from __future__ import annotations

import pytest
from transformers import MistralConfig, MistralForCausalLM

from astrai import InferenceEngine, ModelLoadError
from tests.support.tiny_models import make_tokenizer, write_checkpoint
from tools.bad_inputs import BAD_CHECKPOINTS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), "safetensors")


def test_a_safetensors_checkpoint_loads_and_serves(checkpoint):
    with InferenceEngine.from_pretrained(str(checkpoint), page_size=4, n_pages=64, compile=False) as engine:
        assert isinstance(engine.generate("Once upon a time", max_tokens=4), str)


def test_an_unknown_model_id_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="no-such-org/no-such-model"):
        InferenceEngine.from_pretrained("no-such-org/no-such-model")


@pytest.mark.parametrize(("kind", "message"), BAD_CHECKPOINTS.items())
def test_bad_checkpoints_are_refused(tmp_path, kind, message):
    path = write_checkpoint(tmp_path / kind, kind)
    with pytest.raises(ModelLoadError, match=message):
        InferenceEngine.from_pretrained(str(path))
    if kind == "pickle_only":
        assert (path / "pytorch_model.bin").exists() and not (path / "model.safetensors").exists()


def test_sliding_window_attention_is_refused_at_load():
    tokenizer = make_tokenizer()
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
    with pytest.raises(ValueError, match="dtype"):
        InferenceEngine.from_pretrained(str(checkpoint), dtype="float16")
