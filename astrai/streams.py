"""What ``generate`` hands back: a stream of text deltas fed by the engine loop through a queue."""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable, Iterator
from typing import Any

POLL_SECONDS = 0.25  # how often a waiting consumer checks that the engine is still alive


class GenerationStream:
    """Iterates ``(index, delta)`` pairs (or plain deltas for a single prompt) as the engine produces them.

    Closing it, or dropping it, cancels its unfinished requests. A failed request raises its error here.
    """

    def __init__(
        self,
        request_ids: list[int],
        items: queue.SimpleQueue,
        cancel: Callable[[list[int]], None],
        check_alive: Callable[[], None],
        indexed: bool,
    ):
        self.request_ids = request_ids
        self._items = items
        self._cancel = cancel
        self._check_alive = check_alive
        self._indexed = indexed
        self._open = set(range(len(request_ids)))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while self._open:
            try:
                index, kind, payload = self._items.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._guard()
                continue
            if kind == "delta":
                return (index, payload) if self._indexed else payload
            self._open.discard(index)
            if kind == "error":
                self.close()
                raise payload
        raise StopIteration

    def _guard(self) -> None:
        try:
            self._check_alive()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Cancel whatever is still running; the engine releases its pages within one step."""
        if self._open:
            self._cancel([self.request_ids[i] for i in self._open])
            self._open.clear()

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the engine down already
            self.close()
