"""Several engines over one model object share its prepared weights; each has its own pool and KV tensors.

The forwards of engines sharing a model are serialised (``PreparedModel`` in ``astrai/model_runner.py``) and, while
several share it, run on its one model thread; the last engine to shut down gives the model back as it came.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from astrai import InferenceEngine
from astrai.packed_linear import PackedLinear
from tests.support.tiny_models import FAMILIES, make_model, reference_generate

NEW_TOKENS = 16
PROMPTS = [
    "Once upon a time there was a little cat.",
    "Once upon a time there was a little cat. The cat sat on the mat and looked at the sun.",
    "Lily and Tom went to the park. They played with a big red ball all day long. The dog was happy.",
    "The dog",
    "小猫在花园里玩。 😀 emoji",
]
# two profiles of one model: different page sizes, pool sizes, batch sizes and prefix caching (eager: sharing is
# what is tested here, and each compile of a fresh model costs seconds; test_compiled_forward.py compiles)
PROFILES = (
    dict(page_size=4, n_pages=256, max_batch_size=6, prefix_caching=True, compile=False),
    dict(page_size=8, n_pages=8, max_batch_size=4, prefix_caching=False, compile=False),  # the longest request fits
)


def fresh_model(family: str, tokenizer) -> tuple[nn.Module, list[list[int]]]:
    model = make_model(family, len(tokenizer))
    return model, [reference_generate(model, tokenizer, p, NEW_TOKENS) for p in PROMPTS]


def output_ids(engine: InferenceEngine, prompts: list[str]) -> list[list[int]]:
    stream = engine.generate(prompts, max_tokens=NEW_TOKENS, stream=True)
    for _ in stream:
        pass
    return [list(info.output_ids) for info in engine.request_info(stream.request_ids)]


def plain_linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_engines_on_one_model_generate_concurrently_as_transformers_does(family, tokenizer):
    model, refs = fresh_model(family, tokenizer)
    start = threading.Barrier(2)
    results: dict[int, list[list[list[int]]]] = {}
    errors: list[BaseException] = []

    def serve(index: int, engine: InferenceEngine) -> None:
        try:
            start.wait(5)
            results[index] = [output_ids(engine, PROMPTS) for _ in range(3)]  # later rounds: the cache warm
        except BaseException as exc:
            errors.append(exc)

    first = InferenceEngine(model, tokenizer, **PROFILES[0])
    second = InferenceEngine(model, tokenizer, **PROFILES[1])
    with first, second:
        assert second.runner.prepared is first.runner.prepared and first.runner.prepared.users == 2
        assert second.runner.kv_cache[0][0].shape != first.runner.kv_cache[0][0].shape  # KV of their own
        threads = [threading.Thread(target=serve, args=(i, e)) for i, e in enumerate((first, second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert results == {0: [refs] * 3, 1: [refs] * 3}
        for engine in (first, second):
            assert engine.cache_stats().used_pages == 0
            engine.pool.check_invariants()


def test_forwards_of_engines_sharing_a_model_never_overlap(tokenizer, monkeypatch):
    """Deterministic: the first forward waits, inside the model, until the other engine is in its step and then a
    while longer; the other engine's forward must not start before the first one has returned."""
    model, _ = fresh_model("llama", tokenizer)
    first = InferenceEngine(model, tokenizer, **PROFILES[0])
    second = InferenceEngine(model, tokenizer, **PROFILES[1])
    real_forward, real_step = model.forward, second.runner.step
    second_stepping, second_forwarding = threading.Event(), threading.Event()
    inside, most_inside, calls = [0], [0], [0]
    counting = threading.Lock()

    def forward(*args, **kwargs):
        with counting:
            calls[0] += 1
            first_call = calls[0] == 1
            inside[0] += 1
            most_inside[0] = max(most_inside[0], inside[0])
        if not first_call:  # engines sharing a model forward on its thread: the second call is the other engine's
            second_forwarding.set()
        try:
            if first_call:
                second_stepping.wait(10)
                second_forwarding.wait(0.5)  # without the lock, the other forward enters in microseconds
            return real_forward(*args, **kwargs)
        finally:
            with counting:
                inside[0] -= 1

    def step(work):
        second_stepping.set()
        return real_step(work)

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(second.runner, "step", step)
    with first, second:
        text = first.generate(PROMPTS[0], max_tokens=4, stream=True)  # its first forward now waits in the model
        other = second.generate(PROMPTS[1], max_tokens=4, stream=True)
        assert "".join(text) and "".join(other)
    assert second_stepping.is_set() and second_forwarding.is_set()
    assert most_inside[0] == 1, "two engines ran the shared model at once"


def test_busy_engines_sharing_a_model_forward_on_one_thread_an_idle_one_costs_nothing(tokenizer, monkeypatch):
    """One thread, one OpenMP pool while two engines are busy: forwarding on their own loop threads made two pools
    that throttled each other (their batches took 1.4-1.6x as long as one after the other). While the other engine
    idles, an engine forwards on its own loop thread: no hand-off."""
    model, _ = fresh_model("llama", tokenizer)
    real_forward, threads, started = model.forward, [], threading.Event()

    def forward(*args, **kwargs):
        threads.append(threading.current_thread().name)
        started.set()
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    with (
        InferenceEngine(model, tokenizer, **PROFILES[0]) as first,
        InferenceEngine(model, tokenizer, **PROFILES[1]) as second,
    ):
        first.generate(PROMPTS[0], max_tokens=4)
        assert set(threads) == {"astrai-engine"}, "the other engine idles: no hand-off"
        threads.clear(), started.clear()
        long = first.generate(PROMPTS[:2], max_tokens=48, stream=True)
        assert started.wait(10)
        other = second.generate(PROMPTS[1:3], max_tokens=8, stream=True)
        assert list(other) and list(long)
    on_model = [i for i, name in enumerate(threads) if name.startswith("astrai-model-")]
    assert on_model, "both busy: the forwards moved to the model thread"
    while_both = threads[on_model[0] : on_model[-1] + 1]
    assert set(while_both) == {threads[on_model[0]]}, "while both are busy, no forward runs on a loop thread"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_shut_down_leaves_the_other_serving_and_the_last_restores_the_model(dtype, device, tokenizer):
    """The model comes on the host in float32; it is served in ``dtype`` on ``device`` (transformers' greedy output
    on the host in float32), and handed back on the host, as it came."""
    model, refs = fresh_model("qwen2", tokenizer)
    model.train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    linears, attention = plain_linears(model), model.config._attn_implementation
    first = InferenceEngine(model, tokenizer, dtype=dtype, device=device, **PROFILES[0])
    second = InferenceEngine(model, tokenizer, dtype=dtype, device=device, **PROFILES[1])
    expected = output_ids(second, PROMPTS) if dtype == "bfloat16" else refs
    assert output_ids(first, PROMPTS) == expected

    assert first.shutdown() is True
    assert second.runner.prepared.users == 1
    assert model.config._attn_implementation == "astrai_paged"  # still wired for the engine left
    packed = any(isinstance(m, PackedLinear) for m in model.modules())
    assert packed == (device == "cpu") and not model.training  # packed where that applies: on the CPU
    parameter = next(model.parameters())
    assert parameter.dtype == getattr(torch, dtype) and parameter.device == second.device
    assert output_ids(second, PROMPTS) == expected
    assert first.runner.kv_cache == []  # the engine shut down let its KV tensors go

    assert second.shutdown() is True
    assert model.config._attn_implementation == attention
    assert plain_linears(model) == linears and not any(isinstance(m, PackedLinear) for m in model.modules())
    assert model.training
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and after[k].device == before[k].device for k in before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # nothing holds the model now: it may be prepared afresh, even differently
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    with InferenceEngine(model, tokenizer, dtype=other, device=device, page_size=4, n_pages=64, compile=False) as again:
        assert again.runner.prepared.users == 1 and again.generate(PROMPTS[0], max_tokens=2)


@pytest.mark.parametrize(
    "option",
    [dict(dtype="bfloat16"), dict(packed_weights=False), dict(attention_kernel=False), dict(compile=True)],
    ids=lambda option: next(iter(option)),
)
def test_a_model_serving_an_engine_refuses_one_prepared_differently(option, tokenizer):
    model, refs = fresh_model("llama", tokenizer)
    with InferenceEngine(model, tokenizer, **PROFILES[0]) as engine:
        name, value = next(iter(option.items()))
        with pytest.raises(ValueError, match=f"already serves another InferenceEngine.*{name}={value}"):
            InferenceEngine(model, tokenizer, page_size=8, n_pages=16, **({"compile": False} | option))
        assert engine.runner.prepared.users == 1
        assert next(model.parameters()).dtype == torch.float32  # the refused engine touched nothing
        assert output_ids(engine, PROMPTS) == refs
