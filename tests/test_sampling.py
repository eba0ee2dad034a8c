"""The sampler's cuts: temperature, then top-k, then top-p over the renormalized top-k distribution."""

from __future__ import annotations

import math
from collections import Counter

import torch

from astrai.sampling import SamplingParams, sample

PROBS = [0.30, 0.25, 0.20, 0.15, 0.10]


def draws(params: SamplingParams, n: int = 400) -> Counter:
    logits = torch.tensor([[math.log(p) for p in PROBS]])
    seen: Counter = Counter()
    for seed in range(n):
        seen[sample(logits, [params], [torch.Generator().manual_seed(seed)])[0]] += 1
    return seen


def test_top_p_applies_to_the_distribution_left_by_top_k():
    """After top-k=2 the two survivors weigh .545 and .455: top-p=0.5 keeps only the first (as transformers does)."""
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.5))) == {0}


def test_top_k_alone_and_top_p_alone():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) == {0, 1}  # .30 < .5, then .55 >= .5
    assert set(draws(SamplingParams(temperature=1.0))) == set(range(len(PROBS)))


def test_greedy_takes_the_argmax():
    assert set(draws(SamplingParams(temperature=0.0), n=5)) == {0}
