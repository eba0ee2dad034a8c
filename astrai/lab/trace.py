"""The trace format: Mooncake's (FAST'25) JSON lines, one request a line, plus an optional ``block_size``.

Each line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``.
``hash_ids`` name the prompt's blocks of ``block_size`` tokens in order, the last one possibly partial, so there
are exactly ``ceil(input_length / block_size)`` of them. Equal ids mean equal KV: an id stands for its whole
prefix (Mooncake remaps chained prefix hashes to small integers), so two requests share a run of leading ids
exactly as far as their prompts share leading blocks.

Mooncake's blocks are 512 tokens and its files do not say so; a trace recorded from this engine carries its page
size in a ``block_size`` field on every line (extra fields are ignored by Mooncake's own readers), and the reader
takes 512 where the field is absent, or the size its caller gives (``--block-size``). All lines of one file must
agree. Counts are integers (JSON ``true`` is not 1), and a file with no request is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: int  # ms since the trace's start (Mooncake: arrival; a recording: admission)
    input_length: int  # prompt tokens
    output_length: int
    hash_ids: tuple[int, ...]  # one id per block of the prompt, the last possibly partial


@dataclass(frozen=True)
class Trace:
    """A workload: requests in file order, and the tokens per block of their ``hash_ids``."""

    requests: tuple[TraceRequest, ...]
    block_size: int = MOONCAKE_BLOCK_SIZE
    name: str = "trace"

    def full_blocks(self, request: TraceRequest) -> int:
        """Blocks wholly filled by the prompt: the ones a prefix cache stores after the request."""
        return request.input_length // self.block_size

    def reusable_blocks(self, request: TraceRequest) -> int:
        """The most leading blocks a hit may serve: the last prompt token is always computed (for its logits), so
        a block that holds it cannot be served, as in vLLM."""
        return (request.input_length - 1) // self.block_size

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def read_trace(path: str | Path, block_size: int | None = None) -> Trace:
    """Read a trace file, checking every line (a ``ValueError`` names the line and what is wrong; a missing or
    unreadable file raises ``OSError``). ``block_size``: the tokens per block of a file that does not say (Mooncake's
    format of another block size); lines that say must agree with it. An empty trace is an error: it has no hit
    rate to report."""
    path = Path(path)
    if block_size is not None and not _is_count(block_size, 1):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    requests: list[TraceRequest] = []
    given = block_size
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
                size = row.get("block_size", MOONCAKE_BLOCK_SIZE if given is None else given)
                request = TraceRequest(
                    timestamp=row["timestamp"],
                    input_length=row["input_length"],
                    output_length=row["output_length"],
                    hash_ids=tuple(row["hash_ids"]),
                )
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"{where}: not a trace record ({error!r})") from error
            if not _is_count(size, 1):
                raise ValueError(f"{where}: block_size must be an integer >= 1, got {size!r}")
            if block_size is None:
                block_size = size
            elif size != block_size:
                said = "--block-size" if given is not None else "the trace's"
                raise ValueError(f"{where}: block_size {size}, but {said} is {block_size}")
            _check(request, block_size, where, explicit="block_size" in row or given is not None)
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no requests (an empty trace has no hit rate)")
    assert block_size is not None
    return Trace(tuple(requests), block_size, path.name)


def _is_count(value: object, low: int) -> bool:
    """An ``int`` (never a ``bool``, which Python counts as one) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check(request: TraceRequest, block_size: int, where: str, explicit: bool) -> None:
    for field, low in (("timestamp", 0), ("input_length", 1), ("output_length", 0)):
        value = getattr(request, field)
        if not _is_count(value, low):
            raise ValueError(f"{where}: {field} must be an integer >= {low}, got {value!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in request.hash_ids):
        raise ValueError(f"{where}: hash_ids must be integers")
    blocks = -(-request.input_length // block_size)
    if len(request.hash_ids) != blocks:
        hint = "" if explicit else f"; the file does not say its block size, so Mooncake's {block_size} was assumed"
        fix = ": give the trace's own (--block-size)" if hint else ""
        raise ValueError(
            f"{where}: {request.input_length} tokens are {blocks} blocks, but {len(request.hash_ids)} ids{hint}{fix}"
        )


def write_trace(path: str | Path, requests: Iterable[TraceRequest], block_size: int) -> None:
    """Write requests in the format ``read_trace`` reads, with ``block_size`` on every line."""
    with Path(path).open("w", encoding="utf-8") as out:
        for r in requests:
            row = {
                "timestamp": r.timestamp,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
                "block_size": block_size,
            }
            out.write(json.dumps(row) + "\n")
