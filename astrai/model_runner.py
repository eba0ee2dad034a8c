"""Runs one step of a transformers causal LM over the paged KV cache.

The model definition is transformers' own; the runner only switches its attention implementation to ours,
owns the KV tensors, flattens the scheduled requests into one ``[1, T]`` row and computes logits just for the
rows that sample. Unless told not to, it fuses and packs the model's linear weights (``packed_linear.py``) and
attends decodes with the C kernel where it builds (``paged_kernel.py``). With ``compile=True`` the same fused, packed
layers are compiled into one graph with the rest of the model (inductor freezing makes their weights constants).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers import PretrainedConfig, PreTrainedModel

from astrai.attention import ATTN_IMPLEMENTATION, build_paged_batch, serving
from astrai.packed_linear import pack_linears, packing_supported, unpack_linears
from astrai.paged_kernel import DecodeKernel, load_decode_kernel
from astrai.request import Request

log = logging.getLogger("astrai")

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_supported(config: PretrainedConfig) -> None:
    """Refuse, at load, an architecture whose attention the paged hook would compute wrongly."""
    name = type(config).__name__
    layer_types = getattr(config, "layer_types", None) or []
    if hasattr(config, "use_sliding_window"):  # Qwen-style: a window size may be set but switched off
        sliding = bool(config.use_sliding_window)
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    if sliding or any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{name}: sliding-window attention is not supported by the paged attention hook")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{name}: attention logit soft-capping is not supported by the paged attention hook")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name}: only decoder-only causal LMs are supported")


def _convert_floating(model: PreTrainedModel, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cast the model's floating parameters and buffers to ``dtype`` in place; return (tensor, original data).

    The originals are kept so ``restore`` hands the exact weights back: a float32 model served in bfloat16 holds
    both copies while it serves (1.5x its weights). A checkpoint loaded in the serving dtype converts nothing.
    """
    converted = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            converted.append((tensor, tensor.data))
            tensor.data = tensor.data.to(dtype)
    return converted


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        n_pages: int,
        page_size: int,
        dtype: torch.dtype,
        packed_weights: bool = True,
        attention_kernel: bool = True,
        compile: bool = False,
    ):
        config = model.config
        check_supported(config)
        if config._attn_implementation == ATTN_IMPLEMENTATION:  # its layers are re-wired for another engine
            raise ValueError("this model already serves another InferenceEngine: shut that one down, or pass a copy")
        self.page_size = page_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.groups = heads // kv_heads
        kernel = load_decode_kernel() if attention_kernel else None
        self.decode_kernel: DecodeKernel | None = (
            kernel if kernel is not None and kernel.supports(dtype, self.groups, head_dim) else None
        )
        slots = n_pages * page_size
        # the KV tensors first: a pool too large for memory fails here, before the model is touched
        self.kv_cache = [
            (torch.zeros(kv_heads, slots, head_dim, dtype=dtype), torch.zeros(kv_heads, slots, head_dim, dtype=dtype))
            for _ in range(config.num_hidden_layers)
        ]
        self.model = model
        self.was_training = model.training
        self.original_tensors = _convert_floating(model, dtype)
        model.eval()
        self.previous_attn = config._attn_implementation
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        pack = packed_weights and packing_supported(dtype)
        self.packed_linears = self._pack() if pack else 0
        # eager steps call the model itself (so a wrapper put on its forward later, as the soak's faults, still runs)
        self.compiled = torch.compile(model.forward, dynamic=True) if compile else None

    def _pack(self) -> int:
        """Packing is only a speed-up: where oneDNN refuses a weight, the model keeps its own layers."""
        try:
            return pack_linears(self.model)
        except Exception:
            unpack_linears(self.model)
            log.warning("oneDNN weight packing failed; serving with the model's own linear layers", exc_info=True)
            return 0

    def restore(self) -> None:
        """Give the model back as it came: attention, linear layers, exact weights, dtype and train/eval mode."""
        unpack_linears(self.model)
        for tensor, original in self.original_tensors:
            tensor.data = original
        self.original_tensors = []
        self.model.train(self.was_training)
        self.model.set_attn_implementation(self.previous_attn)

    @torch.inference_mode()
    def step(self, work: list[tuple[Request, int]]) -> torch.Tensor:
        """Compute ``count`` tokens of each request; return logits [R, V] for the requests that reach their end."""
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for req, count in work:
            start = req.num_computed
            input_ids.extend(req.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            if start + count == len(req.token_ids):
                sample_rows.append(len(input_ids) - 1)
        batch = build_paged_batch(
            self.kv_cache,
            [(req.pages, req.num_computed, count) for req, count in work],
            self.page_size,
            self.groups,
            self.decode_kernel,
        )
        tokens, positions_t = torch.tensor([input_ids]), torch.tensor([positions])
        rows = torch.tensor(sample_rows, dtype=torch.long)
        forward, freezing = self.model, contextlib.nullcontext()
        if self.compiled is not None:
            # freezing is patched in around the call rather than passed as torch.compile's option, which left every
            # weight a graph input here (torch 2.13): unpacked, and refused by the packed layers' op
            forward, freezing = self.compiled, torch._inductor.config.patch(freezing=True)
            # unbacked: a step of one token (or one sampled row) must not get a graph of its own, as a size of 1
            # otherwise would; one graph then serves every step
            for tensor, dim in ((tokens, 1), (positions_t, 1), (rows, 0)):
                torch._dynamo.decorators.mark_unbacked(tensor, dim)
        with serving(batch), freezing:
            out = forward(input_ids=tokens, position_ids=positions_t, use_cache=False, logits_to_keep=rows)
        return out.logits[0]
