"""Sampling parameters (validated once, at submit) and a sampler vectorized over the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_SEED = 2**63 - 1
# Below this a temperature is greedy, as in vLLM (its _SAMPLING_EPS): dividing float32 logits by a smaller one
# overflows them to infinities (1e-45 is 0 in float32), whose softmax is NaN, and the sampled text was garbage.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings; every request of one ``generate`` call shares them."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0 (or anything below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise ValueError(f"seed must be an integer in [0, 2**63-1] or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One next token per row. Greedy rows take the argmax; the others are masked and sampled in one pass.

    Order of the cuts: temperature, then top-k, then top-p on the renormalized top-k distribution.
    Sampling uses the exponential-race trick (argmax of p / Exp(1) noise): the noise for each row comes from
    that request's own generator, so a seeded request draws the same tokens whatever else is in the batch.

    Everything is computed on the logits' device, with generators of that device (a seed reproduces its tokens on
    one kind of device, not across CPU and CUDA); the returned list is the one time a step waits for the device.
    """
    device = logits.device
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        import torch  # here, not at the top: SamplingParams alone (the trace replay's) must not load torch

        from astrai.device import to_device

        sampled_rows = to_device(torch.tensor(rows), device)
        sub = logits.index_select(0, sampled_rows)
        temperature = to_device(torch.tensor([params[i].temperature for i in rows]), device).unsqueeze(1)
        top_k = to_device(torch.tensor([params[i].top_k or sub.shape[-1] for i in rows]), device).unsqueeze(1)
        top_p = to_device(torch.tensor([params[i].top_p for i in rows]), device).unsqueeze(1)
        sorted_logits, order = (sub / temperature).sort(dim=-1, descending=True)
        rank = torch.arange(sub.shape[-1], device=device).unsqueeze(0)
        # top-k first, then top-p over the distribution renormalized after the cut (as transformers and vLLM do)
        probs = sorted_logits.masked_fill(rank >= top_k, -math.inf).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
        noise = torch.stack(
            [torch.empty(sub.shape[-1], device=device).exponential_(generator=generators[i]) for i in rows]
        )
        picked = (probs / noise).argmax(dim=-1)
        tokens.index_copy_(0, sampled_rows, order.gather(1, picked.unsqueeze(1)).squeeze(1))
    return tokens.tolist()
