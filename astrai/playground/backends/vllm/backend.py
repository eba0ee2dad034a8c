"""The playground attached to a vLLM server: the second implementation of the ``Backend`` protocol.

Here: the connection (the served model from ``/v1/models``; its tokenizer, or the server's ``/tokenize`` and
``/detokenize`` through ``prompts``), input checks, and the ``Backend`` methods. Runs are ``run``'s (one streaming
``/v1/completions`` request per panel, all at once); counters, samples, pages and events are ``sampler``'s (from
``/metrics`` and the KV-event ``subscriber``); cached-but-unused blocks in ``stats()`` are *derived* (``derived``).

Every HTTP call has a timeout; nothing here can hang the app. Faults: a server that is down, restarting or
answering errors fails each panel with a message saying so; the sampler notices, ``stats()`` raises
``BackendUnavailable`` (the UI says "backend unreachable"), and when the server answers again as another process
(a restart, by ``/metrics``), ``generation`` grows and the event subscriber replays from the start: no app restart.

One lock (``_lock``) guards the requests, their outcomes and all the sampler keeps, for every thread.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx
import openai

from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.playground.backends.protocol import BackendUnavailable, RunFailed, format_prompt
from astrai.playground.backends.vllm.prompts import ServerText
from astrai.playground.backends.vllm.run import VllmRun, _Request, cache_salt, completion_payload
from astrai.playground.backends.vllm.sampler import SAMPLE_EVERY_S, Sampler
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber
from astrai.sampling import SamplingParams

HTTP_TIMEOUT = httpx.Timeout(5.0, connect=2.0)
STREAM_TIMEOUT = httpx.Timeout(60.0, connect=3.0)  # read: the longest wait for the next chunk of a stream
KEEP_REQUESTS = 4096
_request_ids = itertools.count(1)  # synthetic request ids, unique in this process


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
        self._lock = threading.Lock()  # guards what the sampler and the stream threads share (the module docstring)
        info = self._resolve_model(model_name)
        self.model: str = info["id"]
        self.max_model_len: int | None = info.get("max_model_len")
        self._tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer(info.get("root"))
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer shared by Gradio's worker threads
        self._label = f"{self.model} (vLLM at {self.url})"
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self._runs: dict[int, tuple[VllmRun, int]] = {}  # request id -> (its run, its panel)
        self._outcomes = {"finished": 0, "cancelled": 0, "failed": 0, "generated": 0}
        self._text = ServerText(self._http, self.url, self.model)  # /tokenize, /detokenize: no local tokenizer
        if subscriber is None and kv_events:
            subscriber = KvEventSubscriber(kv_events, replay_endpoint=kv_replay, topic="")
        self._subscriber = subscriber
        if self._subscriber is not None:
            self._subscriber.start()
        self._sampler = Sampler(
            self._http,
            self.url,
            self.model,
            self._lock,
            self._requests,
            self._outcomes,
            self._subscriber,
            sample_every_s,
        )
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
        self._sampler.stop()
        if self._subscriber is not None:
            self._subscriber.stop()
        self._http.close()
        self._client.close()

    @property
    def label(self) -> str:
        return self._label

    @property
    def generation(self) -> int:
        return self._sampler.generation

    @property
    def unreachable(self) -> str | None:
        """Why the server cannot be reached right now (None when it answers)."""
        return self._sampler.unreachable

    @property
    def caveat(self) -> str | None:
        """Why the page map may be incomplete now (a resync, or KV events missed); None when it is whole."""
        return self._sampler.caveat()

    # ----- prompts and tokens ---------------------------------------------------------------------------------
    def format_prompt(self, prefix: str, prompt: str) -> str:
        """The same rule as ``LocalBackend``: a chat template when the model has one (the shared prefix as the
        system turn), else ``prefix + prompt``. Without a local tokenizer the server applies it (``prompts``)."""
        if self._tokenizer is not None:
            return format_prompt(self._tokenizer, prefix, prompt)
        return self._text.chat(prefix, prompt)

    def _encode(self, text: str) -> tuple[int, ...]:
        if self._tokenizer is None:
            return ()  # known from the first chunk (return_token_ids)
        with self._tokenizer_lock:
            return tuple(self._tokenizer(text)["input_ids"])

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        if self._tokenizer is not None:
            with self._tokenizer_lock:
                return self._tokenizer.decode(list(token_ids))
        return self._text.decode(tuple(token_ids))

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
            request = _Request(rid, f"astrai-{rid}-{uuid.uuid4().hex[:8]}", now, prompt_ids=ids, prompt_tokens=len(ids))
            requests.append(request)
            payloads.append(completion_payload(self.model, prompt, params, request, request_salt))
        with self._lock:
            for request in requests:
                self._requests[request.id] = request
            while len(self._requests) > KEEP_REQUESTS:
                old, _ = self._requests.popitem(last=False)
                self._runs.pop(old, None)
                self._sampler.forget(old)
        run = VllmRun(self._client, self.url, self._lock, self._outcomes, requests, payloads)
        with self._lock:
            for panel, request in enumerate(requests):
                self._runs[request.id] = (run, panel)
        return run

    def cancel(self, request_ids: list[int]) -> None:
        with self._lock:
            targets = [self._runs[r] for r in request_ids if r in self._runs]
        for run, panel in targets:
            run.close([panel])

    def clear(self) -> int:
        """``POST /reset_prefix_cache`` (vLLM serves it only in dev mode); returns the cached blocks it freed, as
        the events counted them."""
        before = self._subscriber.snapshot().cached_copies if self._subscriber is not None else 0
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
            return [self._requests[r].info() for r in request_ids if r in self._requests]

    # ----- observation (the sampler's) ------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return self._sampler.stats()

    def snapshot(self) -> CacheSnapshot:
        return self._sampler.snapshot()

    def events(self, after: int) -> list[EngineEvent]:
        return self._sampler.events(after)

    def history(self, after_step: int) -> list[StepSample]:
        return self._sampler.history(after_step)

    def subscriber_status(self) -> dict[str, Any] | None:
        return self._subscriber.status() if self._subscriber is not None else None

    def _tick(self) -> None:
        """One sample now, on the caller's thread (the sampler's thread does the same every ``sample_every_s``)."""
        self._sampler.tick()


__all__ = ["VllmBackend"]
