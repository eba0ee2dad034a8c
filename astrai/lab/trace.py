"""The trace format: Mooncake's (FAST'25) JSON lines, one request a line, plus an optional ``block_size``.

Each line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}``.
``hash_ids`` name the prompt's blocks of ``block_size`` tokens in order, the last one possibly partial, so there
are exactly ``ceil(input_length / block_size)`` of them. Equal ids mean equal KV: an id stands for its whole
prefix (Mooncake remaps chained prefix hashes to small integers), so two requests share a run of leading ids
exactly as far as their prompts share leading blocks.

Mooncake's blocks are 512 tokens and its files do not say so; a trace recorded from this engine carries its page
size in a ``block_size`` field on every line (extra fields are ignored by Mooncake's own readers), and the reader
takes 512 where the field is absent. All lines of one file must agree.
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


def read_trace(path: str | Path) -> Trace:
    """Read a trace file, checking every line (a ``ValueError`` names the line and what is wrong)."""
    path = Path(path)
    requests: list[TraceRequest] = []
    block_size: int | None = None
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                size = row.get("block_size", MOONCAKE_BLOCK_SIZE)
                request = TraceRequest(
                    timestamp=row["timestamp"],
                    input_length=row["input_length"],
                    output_length=row["output_length"],
                    hash_ids=tuple(row["hash_ids"]),
                )
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
                raise ValueError(f"{path}:{number}: not a trace record ({error!r})") from error
            if block_size is None:
                block_size = size
            _check(request, size, block_size, f"{path}:{number}")
            requests.append(request)
    return Trace(tuple(requests), block_size or MOONCAKE_BLOCK_SIZE, path.name)


def _check(request: TraceRequest, size: object, block_size: int, where: str) -> None:
    if not isinstance(size, int) or size < 1 or size != block_size:
        raise ValueError(f"{where}: block_size {size!r}, but the trace's is {block_size}")
    if not isinstance(request.input_length, int) or request.input_length < 1:
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {request.input_length!r}")
    if not all(isinstance(i, int) for i in request.hash_ids):
        raise ValueError(f"{where}: hash_ids must be integers")
    blocks = -(-request.input_length // block_size)
    if len(request.hash_ids) != blocks:
        raise ValueError(f"{where}: {request.input_length} tokens are {blocks} blocks, but {len(request.hash_ids)} ids")


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
