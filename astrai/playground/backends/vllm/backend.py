"""The playground attached to a vLLM server: the second implementation of the ``Backend`` protocol.

What it reads, and from where (every HTTP call has a timeout; nothing here can hang the app):

- **Runs**: one streaming ``/v1/completions`` request per panel, all at once on their own threads (so vLLM batches
  them), through the ``openai`` client with ``stream_options.include_usage`` (the last chunk's
  ``usage.prompt_tokens_details.cached_tokens`` is the prefix hit, with ``--enable-prompt-tokens-details``) and
  vLLM's ``return_token_ids`` (the prompt's and each delta's token ids). Closing a run closes its HTTP streams, and
  vLLM aborts those requests. TTFT and tok/s are measured here, by the client.
- **Counters**: ``/metrics`` (Prometheus text, ``vllm_metrics.parse_metrics``), sampled by a background thread about
  four times a second into ``StepSample``s. vLLM has no engine steps we can see, so a "step" here is a sample in
  which something changed; its ``page_changes`` come from the KV-event tracker, ``prefill_tokens`` /
  ``decode_tokens`` are ``None`` (not reported per step).
- **Pages and owners**: vLLM's KV-cache events (``vllm_events.KvEventSubscriber``), turned into pages with stable
  numbers and attributed to this app's requests by ``vllm_pages.BlockPages``. Cached-but-unused blocks in
  ``stats()`` are *derived* (blocks stored − removed − in use by ``kv_cache_usage_perc``), and say so
  (``derived``).

Faults: a server that is down, restarting or answering errors fails each panel with a message saying so; the
sampler notices, ``stats()`` raises ``BackendUnavailable`` (the UI says "backend unreachable"), and when the
server answers again ``generation`` grows and the event subscriber replays from the start: no app restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import queue
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from astrai.observation import (
    CacheSnapshot,
    CacheStats,
    EngineEvent,
    RequestInfo,
    StepSample,
)
from astrai.playground.backends.protocol import BackendUnavailable, RunFailed, chat_messages, format_prompt
from astrai.playground.backends.vllm.events import KvEventSubscriber, TrackerSnapshot
from astrai.playground.backends.vllm.metrics import MetricsParseError, VllmMetrics, parse_metrics
from astrai.playground.backends.vllm.pages import BlockPages
from astrai.sampling import SamplingParams

HTTP_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
METRICS_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
STREAM_TIMEOUT = httpx.Timeout(60.0, connect=3.0)  # read: the longest wait for the next chunk of a stream
SAMPLE_EVERY_S = 0.25
STALE_AFTER_S = 3.0  # stats() older than this: the sampler could not reach the server
HIT_WINDOW_S = 60.0
KEEP_REQUESTS = 4096
KEEP_EVENTS = 8192
KEEP_SAMPLES = 4096
MATCH_RECENT = 256  # the newest requests whose tokens attribute blocks to panels
MAX_CACHE_SALT = 128  # vLLM refuses longer salts, and '/', '@', '\\', NUL in them
_request_ids = itertools.count(1)  # synthetic request ids, unique in this process
_DONE = object()


class _Failure:
    def __init__(self, message: str, unavailable: bool):
        self.message, self.unavailable = message, unavailable


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


def cache_salt(salt: str) -> str:
    """vLLM's ``cache_salt`` for a playground salt (a session hash): a digest, within vLLM's length and charset."""
    return "astrai-" + hashlib.sha256(salt.encode()).hexdigest()[:40]


class VllmRun:
    """All panels of one submit, streaming concurrently; iterating yields ``(panel, delta)`` as they arrive."""

    def __init__(self, backend: VllmBackend, requests: list[_Request], payloads: list[dict[str, Any]]):
        self._backend = backend
        self._requests = requests
        self.request_ids = [r.id for r in requests]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = [threading.Event() for _ in requests]
        self._streams: list[Any] = [None] * len(requests)
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._stream, args=(i, payload), daemon=True, name=f"vllm-run {r.id}")
            for i, (r, payload) in enumerate(zip(requests, payloads, strict=True))
        ]
        for thread in self._threads:
            thread.start()

    def __iter__(self):
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
                raise BackendUnavailable(f"The vLLM server at {self._backend.url} is unavailable. {detail}")
            raise RunFailed(f"vLLM request failed. {detail}")

    def close(self, panels: list[int] | None = None) -> None:
        """Close the streams (vLLM aborts the requests). Safe from any thread, idempotent."""
        for i in range(len(self._requests)) if panels is None else panels:
            self._closed[i].set()
            with self._lock:
                stream = self._streams[i]
            if stream is not None:
                with contextlib.suppress(Exception):  # closing a stream another thread reads may raise
                    stream.close()

    def _stream(self, index: int, payload: dict[str, Any]) -> None:
        backend, request = self._backend, self._requests[index]
        closed = self._closed[index]
        finished = False
        try:
            if closed.is_set():
                return
            stream = backend._client.completions.create(**payload)
            with self._lock:
                self._streams[index] = stream
            if closed.is_set():
                stream.close()
                return
            for chunk in stream:
                if closed.is_set():
                    break
                finished = backend._on_chunk(request, chunk, index, self._queue) or finished
            if not finished and not closed.is_set():
                raise _StreamEnded("the stream ended before the request finished (server stopped?)")
        except Exception as exc:  # noqa: BLE001 - every failure becomes a per-panel message
            if not closed.is_set():
                message, unavailable = backend._describe(exc)
                backend._finish(request, "failed", message)
                self._queue.put((index, _Failure(message, unavailable)))
        finally:
            if closed.is_set():
                backend._finish(request, "cancelled")
            elif request.status not in ("failed", "finished"):
                backend._finish(request, "finished")
            with self._lock:
                stream, self._streams[index] = self._streams[index], None
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
            self._queue.put((index, _DONE))


class _StreamEnded(Exception):
    pass


class VllmBackend:
    """A vLLM OpenAI-compatible server as the playground's cache. Thread-safe; ``shutdown()`` stops its threads."""

    derived = frozenset({"cached_pages", "free_pages"})  # stats fields computed here, not reported by vLLM

    def __init__(
        self,
        url: str,
        kv_events: str | None = None,
        kv_replay: str | None = None,
        model_name: str | None = None,
        *,
        tokenizer: Any = None,
        subscriber: Any = None,
        sample_every_s: float = SAMPLE_EVERY_S,
    ):
        """``tokenizer`` / ``subscriber``: stand-ins for tests (a subscriber needs ``start``, ``stop``, ``resync``,
        ``snapshot`` and ``status``); by default the served model's tokenizer when its path exists here, and a
        ``KvEventSubscriber`` on ``kv_events`` when given."""
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--vllm-url must be an http(s) URL, got {url!r}")
        self._http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        self._client = openai.OpenAI(base_url=self.url + "/v1", api_key="EMPTY", max_retries=0, timeout=STREAM_TIMEOUT)
        self._lock = threading.Lock()  # guards everything below that the sampler and the stream threads share
        info = self._resolve_model(model_name)
        self.model: str = info["id"]
        self.max_model_len: int | None = info.get("max_model_len")
        self._tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(info.get("root"))
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer shared by Gradio's worker threads
        self._label = f"{self.model} (vLLM at {self.url})"
        self._generation = 1
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self._runs: dict[int, tuple[VllmRun, int]] = {}  # request id -> (its run, its panel)
        self._outcomes = {"finished": 0, "cancelled": 0, "failed": 0, "generated": 0}
        self._decoded: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._chat: dict[tuple[str, str], str] = {}
        # sampler state
        self._metrics: VllmMetrics | None = None
        self._metrics_at = 0.0
        self._unreachable: str | None = None
        self._step = 0
        self._seq = 0
        self._samples: deque[StepSample] = deque(maxlen=KEEP_SAMPLES)
        self._events: deque[EngineEvent] = deque(maxlen=KEEP_EVENTS)
        self._pages = BlockPages()
        self._last_counts: dict[str, float] = {}
        self._cursor: dict[int, int] = {}  # request id -> output tokens already put in a sample
        self._last_signature: tuple = ()
        if subscriber is None and kv_events:
            subscriber = KvEventSubscriber(kv_events, replay_endpoint=kv_replay, topic="")
        self._subscriber = subscriber
        if self._subscriber is not None:
            self._subscriber.start()
        self._stop = threading.Event()
        self._sample_every_s = sample_every_s
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True, name="vllm-sampler")
        self._tick()  # a first sample before the UI asks
        self._sampler.start()

    # ----- connection -----------------------------------------------------------------------------------------
    def _resolve_model(self, model_name: str | None) -> dict[str, Any]:
        try:
            response = self._http.get("/v1/models")
            response.raise_for_status()
            models = response.json().get("data", [])
        except (httpx.HTTPError, ValueError) as exc:
            if model_name:
                return {"id": model_name}  # the operator named it: start, and reconnect when the server is up
            raise BackendUnavailable(
                f"cannot list the models of the vLLM server at {self.url}: {exc}. Is it running? "
                "(pass --model-name to start without it)"
            ) from exc
        if model_name:
            for model in models:
                if model.get("id") == model_name:
                    return model
            names = ", ".join(m.get("id", "?") for m in models) or "none"
            raise ValueError(f"the vLLM server at {self.url} does not serve {model_name!r} (it serves: {names})")
        if len(models) != 1:
            names = ", ".join(m.get("id", "?") for m in models) or "none"
            raise ValueError(
                f"the vLLM server at {self.url} serves {len(models)} models ({names}): pick one with --model-name"
            )
        return models[0]

    @staticmethod
    def _load_tokenizer(root: str | None) -> Any:
        """The served model's tokenizer when its path exists here (same text and ids as the server); else None,
        and /tokenize, /detokenize answer instead."""
        if not root or not Path(root).is_dir():
            return None
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(root)
        except Exception:  # noqa: BLE001 - a tokenizer this transformers cannot read: fall back to the server
            return None

    def shutdown(self) -> None:
        self._stop.set()
        if self._subscriber is not None:
            self._subscriber.stop()
        if self._sampler.is_alive() and threading.current_thread() is not self._sampler:
            self._sampler.join(timeout=3)
        self._http.close()
        self._client.close()

    @property
    def label(self) -> str:
        return self._label

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def unreachable(self) -> str | None:
        """Why the server cannot be reached right now (None when it answers)."""
        with self._lock:
            return self._unreachable

    # ----- prompts and tokens ---------------------------------------------------------------------------------
    def format_prompt(self, prefix: str, prompt: str) -> str:
        """The same rule as ``LocalBackend``: a chat template when the model has one (the shared prefix as the
        system turn), else ``prefix + prompt``."""
        if self._tokenizer is not None:
            return format_prompt(self._tokenizer, prefix, prompt)
        messages = chat_messages(prefix, prompt)
        cached = self._chat.get((prefix, prompt))
        if cached is not None:
            return cached
        try:  # no local tokenizer: let the server apply its template (a model without one answers 4xx)
            response = self._http.post(
                "/tokenize", json={"model": self.model, "messages": messages, "add_generation_prompt": True}
            )
            if response.status_code >= 400:
                text = prefix + prompt
            else:
                tokens = response.json()["tokens"]
                text = self._detokenize(tokens)
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise BackendUnavailable(f"the vLLM server at {self.url} did not answer /tokenize: {exc}") from exc
        self._chat[(prefix, prompt)] = text
        return text

    def _encode(self, text: str) -> tuple[int, ...]:
        if self._tokenizer is None:
            return ()  # known from the first chunk (return_token_ids)
        with self._tokenizer_lock:
            return tuple(self._tokenizer(text)["input_ids"])

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        ids = tuple(token_ids)
        if self._tokenizer is not None:
            with self._tokenizer_lock:
                return self._tokenizer.decode(list(ids))
        with self._lock:
            if ids in self._decoded:
                return self._decoded[ids]
        try:
            text = self._detokenize(list(ids))
        except (httpx.HTTPError, KeyError, ValueError):
            return "?"  # a view must not fail because the server is away
        with self._lock:
            self._decoded[ids] = text
            while len(self._decoded) > 8192:
                self._decoded.popitem(last=False)
        return text

    def _detokenize(self, tokens: list[int]) -> str:
        response = self._http.post("/detokenize", json={"model": self.model, "tokens": tokens})
        response.raise_for_status()
        return response.json()["prompt"]

    def special_ids(self) -> set[int]:
        return set(self._tokenizer.all_special_ids) if self._tokenizer is not None else set()

    # ----- runs -----------------------------------------------------------------------------------------------
    def submit(self, prompts: list[str], params: SamplingParams, salt: str | None, share_cache: bool = True) -> VllmRun:
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("submit needs a non-empty list of prompts")
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"Panel {i + 1} has an empty prompt.")
        encoded = [self._encode(p) for p in prompts]
        if self.max_model_len:
            for i, ids in enumerate(encoded):
                if len(ids) + params.max_tokens > self.max_model_len:
                    raise ValueError(
                        f"Panel {i + 1}: {len(ids)} prompt tokens + {params.max_tokens} new tokens is over the "
                        f"server's max_model_len of {self.max_model_len}."
                    )
        if share_cache:
            salts = [cache_salt(salt) if salt else None] * len(prompts)
        else:  # nothing shared, not even within the batch
            salts = [f"astrai-nosharing-{uuid.uuid4().hex}" for _ in prompts]
        requests, payloads = [], []
        now = time.monotonic()
        for prompt, ids, request_salt in zip(prompts, encoded, salts, strict=True):
            rid = next(_request_ids)
            request = _Request(
                id=rid,
                vllm_id=f"astrai-{rid}-{uuid.uuid4().hex[:8]}",
                submitted=now,
                prompt_ids=ids,
                prompt_tokens=len(ids),
            )
            extra: dict[str, Any] = {"return_token_ids": True, "request_id": request.vllm_id}
            if params.top_k:
                extra["top_k"] = params.top_k
            if request_salt:
                extra["cache_salt"] = request_salt
            payload: dict[str, Any] = dict(
                model=self.model,
                prompt=prompt,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=extra,
            )
            if params.seed is not None:
                payload["seed"] = params.seed
            requests.append(request)
            payloads.append(payload)
        with self._lock:
            for request in requests:
                self._requests[request.id] = request
            while len(self._requests) > KEEP_REQUESTS:
                old, _ = self._requests.popitem(last=False)
                self._runs.pop(old, None)
                self._cursor.pop(old, None)
        run = VllmRun(self, requests, payloads)
        with self._lock:
            for panel, request in enumerate(requests):
                self._runs[request.id] = (run, panel)
        return run

    def _on_chunk(self, request: _Request, chunk: Any, index: int, out: queue.SimpleQueue) -> bool:
        """Apply one streamed chunk to its request; returns True when it carried the finish reason."""
        now = time.monotonic()
        finished = False
        text = ""
        with self._lock:
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
            out.put((index, text))
        return finished

    def _finish(self, request: _Request, status: str, error: str | None = None) -> None:
        with self._lock:
            if request.status in ("finished", "cancelled", "failed"):
                return
            request.status, request.error = status, error
            self._outcomes[status] += 1

    def _describe(self, exc: BaseException) -> tuple[str, bool]:
        """A visitor-facing message for a failed stream, and whether it means the server is unavailable."""
        if isinstance(exc, openai.APITimeoutError):
            return f"the vLLM server at {self.url} did not answer in time", True
        if isinstance(exc, openai.APIConnectionError):
            return f"cannot reach the vLLM server at {self.url} (connection refused or lost)", True
        if isinstance(exc, openai.APIStatusError):
            message = exc.message if isinstance(exc.message, str) else str(exc)
            return f"the vLLM server answered HTTP {exc.status_code}: {message[:300]}", exc.status_code in (
                502,
                503,
                504,
            )
        if isinstance(exc, (httpx.HTTPError, _StreamEnded)):
            reason = str(exc) or type(exc).__name__
            return f"the connection to the vLLM server at {self.url} broke mid-stream ({reason})", True
        return f"{type(exc).__name__}: {exc}", False

    def cancel(self, request_ids: list[int]) -> None:
        with self._lock:
            targets = [self._runs[r] for r in request_ids if r in self._runs]
        for run, panel in targets:
            run.close([panel])

    def clear(self) -> int:
        """``POST /reset_prefix_cache`` (vLLM serves it only in dev mode); returns the cached blocks it freed, as
        the events counted them."""
        before = self._tracker().cached_copies if self._subscriber is not None else 0
        try:
            response = self._http.post("/reset_prefix_cache")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"cannot reach the vLLM server at {self.url}: {exc}") from exc
        if response.status_code in (404, 405):
            raise RunFailed(
                "This vLLM server does not allow clearing its cache "
                "(start it with --dev-mode, i.e. VLLM_SERVER_DEV_MODE=1)."
            )
        if response.status_code >= 400:
            raise RunFailed(f"The vLLM server refused to clear its cache: HTTP {response.status_code}.")
        return before

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]:
        with self._lock:
            return [self._info(self._requests[r]) for r in request_ids if r in self._requests]

    @staticmethod
    def _info(r: _Request) -> RequestInfo:
        ttft = r.first_at - r.submitted if r.first_at is not None else None
        rate = None
        if r.first_at is not None and r.last_at is not None and r.last_at > r.first_at and r.generated > 1:
            rate = (r.generated - 1) / (r.last_at - r.first_at)
        return RequestInfo(
            id=r.id,
            status=r.status,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            generated_tokens=r.generated,
            preemptions=0,  # vLLM does not report a request's preemptions to its client
            prompt_ids=r.prompt_ids,
            output_ids=tuple(r.output_ids),
            ttft=ttft,
            tokens_per_s=rate,
            error=r.error,
        )

    # ----- observation ----------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            metrics, at, unreachable = self._metrics, self._metrics_at, self._unreachable
            step, outcomes = self._step, dict(self._outcomes)
            samples = [s for s in self._samples if s.time >= time.time() - HIT_WINDOW_S]
        if unreachable or metrics is None or time.monotonic() - at > STALE_AFTER_S:
            raise BackendUnavailable(unreachable or f"no answer from {self.url}/metrics for {STALE_AFTER_S:.0f} s")
        snap = self._tracker() if self._subscriber is not None else None
        n = metrics.num_blocks or 0
        used = round((metrics.kv_cache_usage or 0.0) * n)
        cached = max(0, snap.cached_copies - used) if snap is not None else None
        hits, queries = int(metrics.prefix_cache_hits or 0), int(metrics.prefix_cache_queries or 0)
        window_hits, window_queries = sum(s.hit_tokens for s in samples), sum(s.query_tokens for s in samples)
        return CacheStats(
            n_pages=n,
            page_size=metrics.block_size or (snap.block_size if snap else None) or 0,
            free_pages=max(0, n - used - cached) if cached is not None else None,
            used_pages=used,
            cached_pages=cached,
            query_tokens=queries,
            hit_tokens=hits,
            readmitted_query_tokens=None,
            readmitted_hit_tokens=None,
            hit_rate=hits / queries if queries else 0.0,
            recent_hit_rate=window_hits / window_queries if window_queries else (hits / queries if queries else 0.0),
            evictions=snap.removed_blocks if snap is not None else None,
            stored_pages=snap.stored_blocks if snap is not None else None,
            preemptions=int(metrics.preemptions or 0),
            running=int(metrics.running or 0),
            waiting=int(metrics.waiting or 0),
            finished=outcomes["finished"],  # this app's requests (vLLM's per-reason counters are not read)
            cancelled=outcomes["cancelled"],
            failed=outcomes["failed"],
            generated_tokens=outcomes["generated"],
            steps=step,
            prefix_caching=metrics.prefix_caching is not False,
        )

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            pages = self._pages.pages
            return CacheSnapshot(self._step, tuple(pages[p] for p in sorted(pages)))

    def events(self, after: int) -> list[EngineEvent]:
        with self._lock:
            return [e for e in self._events if e.seq > after]

    def history(self, after_step: int) -> list[StepSample]:
        with self._lock:
            return [s for s in self._samples if s.step > after_step]

    def subscriber_status(self) -> dict[str, Any] | None:
        return self._subscriber.status() if self._subscriber is not None else None

    def _tracker(self) -> TrackerSnapshot:
        assert self._subscriber is not None
        return self._subscriber.snapshot()

    # ----- the sampler ----------------------------------------------------------------------------------------
    def _sample_loop(self) -> None:
        while not self._stop.wait(self._sample_every_s):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the sampler must outlive any surprise
                with self._lock:
                    self._unreachable = f"sampler error: {type(exc).__name__}: {exc}"

    def _fetch_metrics(self) -> VllmMetrics:
        response = self._http.get("/metrics", timeout=METRICS_TIMEOUT)
        response.raise_for_status()
        return parse_metrics(response.text, model_name=self.model)

    def _tick(self) -> None:
        try:
            metrics = self._fetch_metrics()
        except (httpx.HTTPError, MetricsParseError) as exc:
            reason = f"cannot read {self.url}/metrics ({type(exc).__name__}: {exc})"
            with self._lock:
                self._unreachable = reason
            return
        snap = self._tracker() if self._subscriber is not None else None
        with self._lock:
            recovered = self._unreachable is not None and self._metrics is not None
            restarted = snap is not None and snap.restarts > self._pages.epoch[1]
            if recovered or restarted:
                self._generation += 1  # the cache behind us may be another one now
            self._unreachable = None
            self._metrics, self._metrics_at = metrics, time.monotonic()
        if recovered and self._subscriber is not None:
            self._subscriber.resync()
        self._record(metrics, snap)

    def _record(self, metrics: VllmMetrics, snap: TrackerSnapshot | None) -> None:
        """Turn the newest metrics and tracker state into events, pages and (when anything moved) a sample."""
        now = time.time()
        with self._lock:
            recent = list(self._requests.values())[-MATCH_RECENT:]
            changes, events = self._pages.update(snap, recent, now) if snap is not None else ([], [])
            counts = {
                "hits": metrics.prefix_cache_hits or 0.0,
                "queries": metrics.prefix_cache_queries or 0.0,
                "preemptions": metrics.preemptions or 0.0,
                "removed": float(snap.removed_blocks) if snap is not None else 0.0,
            }
            last = self._last_counts or counts
            delta = {k: counts[k] - last.get(k, 0.0) for k in counts}
            if any(v < 0 for v in delta.values()):  # a counter went back: the server restarted
                delta = dict.fromkeys(counts, 0.0)
            self._last_counts = counts
            sampled = []
            running = []
            for rid, request in self._requests.items():
                done = self._cursor.get(rid, 0)
                if len(request.output_ids) > done:
                    sampled += [(rid, t) for t in request.output_ids[done:]]
                    self._cursor[rid] = len(request.output_ids)
                if request.status in ("waiting", "running"):
                    running.append(rid)
            n = metrics.num_blocks or 0
            used = round((metrics.kv_cache_usage or 0.0) * n)
            cached = max(0, snap.cached_copies - used) if snap is not None else None
            signature = (used, cached, metrics.running, metrics.waiting, tuple(running))
            moved = changes or events or sampled or any(delta.values()) or signature != self._last_signature
            self._last_signature = signature
            if not moved:
                return
            previous = self._samples[-1].time if self._samples else now - self._sample_every_s
            self._step += 1
            step = self._step
            for event in events:
                self._seq += 1
                self._events.append(event(self._seq, step))
            self._samples.append(
                StepSample(
                    step=step,
                    time=now,
                    duration_s=max(0.0, now - previous),
                    free_pages=max(0, n - used - cached) if cached is not None else None,
                    used_pages=used,
                    cached_pages=cached,
                    prefill_tokens=None,
                    decode_tokens=None,
                    hit_tokens=int(delta["hits"]),
                    query_tokens=int(delta["queries"]),
                    evictions=int(delta["removed"]) if snap is not None else None,
                    preemptions=int(delta["preemptions"]),
                    requests=tuple(running),
                    sampled=tuple(sampled),
                    page_changes=tuple(changes),
                )
            )


__all__ = ["VllmBackend", "VllmRun", "cache_salt"]
