"""Batch streaming: interleaved (index, delta) pairs, joined deltas, and multi-byte text."""

from __future__ import annotations

import copy

import pytest

from astrai import InferenceEngine
from astrai.detokenizer import REPLACEMENT, IncrementalDetokenizer
from tests.support.tiny_models import make_model

PROMPTS = ["Once upon a time there was a little cat.", "The dog", "小猫在花园里玩。 😀", "Lily and Tom"]


@pytest.fixture(scope="module")
def engine(tokenizer):
    with InferenceEngine(
        make_model("qwen3", len(tokenizer), seed=3), tokenizer, page_size=4, n_pages=128, compile=False
    ) as eng:
        yield eng


def test_stream_interleaves_indices_and_joins_to_the_batch_result(engine):
    expected = engine.generate(PROMPTS, max_tokens=24)
    pairs = list(engine.generate(PROMPTS, max_tokens=24, stream=True))
    indices = [i for i, _ in pairs]
    assert set(indices) == set(range(len(PROMPTS)))
    assert indices != sorted(indices), "deltas of different prompts should interleave as they are produced"
    joined = [""] * len(PROMPTS)
    for index, delta in pairs:
        assert delta
        joined[index] += delta
    assert joined == expected


def test_single_prompt_streams_plain_text(engine):
    expected = engine.generate(PROMPTS[0], max_tokens=20)
    deltas = list(engine.generate(PROMPTS[0], max_tokens=20, stream=True))
    assert all(isinstance(d, str) for d in deltas)
    assert "".join(deltas) == expected


def test_requests_are_registered_before_the_stream_is_read(engine):
    stream = engine.generate(PROMPTS, max_tokens=8, stream=True)
    assert len(engine.request_info(stream.request_ids)) == len(PROMPTS)
    assert len(list(stream)) > 0


@pytest.fixture(params=["stream", "windows"])
def detokenized(request, tokenizer):
    """The tokenizer, detokenized by ``tokenizers``' DecodeStream, or (one that cleans up spaces after decoding,
    which the stream does not) by decoding a window of tokens per push."""
    if request.param == "stream":
        return tokenizer
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert IncrementalDetokenizer(cleaning)._stream is None
    return cleaning


def test_deltas_never_split_a_multibyte_character(detokenized):
    tokenizer = detokenized
    text = "A 🦄 and 漢字 and ñ: “ok” — 🐉🐉 done"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert any(tokenizer.decode([t]).endswith(REPLACEMENT) for t in ids), "the text must split characters"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_bytes_still_join_to_the_full_decode(detokenized):
    """Random token soup (what a random model emits) may hold broken UTF-8; the joined text still matches."""
    tokenizer = detokenized
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(30)]
        detok = IncrementalDetokenizer(tokenizer)
        joined = "".join(detok.push(t) for t in ids) + detok.flush()
        assert joined == tokenizer.decode(ids, skip_special_tokens=True)
