"""The engine's greedy output equals transformers' own generate, token for token, on three model families, on every
device there is (``device``, tests/conftest.py): the reference is transformers on that same device, in float32."""

from __future__ import annotations

import pytest
import torch
import torch.utils._triton

from astrai import InferenceEngine
from astrai.eviction import POLICIES
from tests.support.tiny_models import FAMILIES, make_model, make_tokenizer, reference_generate

PAGE = 4
NEW_TOKENS = 16
PROMPTS = [
    "Once upon a time there was a little cat.",
    "Once upon a time there was a little cat. The cat sat on the mat and looked at the sun.",
    "Lily and Tom went to the park.",
    "Lily and Tom went to the park. They played with a big red ball all day long. The dog was happy.",
    "The dog",
    "小猫在花园里玩。 😀 emoji",
    "Once upon a time there was a little dog. It ran to the tree and barked at a bird.",
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, device):
    tokenizer = make_tokenizer()
    model = make_model(request.param, len(tokenizer)).to(device)
    refs = [reference_generate(model, tokenizer, p, NEW_TOKENS) for p in PROMPTS]
    longest = max(len(tokenizer(p).input_ids) for p in PROMPTS) + NEW_TOKENS
    return model, tokenizer, refs, -(-longest // PAGE)


def run_batch(engine: InferenceEngine, prompts: list[str]) -> tuple[list[str], list[list[int]]]:
    stream = engine.generate(prompts, max_tokens=NEW_TOKENS, stream=True)
    texts = [""] * len(prompts)
    for index, delta in stream:
        texts[index] += delta
    return texts, [list(info.output_ids) for info in engine.request_info(stream.request_ids)]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache-on", "cache-off"])
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_greedy_equals_transformers(family, device, prefix_caching, pool):
    check_greedy(family, device, prefix_caching, pool, "lru")


@pytest.mark.parametrize("eviction", [name for name in POLICIES if name != "lru"])
def test_greedy_equals_transformers_under_every_eviction_policy(family, device, eviction):
    """The tight pool with caching on, so this policy picks the pages evicted (LRU's case is the test above): which
    cached pages go first changes the hits, never the tokens."""
    check_greedy(family, device, True, "tight", eviction)


def check_greedy(family, device, prefix_caching: bool, pool: str, eviction: str) -> None:
    model, tokenizer, refs, pages_per_request = family
    # "tight" fits the longest request plus two pages: the batch must evict and preempt to get through.
    n_pages = 256 if pool == "roomy" else pages_per_request + 2
    with InferenceEngine(
        model,
        tokenizer,
        page_size=PAGE,
        n_pages=n_pages,
        max_batch_size=6,
        prefix_caching=prefix_caching,
        eviction=eviction,
        device=device,
        compile=False,
    ) as engine:
        assert engine.pool.policy.name == eviction
        on_cpu = engine.device.type == "cpu"  # the default path there: oneDNN-packed weights, the C attention kernels;
        assert (engine.runner.packed_linears > 0) == on_cpu  # elsewhere transformers' own layers,
        assert (engine.runner.paged_kernel is not None) == on_cpu  # and attention through PyTorch
        assert engine.runner.kv_cache[0][0].device == engine.device == next(model.parameters()).device
        for _ in range(2):  # the second round runs with the cache warm
            texts, ids = run_batch(engine, PROMPTS)
            assert ids == refs
            assert texts == [tokenizer.decode(r, skip_special_tokens=True) for r in refs]
        stats = engine.cache_stats()
        assert stats.used_pages == 0
        if pool == "tight":
            assert stats.preemptions > 0
            if prefix_caching:
                assert stats.evictions > 0
        if prefix_caching:
            assert stats.hit_tokens > 0
        else:
            assert stats.hit_tokens == 0 and stats.cached_pages == 0
        engine.pool.check_invariants()


@pytest.mark.parametrize("store", ["memory", "file"])
@pytest.mark.parametrize("offload_policy", ["through", "on_evict"])
def test_second_tier_equals_transformers(family, device, offload_policy, store, tmp_path):
    """A round trip through the second tier is a copy: the tight pool evicts constantly, a six-page tier evicts its
    own pages as constantly, pages are loaded back from it (memory, or a file on disk), and the greedy tokens are
    still transformers'. Each prompt alone afterwards, the longest last, so pages left in the tier are looked up."""
    model, tokenizer, refs, pages_per_request = family
    if store == "file" and model.config.model_type != "llama":
        pytest.skip("the file store's bytes are the memory store's: one family proves its round trip")
    if store == "file" and device != "cpu":
        pytest.skip("a file tier reads into host memory: on a GPU the tier is pinned host memory (refused otherwise)")
    with InferenceEngine(
        model,
        tokenizer,
        page_size=PAGE,
        n_pages=pages_per_request + 2,
        max_batch_size=6,
        device=device,
        compile=False,
        offload_pages=6,
        offload_to="memory" if store == "memory" else tmp_path,
        offload_policy=offload_policy,
    ) as engine:
        for _ in range(2):
            _, ids = run_batch(engine, PROMPTS)
            assert ids == refs
        for prompt, ref in zip(PROMPTS[::-1], refs[::-1], strict=True):
            assert run_batch(engine, [prompt])[1] == [ref]
        tier = engine.cache_stats().second_tier
        assert tier is not None and tier.enabled and tier.medium == ("file" if store == "file" else "memory")
        assert tier.loaded_pages > 0 and tier.evictions > 0  # loaded back, across the tier's own evictions
        engine.pool.check_invariants()
        engine.cache.tier.check_invariants()


def test_chunked_prefill_equals_transformers(family, device):
    """A prompt longer than the per-step token budget is prefilled over several steps, with the same result."""
    model, tokenizer, refs, _ = family
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=128, max_batched_tokens=7, device=device, compile=False
    ) as engine:
        _, ids = run_batch(engine, PROMPTS)
    assert ids == refs


def test_plain_weights_and_attention_equal_transformers(family, device):
    """Without its speed-ups (weight packing, the C attention kernels) the engine runs transformers' own linear layers
    and attends through PyTorch, with the same result."""
    model, tokenizer, refs, _ = family
    with InferenceEngine(
        model,
        tokenizer,
        page_size=PAGE,
        n_pages=128,
        packed_weights=False,
        attention_kernel=False,
        device=device,
        compile=False,
    ) as engine:
        assert engine.runner.packed_linears == 0 and engine.runner.paged_kernel is None
        _, ids = run_batch(engine, PROMPTS)
    assert ids == refs


def test_bfloat16_runs_and_mostly_agrees(family, device):
    """bfloat16 changes numerics, so only ask that it runs, frees its pages, and starts like float32."""
    model, tokenizer, refs, _ = family
    with InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=128, dtype="bfloat16", device=device, compile=False
    ) as engine:
        _, ids = run_batch(engine, PROMPTS)
        assert engine.cache_stats().used_pages == 0
    model.float()
    assert sum(a[0] == b[0] for a, b in zip(ids, refs, strict=True)) >= len(PROMPTS) // 2


def test_compiled_equals_transformers(family, device):
    """``compile=True``: the whole model as one compiled graph for every step, with the same greedy output.

    The pool is tight, so the compiled forward also runs the steps that evict and preempt; prefills and decodes of
    every size go through the one compiled function, which cannot recompile (a step it did not fit would raise). On
    CUDA, inductor generates Triton kernels: without Triton there is nothing to test.
    """
    if device == "cuda" and not torch.utils._triton.has_triton():
        pytest.skip("torch.compile on CUDA needs Triton")
    model, tokenizer, refs, pages_per_request = family
    for prefix_caching in (True, False):
        with InferenceEngine(
            model,
            tokenizer,
            page_size=PAGE,
            n_pages=pages_per_request + 2,
            max_batch_size=6,
            prefix_caching=prefix_caching,
            compile=True,
            device=device,
        ) as engine:
            assert engine.runner.compiled is not None
            assert (engine.runner.packed_linears > 0) == (engine.device.type == "cpu")
            for _ in range(2):
                _, ids = run_batch(engine, PROMPTS)
                assert ids == refs
            stats = engine.cache_stats()
            assert stats.preemptions > 0 and (stats.evictions > 0) == prefix_caching
