"""Bad input, one catalogue: the tests check every case, and ``python -m tools.bad_inputs`` prints the table of
errors a user sees (docs/reliability.md). After each case the engine must still serve."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from astrai import InferenceEngine, ModelLoadError
from tests.support.tiny_models import make_model, make_tokenizer, write_checkpoint

PROMPT = "Once upon a time there was a little cat."
MAX_SEQ_LEN = 200  # the engine the catalogue runs against


@dataclass(frozen=True)
class BadCall:
    case: str
    prompts: object
    error: type[Exception]
    match: str
    kwargs: dict = field(default_factory=dict)


BAD_CALLS = [
    BadCall("empty prompt", "", ValueError, "empty"),
    BadCall("whitespace-only prompt", "   \n", ValueError, "empty"),
    BadCall("empty list", [], ValueError, "empty list"),
    BadCall("a list with a non-string", ["ok", 3], TypeError, "prompt 1 must be a str"),
    BadCall("a non-string prompt", 42, TypeError, "must be a str or a list"),
    BadCall("lone UTF-16 surrogate", "bad \udc80 surrogate", ValueError, "not valid UTF-8"),
    BadCall("max_tokens = 0", PROMPT, ValueError, "max_tokens", {"max_tokens": 0}),
    BadCall("max_tokens negative", PROMPT, ValueError, "max_tokens", {"max_tokens": -5}),
    BadCall("max_tokens huge", PROMPT, ValueError, "max_seq_len", {"max_tokens": 10**9}),
    BadCall("prompt longer than max_seq_len", PROMPT * 40, ValueError, "max_seq_len", {"max_tokens": 8}),
    BadCall("temperature NaN", PROMPT, ValueError, "temperature", {"temperature": math.nan}),
    BadCall("temperature negative", PROMPT, ValueError, "temperature", {"temperature": -1.0}),
    BadCall("top_p = 0", PROMPT, ValueError, "top_p", {"top_p": 0.0}),
    BadCall("top_p above 1", PROMPT, ValueError, "top_p", {"top_p": 1.5}),
    BadCall("top_p NaN", PROMPT, ValueError, "top_p", {"top_p": math.nan}),
    BadCall("top_k negative", PROMPT, ValueError, "top_k", {"top_k": -1}),
    BadCall("seed negative", PROMPT, ValueError, "seed", {"seed": -1}),
    BadCall("seed above 2**63-1", PROMPT, ValueError, "seed", {"seed": 2**64}),
    BadCall("cache_salt not a string", PROMPT, TypeError, "cache_salt", {"cache_salt": 5}),
]
BAD_CHECKPOINTS = {  # kind -> what the error must mention
    "no_weights": "safetensors",
    "pickle_only": "safetensors",
    "remote_code": "trust_remote_code",
}


def catalogue_engine() -> InferenceEngine:
    tokenizer = make_tokenizer()
    return InferenceEngine(
        make_model("llama", len(tokenizer)), tokenizer, page_size=4, n_pages=64, max_seq_len=MAX_SEQ_LEN, compile=False
    )


def _outcome(call) -> str:
    try:
        call()
    except Exception as exc:
        return f"`{type(exc).__name__}`: {' '.join(str(exc).split())[:160]}"
    return "(no error)"


def report() -> str:
    rows = []
    with catalogue_engine() as engine:
        for bad in BAD_CALLS:
            seen = _outcome(lambda b=bad: engine.generate(b.prompts, **b.kwargs))
            still_serves = bool(engine.generate(PROMPT, max_tokens=2))
            rows.append((bad.case, seen, still_serves))
        tokenizer, model = engine.tokenizer, engine.runner.model
        rows.append(
            (
                "a model already serving another engine, in another dtype",
                _outcome(
                    lambda: InferenceEngine(model, tokenizer, page_size=4, n_pages=8, dtype="bfloat16", compile=False)
                ),
                bool(engine.generate(PROMPT, max_tokens=2)),
            )
        )
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=4, compile=False) as tiny:
        rows.append(
            (
                "prompt larger than the whole pool (16 slots)",
                _outcome(lambda: tiny.generate(PROMPT, max_tokens=8)),
                bool(tiny.generate("Hi", max_tokens=2)),
            )
        )
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(
            ("unknown model id", _outcome(lambda: InferenceEngine.from_pretrained("no-such-org/no-model")), None)
        )
        for kind in BAD_CHECKPOINTS:
            path = write_checkpoint(Path(tmp) / kind, kind)
            rows.append(
                (
                    f"checkpoint: {kind.replace('_', ' ')}",
                    _outcome(lambda p=path: InferenceEngine.from_pretrained(str(p))),
                    None,
                )
            )
    lines = ["| # | bad input | error the user sees | engine serves afterwards |", "|---|---|---|---|"]
    for i, (case, seen, serves) in enumerate(rows, 1):
        after = "n/a (nothing was loaded)" if serves is None else ("yes" if serves else "NO")
        lines.append(f"| {i} | {case} | {seen.replace('|', '/')} | {after} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())


__all__ = ["BAD_CALLS", "BAD_CHECKPOINTS", "BadCall", "ModelLoadError", "catalogue_engine", "report"]
