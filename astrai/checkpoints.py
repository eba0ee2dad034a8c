"""Loading a checkpoint: safetensors only, never remote code. One place, so every engine loads the same way."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from astrai.model_runner import SUPPORTED_DTYPES, check_supported


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded: missing, unsupported, pickle-only, or asking for remote code."""


def load_checkpoint(name_or_path: str, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (in ``dtype``) and its tokenizer; an architecture the paged hook cannot serve is refused here."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
        check_supported(config)
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path,
            config=config,
            use_safetensors=True,
            trust_remote_code=False,
            dtype=SUPPORTED_DTYPES[dtype],
        )
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load {name_or_path!r}: {exc}") from exc
    return model, tokenizer
