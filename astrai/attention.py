"""Paged attention, plugged into transformers through its attention interface.

The engine flattens every scheduled request into one row of tokens (``input_ids`` of shape ``[1, T]``), so the
model's own layers (projections, RoPE, norms) run once for the whole batch. Only attention needs to know where
each request's KV lives: the runner makes the step's ``PagedBatch`` current (``serving``) around the model call,
and the hook hands each layer's query, key and value to one opaque op, ``astrai::paged_attention`` (``ops.py``),
which reads it. Being one opaque op per layer is what lets ``torch.compile`` take the rest of the model whole.

Per layer, the op first writes the new K/V into their slots, then lets each request attend to its own
pages only. The C kernels of ``paged_kernel.py`` read every request's K and V rows where they lie in the pages (as
vLLM's CPU attention does): one call attends every request with one query token (decodes), another every
multi-token chunk (prefills, causally, a chunk after a cached prefix included). Where the kernels cannot be built
(no compiler, a GPU), PyTorch attends instead: the decodes in one ``scaled_dot_product_attention`` call, each
request a batch entry, its context first gathered into a contiguous copy and padded to the longest (masked); the
chunks one by one, a chunk with no cached context causally over this step's own keys and values (``is_causal``, no
mask and no gather), one that continues a cached context (a prefix cache hit, a later chunk of a long prompt) over
its context gathered out of the pages, through an additive mask. GQA is served without copying repeated heads
(``enable_gqa``, and the kernels' query groups): the query heads of one KV group share each K/V row they read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from astrai import ops
from astrai.device import to_device
from astrai.paged_kernel import PagedKernel

ATTN_IMPLEMENTATION = "astrai_paged"


@dataclass
class PrefillChunk:
    """A request computing several tokens this step, attended through PyTorch (where no kernel attends it)."""

    start: int  # first row in the flattened batch
    length: int  # query tokens
    key_slots: torch.Tensor | None  # [L] slots of its whole context, in position order; None: no cached context
    bias: torch.Tensor | None  # [length, L] 0 where a query may attend, -inf elsewhere; None with key_slots


@dataclass
class KernelPrefill:
    """A step's multi-token chunks as the prefill kernel attends them, all in one call per layer."""

    kernel: PagedKernel
    spans: torch.Tensor  # [C, 3] (first row, rows, tokens computed before) per chunk
    pages: torch.Tensor  # [C, Pmax] page table of each chunk, padded with page 0


@dataclass
class PagedBatch:
    """Where every token of one step lives in the paged KV cache. Built once per step, read by every layer.

    Every tensor lives where the KV tensors do (built on the host from the page tables, then copied over once).
    """

    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V, each [kv_heads, slots, head_dim]
    page_size: int
    slot_mapping: torch.Tensor  # [T] slot each new token's K/V is written to
    decode_rows: torch.Tensor  # [Bd] rows with a single query token
    decode_pages: torch.Tensor  # [Bd, Pmax] page table of each decode row, padded with page 0 (the kernel's input)
    decode_lengths: torch.Tensor  # [Bd] context length of each decode row
    paged_kernel: PagedKernel | None  # attends from the pages in place; None: gather, then attend
    decode_table: torch.Tensor | None  # [Bd, Lmax] context slots of each decode row, padded with slot 0 (no kernel)
    decode_bias: torch.Tensor | None  # [1, Bd, 1, Lmax], -inf on padding: PyTorch attention, rows of unequal length
    decode_covers_all: bool  # every row is a decode row: skip the scatter (and the kernel writes the new K/V)
    prefills: list[PrefillChunk]  # multi-token chunks for PyTorch attention (empty where the kernel attends them)
    kernel_prefill: KernelPrefill | None  # multi-token chunks for the kernel (None where there are none, or no kernel)


def build_paged_batch(
    kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
    items: list[tuple[list[int], int, int]],
    page_size: int,
    paged_kernel: PagedKernel | None = None,
) -> PagedBatch:
    """``items`` holds, per request, (its page table, tokens already computed, tokens computed now).

    The page tables are Python lists, so the metadata is computed on the host and each tensor copied to the KV's
    device without waiting for it (``to_device``); on the CPU nothing is copied. A decode row costs a few Python
    integer operations here (its new slot, its page table), not tensor ops: with 8 requests, building their slot
    tables one request at a time took about 0.3 ms of a 4-5 ms step of the embedded model.
    """
    device, dtype = kv_cache[0][0].device, kv_cache[0][0].dtype
    new_slots: list[int] = []
    decode_rows: list[int] = []
    decode_pages: list[list[int]] = []
    decode_lengths: list[int] = []
    prefills: list[PrefillChunk] = []
    spans: list[list[int]] = []  # the kernel's chunks
    span_pages: list[list[int]] = []
    row = 0
    for pages, done, count in items:
        if count == 1:
            decode_rows.append(row)
            decode_pages.append(pages)
            decode_lengths.append(done + 1)
            new_slots.append(pages[done // page_size] * page_size + done % page_size)
        elif paged_kernel is not None:  # it reads the context from the pages, causally: no slots, no mask
            new_slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(done, done + count))
            spans.append([row, count, done])
            span_pages.append(pages)
        else:
            positions = torch.arange(done + count)
            slots = torch.tensor(pages)[positions // page_size] * page_size + positions % page_size
            new_slots.extend(slots[done:].tolist())
            if done == 0:  # its context is this step's keys alone: causal attention needs neither
                prefills.append(PrefillChunk(row, count, None, None))
            else:
                bias = torch.zeros(count, done + count, dtype=dtype)
                bias.masked_fill_(positions > positions[done:].unsqueeze(1), float("-inf"))
                prefills.append(PrefillChunk(row, count, to_device(slots, device), to_device(bias, device)))
        row += count
    table = _page_table(decode_pages)
    lengths = torch.tensor(decode_lengths, dtype=torch.long)
    slots_table: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None
    if paged_kernel is None:  # PyTorch gathers each row's context slots, then masks the padding
        longest = max(decode_lengths, default=0)
        positions = torch.arange(longest)
        slots_table = table[:, positions // page_size] * page_size + positions % page_size
        if any(n < longest for n in decode_lengths):
            decode_bias = torch.zeros(1, len(decode_lengths), 1, longest, dtype=dtype)
            decode_bias[0, :, 0].masked_fill_(positions >= lengths.unsqueeze(1), float("-inf"))
    kernel_prefill = None
    if paged_kernel is not None and spans:  # spans are made only where the kernel attends
        span_tensor = to_device(torch.tensor(spans, dtype=torch.long), device)
        kernel_prefill = KernelPrefill(paged_kernel, span_tensor, to_device(_page_table(span_pages), device))
    return PagedBatch(
        kv_cache=kv_cache,
        page_size=page_size,
        slot_mapping=to_device(torch.tensor(new_slots, dtype=torch.long), device),
        decode_rows=to_device(torch.tensor(decode_rows, dtype=torch.long), device),
        decode_pages=to_device(table, device),
        decode_lengths=to_device(lengths, device),
        paged_kernel=paged_kernel,
        decode_table=None if slots_table is None else to_device(slots_table, device),
        decode_bias=None if decode_bias is None else to_device(decode_bias, device),
        decode_covers_all=len(decode_rows) == row,
        prefills=prefills,
        kernel_prefill=kernel_prefill,
    )


def _page_table(tables: list[list[int]]) -> torch.Tensor:
    """The page tables as one [N, widest] tensor, each padded with page 0 (never read: lengths bound the reads)."""
    widest = max((len(p) for p in tables), default=0)
    return torch.tensor([p + [0] * (widest - len(p)) for p in tables], dtype=torch.long).view(len(tables), widest)


class AttentionModule(Protocol):
    """What the hook reads of the module it is called for: transformers' attention modules know their layer (an
    ``int`` attribute, which ``nn.Module``'s typed ``__getattr__`` would call a tensor or a module)."""

    layer_idx: int


def paged_attention(
    module: AttentionModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook. q: [1, H, T, D], k/v: [1, KVH, T, D] (after RoPE). Returns ([1, T, H, D], None).

    Under ``torch.compile`` it calls the ``astrai::paged_attention`` op, so the compiler sees one opaque call per
    layer and compiles the rest of the model around it without a graph break.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        return torch.ops.astrai.paged_attention(query, key, value, module.layer_idx, scale), None
    # eager: the op's own body, without the op's dispatch (8% of the embedded model's engine thread in py-spy)
    return _paged_attention(query, key, value, module.layer_idx, scale), None


_current_batch: ContextVar[PagedBatch | None] = ContextVar("astrai_paged_batch", default=None)


@contextmanager
def serving(batch: PagedBatch) -> Iterator[None]:
    """Makes ``batch`` the one every layer's attention reads during a forward (on this thread or task only).

    The batch travels beside the model call rather than through it, as vLLM's forward context does: a compiled
    graph then depends on the token count only, not on how the step splits into requests.
    """
    token = _current_batch.set(batch)
    try:
        yield
    finally:
        _current_batch.reset(token)


def _paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    """Writes this step's K/V into the layer's pages, then attends each request to its own context.

    The KV write is a side effect the op does not declare: the op is only ever called with its output used, in
    layer order, so nothing reorders or drops it (vLLM's attention op relies on the same).
    """
    batch = _current_batch.get()
    if batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention runs only inside the engine's forward (see serving)")
    k_cache, v_cache = batch.kv_cache[layer_idx]
    kernel = batch.paged_kernel
    if kernel is not None and batch.decode_covers_all:
        # a decode-only step, the common one: one call writes every new K/V row and attends, reading the query
        # and the new rows in the model's own layout (no copies)
        pages, lengths = batch.decode_pages, batch.decode_lengths
        res = kernel.attend(query, k_cache, v_cache, pages, lengths, batch.page_size, scale, (key, value))
        return res.unsqueeze(0)
    heads, rows, head_dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = k_cache.shape[0]
    groups = heads // kv_heads
    q = query[0]  # [H, T, D]
    k_cache.index_copy_(1, batch.slot_mapping, key[0])
    v_cache.index_copy_(1, batch.slot_mapping, value[0])
    out = query.new_empty(rows, heads, head_dim)

    if batch.decode_rows.numel():
        q_dec = q if batch.decode_covers_all else q.index_select(1, batch.decode_rows)
        n = q_dec.shape[1]
        if kernel is not None:
            pages, lengths = batch.decode_pages, batch.decode_lengths
            res = kernel.attend(q_dec.unsqueeze(0), k_cache, v_cache, pages, lengths, batch.page_size, scale)
        else:
            # KV heads act as the batch dimension: index_select copies whole slot rows (fast), the gathered
            # context is contiguous, and each KV head's query group rides along as extra query rows.
            q_dec = q_dec.view(kv_heads, groups, n, head_dim).transpose(1, 2)  # [KVH, Bd, G, D]
            table = batch.decode_table
            assert table is not None  # built whenever no kernel attends (build_paged_batch)
            context = table.flatten()
            k = k_cache.index_select(1, context).view(kv_heads, n, -1, head_dim)  # [KVH, Bd, L, D]
            v = v_cache.index_select(1, context).view(kv_heads, n, -1, head_dim)
            res = F.scaled_dot_product_attention(q_dec, k, v, attn_mask=batch.decode_bias, scale=scale)
            # [Bd, H, D], contiguous as the op's fake promises: without query groups (G = 1) the reshape is a view
            # with the heads' stride, and a compiled graph's stride check refuses it
            res = res.permute(1, 0, 2, 3).reshape(n, heads, head_dim).contiguous()
        if batch.decode_covers_all:
            out = res
        else:
            out.index_copy_(0, batch.decode_rows, res)

    if (chunks := batch.kernel_prefill) is not None:
        chunks.kernel.prefill(query, k_cache, v_cache, chunks.pages, chunks.spans, batch.page_size, scale, out)
    for chunk in batch.prefills:
        span = slice(chunk.start, chunk.start + chunk.length)
        if chunk.key_slots is None:
            k, v, causal = key[:, :, span], value[:, :, span], True
        else:
            k = k_cache.index_select(1, chunk.key_slots).unsqueeze(0)  # [1, KVH, L, D]
            v = v_cache.index_select(1, chunk.key_slots).unsqueeze(0)
            causal = False
        res = F.scaled_dot_product_attention(
            query[:, :, span], k, v, attn_mask=chunk.bias, is_causal=causal, scale=scale, enable_gqa=groups > 1
        )
        out[span] = res[0].transpose(0, 1)
    return out.unsqueeze(0)


def _paged_attention_shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


ops.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scale) -> Tensor",
    _paged_attention,
    _paged_attention_shape,
    "CompositeExplicitAutograd",  # every device: the CPU's kernels, or PyTorch's attention on a GPU
)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
