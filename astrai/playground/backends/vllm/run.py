"""One submit's panels, streaming from a vLLM server at once: what this client sees of each request, and how.

Each panel is one streaming ``/v1/completions`` request on a thread of its own, all started together so that vLLM
batches them, through the ``openai`` client with ``stream_options.include_usage`` (the last chunk's
``usage.prompt_tokens_details.cached_tokens`` is the prefix hit, with ``--enable-prompt-tokens-details``) and vLLM's
``return_token_ids`` (the prompt's and each delta's token ids). TTFT and tok/s are measured here, by the client.

Invariants:

- A ``_Request`` is written only by its stream thread, under the lock the backend shares with its sampler, so a
  sample or ``request_info`` never sees half a chunk applied.
- A request ends once: ``finished``, ``cancelled`` or ``failed``, counted once in the shared ``outcomes``.
- Every stream thread puts exactly one ``_DONE`` on the run's queue, last, whatever happened: iteration ends when
  every panel has, and raises only then, with every panel's failure in one message.
- Closing a panel closes its HTTP stream, and vLLM aborts that request; a panel closed before its stream ended
  ends ``cancelled``, not ``failed``.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai

from astrai.observation import RequestInfo
from astrai.playground.backends.protocol import BackendUnavailable, RunFailed
from astrai.sampling import SamplingParams

_DONE = object()


class _Failure:
    def __init__(self, message: str, unavailable: bool):
        self.message, self.unavailable = message, unavailable


class _StreamEnded(Exception):
    pass


@dataclass
class _Request:
    """One panel's request, as this client sees it. Written by its stream thread under the backend's lock."""

    id: int
    vllm_id: str
    submitted: float  # time.monotonic()
    prompt_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting -> running -> finished | cancelled | failed
    cached_tokens: int | None = None
    prompt_tokens: int = 0
    generated: int = 0
    first_at: float | None = None
    last_at: float | None = None
    error: str | None = None

    def info(self) -> RequestInfo:
        """The request as the playground reads it; the caller holds the backend's lock."""
        first, last = self.first_at, self.last_at
        ttft = first - self.submitted if first is not None else None
        rate = None
        if first is not None and last is not None and last > first and self.generated > 1:
            rate = (self.generated - 1) / (last - first)
        return RequestInfo(
            id=self.id,
            status=self.status,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            generated_tokens=self.generated,
            preemptions=0,  # vLLM does not report a request's preemptions to its client
            prompt_ids=self.prompt_ids,
            output_ids=tuple(self.output_ids),
            ttft=ttft,
            tokens_per_s=rate,
            error=self.error,
        )


def cache_salt(salt: str) -> str:
    """vLLM's ``cache_salt`` for a playground salt (a session hash): a digest, within vLLM's length and charset."""
    return "astrai-" + hashlib.sha256(salt.encode()).hexdigest()[:40]


def completion_payload(
    model: str, prompt: str, params: SamplingParams, request: _Request, salt: str | None, routed: bool = False
) -> dict[str, Any]:
    """The ``completions.create`` arguments of one panel: streamed with usage and token ids, with the request's
    ``vllm_id`` as vLLM's ``request_id`` and as its ``session_id`` (vLLM stamps it on the KV events the request
    causes), and ``salt`` (when given) as its ``cache_salt``.

    ``routed`` (through vLLM's router, to a fleet): the prompt goes as its token ids when they are known, since the
    router's prefix-aware policies match tokens and skip a text prompt ("missing_tokens"); and the request asks
    for ``kv_cache_report_mode: full``, so the replica that serves it names it in its events even when every block
    it needs was cached (a reuse report), which is how a panel learns its replica."""
    extra: dict[str, Any] = {"return_token_ids": True, "request_id": request.vllm_id, "session_id": request.vllm_id}
    if params.top_k:
        extra["top_k"] = params.top_k
    if salt:
        extra["cache_salt"] = salt
    if routed:
        extra["vllm_xargs"] = {"kv_cache_report_mode": "full"}
    payload: dict[str, Any] = dict(
        model=model,
        prompt=list(request.prompt_ids) if routed and request.prompt_ids else prompt,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    if params.seed is not None:
        payload["seed"] = params.seed
    return payload


class VllmRun:
    """All panels of one submit, streaming concurrently; iterating yields ``(panel, delta)`` as they arrive.

    ``lock`` and ``outcomes`` are the backend's: the lock guards ``requests`` and ``outcomes`` (the counts of ended
    requests and generated tokens, which ``stats()`` reports), both shared with the backend's sampler.
    """

    def __init__(
        self,
        client: openai.OpenAI,
        url: str,
        lock: threading.Lock,
        outcomes: dict[str, int],
        requests: list[_Request],
        payloads: list[dict[str, Any]],
        where: Callable[[_Request], str | None] | None = None,
        routed: bool = False,
        on_end: Callable[[int], None] | None = None,
    ):
        """``routed``: ``url`` is a router's. ``where``: for a fleet, words on where a failed request ran (its
        replica, and which replicas do not answer now), added to its panel's message. ``on_end``: called with a
        request's id on its stream's thread once it has ended, before its panel is told it is done."""
        self._client, self._where, self._on_end = client, where, on_end
        self._peer = f"vLLM's router at {url}" if routed else f"the vLLM server at {url}"
        self._routed = routed
        self._state_lock, self._outcomes = lock, outcomes
        self._requests = requests
        self.request_ids = [r.id for r in requests]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = [threading.Event() for _ in requests]
        self._streams: list[Any] = [None] * len(requests)
        self._streams_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._stream, args=(i, payload), daemon=True, name=f"vllm-run {r.id}")
            for i, (r, payload) in enumerate(zip(requests, payloads, strict=True))
        ]
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> Iterator[tuple[int, str]]:
        pending, failures = len(self._threads), {}
        while pending:
            try:
                index, item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if not any(t.is_alive() for t in self._threads) and self._queue.empty():
                    break  # defensive: every thread is gone
                continue
            if item is _DONE:
                pending -= 1
            elif isinstance(item, _Failure):
                failures[index] = item
            else:
                yield index, item
        if failures:
            detail = "; ".join(f"panel {i + 1}: {f.message}" for i, f in sorted(failures.items()))
            if all(f.unavailable for f in failures.values()):
                raise BackendUnavailable(f"{self._peer[0].upper()}{self._peer[1:]} is unavailable. {detail}")
            raise RunFailed(f"vLLM request failed. {detail}")

    def close(self, panels: list[int] | None = None) -> None:
        """Close the streams (vLLM aborts the requests). Safe from any thread, idempotent."""
        for i in range(len(self._requests)) if panels is None else panels:
            self._closed[i].set()
            with self._streams_lock:
                stream = self._streams[i]
            if stream is not None:
                with contextlib.suppress(Exception):  # closing a stream another thread reads may raise
                    stream.close()

    def _stream(self, index: int, payload: dict[str, Any]) -> None:
        request = self._requests[index]
        closed = self._closed[index]
        finished = started = False
        try:
            if closed.is_set():
                return
            stream = self._client.completions.create(**payload)
            started = True
            with self._streams_lock:
                self._streams[index] = stream
            if closed.is_set():
                stream.close()
                return
            for chunk in stream:
                if closed.is_set():
                    break
                finished = self._on_chunk(request, chunk, index) or finished
            if not finished and not closed.is_set():
                raise _StreamEnded("the stream ended before the request finished (server stopped?)")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a per-panel message
            if not closed.is_set():
                message, unavailable = self._describe(exc, started)
                if self._where is not None and (where := self._where(request)):
                    message += f"; {where}"
                self._finish(request, "failed", message)
                self._queue.put((index, _Failure(message, unavailable)))
        finally:
            if closed.is_set():
                self._finish(request, "cancelled")
            elif request.status not in ("failed", "finished"):
                self._finish(request, "finished")
            with self._streams_lock:
                stream, self._streams[index] = self._streams[index], None
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
            try:
                if self._on_end is not None:
                    self._on_end(request.id)
            finally:  # the panel is told it is done whatever ``on_end`` does
                self._queue.put((index, _DONE))

    def _on_chunk(self, request: _Request, chunk: Any, index: int) -> bool:
        """Apply one streamed chunk to its request; returns True when it carried the finish reason."""
        now = time.monotonic()
        finished = False
        text = ""
        with self._state_lock:
            for choice in chunk.choices or []:
                prompt_ids = getattr(choice, "prompt_token_ids", None)
                if prompt_ids:
                    request.prompt_ids = tuple(prompt_ids)
                    request.prompt_tokens = len(prompt_ids)
                token_ids = getattr(choice, "token_ids", None)
                if token_ids:
                    request.output_ids.extend(token_ids)
                    request.generated += len(token_ids)
                    self._outcomes["generated"] += len(token_ids)
                text += choice.text or ""
                if token_ids or choice.text:
                    if request.first_at is None:
                        request.first_at = now
                    request.last_at = now
                    request.status = "running"
                if choice.finish_reason is not None:
                    finished = True
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                request.prompt_tokens = usage.prompt_tokens or request.prompt_tokens
                details = getattr(usage, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", None) if details is not None else None
                request.cached_tokens = cached if cached is not None else request.cached_tokens
                if usage.completion_tokens is not None and usage.completion_tokens > request.generated:
                    self._outcomes["generated"] += usage.completion_tokens - request.generated
                    request.generated = usage.completion_tokens
        if text:
            self._queue.put((index, text))
        return finished

    def _finish(self, request: _Request, status: str, error: str | None = None) -> None:
        with self._state_lock:
            if request.status in ("finished", "cancelled", "failed"):
                return
            request.status, request.error = status, error
            self._outcomes[status] += 1

    def _describe(self, exc: BaseException, started: bool) -> tuple[str, bool]:
        """A visitor-facing message for a failed stream, and whether it means the server is unavailable.
        ``started``: the server had answered the request (a connection error is then a break mid-stream, not a
        server that cannot be reached: openai wraps both in ``APIConnectionError``)."""
        if isinstance(exc, openai.APITimeoutError):
            return f"{self._peer} did not answer in time", True
        if isinstance(exc, openai.APIConnectionError) and started:
            # through a router, the router answered: what went away is the replica behind it (``where`` names it)
            return f"the connection to {self._peer} broke mid-stream ({exc.__cause__ or exc})", not self._routed
        if isinstance(exc, openai.APIConnectionError):
            return f"cannot reach {self._peer} (connection refused, or lost before it answered)", True
        if isinstance(exc, openai.APIStatusError):
            message = exc.message if isinstance(exc.message, str) else str(exc)
            return f"the vLLM server answered HTTP {exc.status_code}: {message[:300]}", exc.status_code in (
                502,
                503,
                504,
            )
        if isinstance(exc, _StreamEnded):
            reason = str(exc) or type(exc).__name__
            return f"the connection to {self._peer} broke mid-stream ({reason})", True
        return f"{type(exc).__name__}: {exc}", False


__all__ = ["VllmRun", "cache_salt", "completion_payload"]
