"""Checks on the committed default model, so a broken or bloated copy fails fast.

The model is produced by scripts/train_tiny_model.py; these tests only load it, never retrain.
"""

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest

# Set before transformers is imported, which reads it: the model must load offline.
os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "models" / "tinystories-llama"
MAX_DIR_BYTES = 20 * 1000 * 1000
PROMPT = "Once upon a time"
COMMON_WORDS = {"the", "a", "and", "was", "to", "he", "she", "they", "it", "her", "his"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def greedy(model, tokenizer, prompt: str, n_new: int = 40) -> str:
    """Greedy continuation of prompt, decoded without special tokens."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=n_new)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_weights_are_safetensors_only():
    assert (MODEL_DIR / "model.safetensors").is_file()
    pickles = [p.name for p in MODEL_DIR.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".pkl"}]
    assert pickles == []


def test_dir_size_within_budget():
    total = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert total <= MAX_DIR_BYTES


def test_config_uses_gqa():
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is True


def test_generation_config_has_special_ids(tokenizer):
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    assert gen["bos_token_id"] == tokenizer.bos_token_id
    assert gen["pad_token_id"] is not None


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, there was a little girl named Lily.\nShe liked to play.",
        "Tom said, “Look at the big tree!” Mom’s cat ran away.",
        "猫が好き 🐱👍🏽 héllo — 你好",
    ],
)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_prepends_bos(tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1


def test_greedy_generation_is_deterministic_and_legible(model, tokenizer):
    first = greedy(model, tokenizer, PROMPT)
    second = greedy(model, tokenizer, PROMPT)
    assert first == second
    words = re.findall(r"[a-z]+", first.lower())
    assert len(words) >= 20, first
    assert len(COMMON_WORDS.intersection(words)) >= 4, first
    assert max(Counter(words).values()) <= len(words) // 4, first  # no "the the the" loops


def test_card_parameter_count_matches_model(model):
    card = (MODEL_DIR / "README.md").read_text()
    match = re.search(r"^Parameters: ([\d,]+)$", card, flags=re.MULTILINE)
    assert match, "model card lacks a 'Parameters: N' line"
    assert int(match.group(1).replace(",", "")) == sum(p.numel() for p in model.parameters())
