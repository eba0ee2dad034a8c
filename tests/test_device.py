"""The ``device`` option (astrai/device.py): checked before anything is touched, the CPU-only speed-ups off (and
refused when asked for) off the CPU, every per-step tensor where the KV lives, and, on a GPU, the engine serving from
it with one wait for the device per step, and handing the model back where it was."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from astrai import InferenceEngine
from astrai.attention import build_paged_batch
from astrai.device import resolve_cpu_speedup, resolve_device
from tests.support.tiny_models import make_model, reference_generate

CPU, CUDA0 = torch.device("cpu"), torch.device("cuda", 0)
PROMPTS = ["Once upon a time there was a little cat.", "Lily and Tom went to the park.", "The dog"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def two_gpus(monkeypatch):
    """CUDA as the engine's checks see it, without a GPU: two devices, the second current. Only the checks may run
    under it (nothing may allocate on the pretend device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_the_default_is_the_cpu_without_cuda_and_cuda_is_refused_there(no_cuda):
    assert resolve_device(None) == resolve_device("cpu") == resolve_device(torch.device("cpu")) == CPU
    with pytest.raises(ValueError, match=r"device='cuda' was asked for, but .* no usable CUDA device.*device='cpu'"):
        resolve_device("cuda")


def test_cuda_devices_come_back_with_their_index(two_gpus):
    assert resolve_device(None) == resolve_device("cuda") == torch.device("cuda", 1)  # the current device
    assert resolve_device("cuda:0") == resolve_device(torch.device("cuda", 0)) == CUDA0
    with pytest.raises(ValueError, match=r"'cuda:2' does not exist: this process sees 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("bad", ["gpu", "mps", "meta", "cuda:x", "", 0, 1.5, torch.device("meta")], ids=repr)
def test_other_devices_are_refused(bad):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda'"):
        resolve_device(bad)


def test_the_cpu_speedups_are_on_where_they_apply_and_refused_elsewhere():
    assert resolve_cpu_speedup("packed_weights", None, CPU) is True
    assert resolve_cpu_speedup("packed_weights", False, CPU) is False
    assert resolve_cpu_speedup("attention_kernel", None, CUDA0) is False
    assert resolve_cpu_speedup("attention_kernel", False, CUDA0) is False
    with pytest.raises(ValueError, match=r"attention_kernel=True asks for the C decode-attention kernel, a CPU-only"):
        resolve_cpu_speedup("attention_kernel", True, CUDA0)
    with pytest.raises(ValueError, match=r"packed_weights must be True, False or None"):
        resolve_cpu_speedup("packed_weights", "yes", CPU)


def untouched(model: torch.nn.Module) -> bool:
    return model.config._attn_implementation != "astrai_paged" and next(model.parameters()).device == CPU


def test_an_engine_on_a_missing_gpu_is_refused_before_anything_is_touched(no_cuda, model, tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="no usable CUDA device"):
        InferenceEngine(model, tokenizer, n_pages=16, device="cuda")
    assert untouched(model)

    def load(*args: object) -> None:
        raise AssertionError("the checkpoint was loaded before the device was checked")

    monkeypatch.setattr("astrai.engine.load_checkpoint", load)
    with pytest.raises(ValueError, match="no usable CUDA device"):
        InferenceEngine.from_pretrained("assets/models/tinystories-llama", device="cuda:0")


@pytest.mark.parametrize("option", ["packed_weights", "attention_kernel"])
def test_a_cpu_speedup_asked_for_on_cuda_is_refused(two_gpus, option, model, tokenizer):
    with pytest.raises(ValueError, match=rf"{option}=True asks for .* CPU-only speed-up, .* runs on cuda:1"):
        InferenceEngine(model, tokenizer, n_pages=16, device="cuda", **{option: True})
    assert untouched(model)


def test_engines_sharing_a_model_must_agree_on_the_device(model, tokenizer, monkeypatch):
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, device="cpu", compile=False) as engine:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # only the second engine's checks see CUDA
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        with pytest.raises(ValueError, match=r"already serves another .*device=cuda:0 \(it serves with cpu\)"):
            InferenceEngine(model, tokenizer, page_size=4, n_pages=16, device="cuda")
        monkeypatch.undo()
        assert engine.runner.prepared.users == 1 and engine.generate(PROMPTS[0], max_tokens=2)


def test_a_model_that_cannot_move_is_left_as_it_came(tokenizer):
    """All or nothing: a tensor that cannot move (here one on the meta device, which has no data to copy; on a GPU,
    one that no longer fits) puts back every tensor moved before it, so the model can serve elsewhere."""
    model = make_model("llama", len(tokenizer))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    model.register_buffer("no_data", torch.empty(1, device="meta"), persistent=False)  # the last tensor to move
    with pytest.raises(NotImplementedError):
        InferenceEngine(model, tokenizer, page_size=4, n_pages=16, dtype="bfloat16", device="cpu", compile=False)
    assert untouched(model)
    del model.no_data
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], before[k]) for k in before)
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=16, device="cpu", compile=False) as engine:
        assert engine.generate(PROMPTS[0], max_tokens=2)


def test_every_tensor_of_a_step_lives_where_the_kv_does():
    """The meta device stands in for a GPU: a tensor of the step's metadata left on the host shows as cpu here."""
    kv_cache = [(torch.zeros(2, 64, 8, device="meta"), torch.zeros(2, 64, 8, device="meta"))]
    # a prefill chunk that continues a cached context (its gather and mask), and two decodes of unequal context
    # (PyTorch attention then masks the shorter one's padding)
    batch = build_paged_batch(kv_cache, [([0, 1], 2, 4), ([2, 3], 6, 1), ([4], 2, 1)], page_size=4)
    assert batch.decode_bias is not None and len(batch.prefills) == 1
    tensors = {
        "slot_mapping": batch.slot_mapping,
        "decode_rows": batch.decode_rows,
        "decode_table": batch.decode_table,
        "decode_lengths": batch.decode_lengths,
        "decode_bias": batch.decode_bias,
        "key_slots": batch.prefills[0].key_slots,
        "bias": batch.prefills[0].bias,
    }
    assert {name: t.device.type for name, t in tensors.items()} == dict.fromkeys(tensors, "meta")


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch(device, tokenizer):
    """Each request's noise comes from its own generator, made on the engine's device."""
    sampling = dict(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=11)
    qwen3 = make_model("qwen3", len(tokenizer))
    with InferenceEngine(qwen3, tokenizer, page_size=4, n_pages=64, device=device, compile=False) as e:
        alone = e.generate(PROMPTS[0], **sampling)
        assert e.generate(PROMPTS[0], **sampling) == alone
        # the prompts of one call get seeds seed, seed + 1, ...: the first one keeps its seed in the batch
        assert e.generate([PROMPTS[0], *PROMPTS[1:]], **sampling)[0] == alone
        assert e.cache_stats().failed == 0


@needs_cuda
def test_an_engine_on_cuda_serves_from_it_and_hands_the_model_back_to_the_host(tokenizer, monkeypatch):
    """A model on the host: served on the GPU (weights, KV), without the CPU-only speed-ups or OpenMP releases, with
    transformers' own greedy output on the host, and handed back on the host with its exact weights."""
    model = make_model("llama", len(tokenizer))
    refs = [reference_generate(model, tokenizer, p, 16) for p in PROMPTS]
    before = {name: t.clone() for name, t in model.state_dict().items()}
    released = []
    for where in ("astrai.engine.release_pool", "astrai.model_thread.release_pool"):
        monkeypatch.setattr(where, lambda: released.append(threading.current_thread().name))
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, device="cuda") as engine:
        assert engine.device == torch.device("cuda", torch.cuda.current_device())
        assert {p.device for p in model.parameters()} == {engine.device}
        assert engine.runner.kv_cache[0][0].device == engine.device
        assert engine.runner.packed_linears == 0 and engine.runner.paged_kernel is None
        stream = engine.generate(PROMPTS, max_tokens=16, stream=True)
        list(stream)
        assert [list(i.output_ids) for i in engine.request_info(stream.request_ids)] == refs
    assert released == []
    after = model.state_dict()
    assert all(after[k].device == CPU and torch.equal(after[k], before[k]) for k in before)


@needs_cuda
def test_a_step_on_cuda_waits_for_the_device_once(tokenizer):
    """The step's inputs are copied over without a sync; only its sampled tokens come back (one sync per step).
    torch's sync debug mode warns at every synchronizing call, on whichever thread makes it."""
    model = make_model("qwen2", len(tokenizer))
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, device="cuda") as engine:
        engine.generate(PROMPTS[0], max_tokens=2)  # the first step initialises what it needs
        steps_before = engine.steps
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.generate(PROMPTS, max_tokens=16)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        steps = engine.steps - steps_before
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert 0 < len(syncs) <= steps, (steps, syncs[:5])
