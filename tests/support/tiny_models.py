"""Tiny random-initialized checkpoints of the supported families and a byte-level BPE tokenizer, made offline.

Shared by the tests, the soak and the fuzz runs: they need real transformers models without a download.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

EOS = "<|endoftext|>"
CORPUS = [
    "Once upon a time there was a little cat. The cat sat on the mat and looked at the sun.",
    "Lily and Tom went to the park. They played with a big red ball all day long.",
    "The dog was happy. It ran to the tree and barked at a bird. 🐶🌳 你好，世界！ Ça va? naïve café",
    "小猫在花园里玩。 The end. 😀 emoji and 中文 text mixed together, with “quotes” — dashes.",
]
FAMILIES = ("llama", "qwen2", "qwen3")


def make_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE that prepends BOS, as the embedded model's tokenizer does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def make_model(family: str, vocab_size: int, seed: int = 0, max_positions: int = 1024) -> PreTrainedModel:
    """A 2-layer GQA model (4 heads, 2 KV heads) with weights spread wide enough that greedy picks are clear."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, use_sliding_window=False))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.2)  # also randomizes Qwen2's q/k/v biases
    return model.eval()


def reference_generate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompt: str, n: int) -> list[int]:
    """transformers' own greedy continuation (token ids, EOS included when it stops there), on the model's device."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def write_checkpoint(path: Path, kind: str) -> Path:
    """Write a tiny checkpoint directory of one kind: "safetensors" (loads), "no_weights", "pickle_only" (a
    pytorch_model.bin, which must be refused) or "remote_code" (asks for trust_remote_code, also refused)."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "remote_code":
        config = {
            "model_type": "my_custom_lm",
            "auto_map": {
                "AutoConfig": "modeling_custom.CustomConfig",
                "AutoModelForCausalLM": "modeling_custom.CustomLM",
            },
        }
        (path / "config.json").write_text(json.dumps(config))
        (path / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
        return path
    tokenizer = make_tokenizer()
    model = make_model("qwen2" if kind == "safetensors" else "llama", len(tokenizer))
    tokenizer.save_pretrained(path)
    if kind == "safetensors":
        model.save_pretrained(path)
    else:
        model.config.save_pretrained(path)
        if kind == "pickle_only":
            torch.save(model.state_dict(), path / "pytorch_model.bin")  # a pickle, as old checkpoints ship
    return path
