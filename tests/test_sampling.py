"""The sampler's cuts: temperature, then top-k, then top-p over the renormalized top-k distribution, on every
device (logits and generators where the engine keeps them)."""

from __future__ import annotations

import math
from collections import Counter

import torch

from astrai.sampling import SamplingParams, sample

PROBS = [0.30, 0.25, 0.20, 0.15, 0.10]


def draws(params: SamplingParams, device: str, n: int = 400) -> Counter:
    logits = torch.tensor([[math.log(p) for p in PROBS]], device=device)
    seen: Counter = Counter()
    for seed in range(n):
        seen[sample(logits, [params], [torch.Generator(device=device).manual_seed(seed)])[0]] += 1
    return seen


def test_top_p_applies_to_the_distribution_left_by_top_k(device):
    """After top-k=2 the two survivors weigh .545 and .455: top-p=0.5 keeps only the first (as transformers does)."""
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), device)) == {0}


def test_top_k_alone_and_top_p_alone(device):
    assert set(draws(SamplingParams(temperature=1.0, top_k=2), device)) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5), device)) == {0, 1}  # .30 < .5, then .55 >= .5
    assert set(draws(SamplingParams(temperature=1.0), device)) == set(range(len(PROBS)))


def test_greedy_takes_the_argmax(device):
    assert set(draws(SamplingParams(temperature=0.0), device, n=5)) == {0}


def test_greedy_and_sampled_rows_in_one_batch(device):
    """Sampled rows are picked out and written back by index: a greedy row beside them keeps its argmax."""
    logits = torch.tensor([[math.log(p) for p in PROBS], [math.log(p) for p in reversed(PROBS)]] * 2, device=device)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(), SamplingParams()]
    generators = [None, torch.Generator(device=device).manual_seed(0), None, None]
    assert sample(logits, params, generators) == [0, len(PROBS) - 1, 0, len(PROBS) - 1]


def test_a_temperature_too_small_for_float32_is_greedy(device):
    """1e-45 is 0 in float32: the logits divided by it were infinities, their softmax NaN, the text garbage. Below
    vLLM's 1e-5 a temperature is greedy; just above it, sampling is finite and picks the argmax of these logits."""
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=9e-6).greedy
    assert set(draws(SamplingParams(temperature=1e-45), device, n=5)) == {0}
    assert set(draws(SamplingParams(temperature=1e-5), device, n=20)) == {0}
