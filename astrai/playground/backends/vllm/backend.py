"""The playground attached to vLLM: the second implementation of the ``Backend`` protocol.

One server, or a fleet: several replicas behind vLLM's own router (``vllm-router``). Here: the connection (the
served model from ``/v1/models``; its tokenizer, or the server's ``/tokenize`` and ``/detokenize`` through
``prompts``), input checks, and the ``Backend`` methods. Runs are ``run``'s (one streaming ``/v1/completions``
request per panel, all at once), sent to the server, or to a router. Each server's cache is a ``replica.Replica``
(its ``/metrics`` and KV events, sampled), read directly, never through the router; a fleet's replicas seen as
one cache are ``fleet``'s. Cached-but-unused blocks in ``stats()`` are *derived* (``derived``).

Every HTTP call has a timeout; nothing here can hang the app. Faults: a server that is down, restarting or
answering errors fails each of its panels with a message saying so; its sampler notices, and ``stats()`` raises
``BackendUnavailable`` (the UI says "backend unreachable") once no replica answers. When a server answers again as
another process (a restart, by ``/metrics``), its ``generation`` grows and its event subscriber replays from the
start: no app restart.

One lock (``_lock``) guards the requests, their outcomes and all the samplers keep, for every thread.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from astrai.explain import Explanation
from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.playground.backends.protocol import Served, format_prompt
from astrai.playground.backends.vllm import fleet
from astrai.playground.backends.vllm.explaining import ServerKeys
from astrai.playground.backends.vllm.prompts import ServerText, load_tokenizer, resolve_model
from astrai.playground.backends.vllm.replica import HTTP_TIMEOUT, Replica
from astrai.playground.backends.vllm.router import Router, RouterSpec
from astrai.playground.backends.vllm.run import VllmRun, _Request, cache_salt, completion_payload
from astrai.playground.backends.vllm.sampler import SAMPLE_EVERY_S, Clock
from astrai.sampling import SamplingParams

# openai's own Timeout: the client is built on httpx2, which refuses httpx's (tests/test_vllm_client.py)
STREAM_TIMEOUT = openai.Timeout(60.0, connect=3.0)  # read: the longest wait for the next chunk of a stream
KEEP_REQUESTS = 4096
_request_ids = itertools.count(1)  # synthetic request ids, unique in this process


@dataclass(frozen=True)
class ReplicaSpec:
    """One server to observe: its URL, and its KV-event endpoints (publisher and replay) when it has them."""

    url: str
    kv_events: str | None = None
    kv_replay: str | None = None


class VllmBackend:
    """vLLM as the playground's cache: one OpenAI-compatible server, or a fleet of replicas behind vLLM's router
    (``VllmBackend.fleet``). Thread-safe; ``shutdown()`` stops its threads."""

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
        """One server. ``tokenizer`` / ``subscriber``: stand-ins for tests (a subscriber needs ``start``, ``stop``,
        ``resync``, ``snapshot``, ``status`` and ``tracker``); by default the served model's tokenizer when its path
        exists here, and a ``KvEventSubscriber`` on ``kv_events`` when given."""
        self._start([ReplicaSpec(url, kv_events, kv_replay)], [], model_name, tokenizer, [subscriber], sample_every_s)

    @classmethod
    def fleet(
        cls,
        replicas: Sequence[ReplicaSpec],
        routers: Sequence[RouterSpec],
        model_name: str | None = None,
        *,
        tokenizer: Any = None,
        subscribers: Sequence[Any] | None = None,
        sample_every_s: float = SAMPLE_EVERY_S,
    ) -> VllmBackend:
        """Replicas behind one or more routers: runs go through the first router (or the one a run names), each
        replica is observed directly. ``subscribers``: stand-ins for tests, one per replica."""
        if not replicas:
            raise ValueError("a fleet needs its replicas' URLs (--vllm-url, once per replica)")
        if not routers:
            raise ValueError("several --vllm-url need a --router-url: runs go through vLLM's router (vllm-router)")
        backend = cls.__new__(cls)
        backend._start(replicas, routers, model_name, tokenizer, subscribers or [None] * len(replicas), sample_every_s)
        return backend

    def _start(
        self,
        replicas: Sequence[ReplicaSpec],
        routers: Sequence[RouterSpec],
        model_name: str | None,
        tokenizer: Any,
        subscribers: Sequence[Any],
        sample_every_s: float,
    ) -> None:
        for url in [*(r.url for r in replicas), *(r.url for r in routers)]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--vllm-url / --router-url must be an http(s) URL, got {url!r}")
        self._routers = [Router(spec) for spec in routers]
        # runs go to the (first) router, or to the one server; the model and its text come from there too
        self.url = (self._routers[0].url if self._routers else replicas[0].url).rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        self._client = self._openai(self.url)
        self._router_clients = [self._openai(router.url) for router in self._routers]
        self._lock = threading.Lock()  # guards what the samplers and the stream threads share (the module docstring)
        info = resolve_model(self._http, self.url, model_name)
        self.model: str = info["id"]
        self.max_model_len: int | None = info.get("max_model_len")
        self._tokenizer = tokenizer if tokenizer is not None else load_tokenizer(info.get("root"))
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer shared by Gradio's worker threads
        where = f"{len(replicas)} replicas behind vLLM's router at {self.url}" if self._routers else self.url
        self._label = f"{self.model} (vLLM at {where})"
        self._requests: OrderedDict[int, _Request] = OrderedDict()
        self._runs: dict[int, tuple[VllmRun, int]] = {}  # request id -> (its run, its panel)
        self._outcomes = {"finished": 0, "cancelled": 0, "failed": 0, "generated": 0}
        self._text = ServerText(self._http, self.url, self.model)  # /tokenize, /detokenize: no local tokenizer
        clock = Clock()  # one order for every replica's samples and events
        self._replicas = [
            Replica(
                spec.url,
                self.model,
                self._lock,
                self._requests,
                self._outcomes,
                name=f"replica {i + 1}" if len(replicas) > 1 else "the server",
                kv_events=spec.kv_events,
                kv_replay=spec.kv_replay,
                subscriber=subscriber,
                sample_every_s=sample_every_s,
                clock=clock,
            )
            for i, (spec, subscriber) in enumerate(zip(replicas, subscribers, strict=True))
        ]
        for replica in self._replicas:
            replica.start()
        self._observed = fleet.Replicas(self._replicas)
        self._keys = ServerKeys(self._replicas)

    @staticmethod
    def _openai(url: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0, timeout=STREAM_TIMEOUT)

    # ----- connection -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for replica in self._replicas:
            replica.shutdown()
        for router in self._routers:
            router.close()
        for client in (self._client, *self._router_clients):
            client.close()
        self._http.close()

    @property
    def label(self) -> str:
        return self._label

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """A fleet's replicas, each observed on its own; () for one server (it is the backend's whole cache)."""
        return tuple(self._replicas) if len(self._replicas) > 1 else ()

    @property
    def routers(self) -> tuple[Router, ...]:
        return tuple(self._routers)

    @property
    def generation(self) -> int:
        return self._observed.generation

    @property
    def steps(self) -> int:
        return self._observed.steps

    @property
    def unreachable(self) -> str | None:
        """Why the server cannot be reached right now (None when it answers; for a fleet, when any answers)."""
        return self._observed.unreachable

    @property
    def caveat(self) -> str | None:
        """Why the page map may be incomplete now (a resync, KV events missed, a replica away); None when whole."""
        return self._observed.caveat

    @property
    def _subscriber(self) -> Any:
        """The one server's event subscriber (tests read it)."""
        return self._replicas[0].subscriber

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

    def decode(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is not None:
            with self._tokenizer_lock:
                return str(self._tokenizer.decode(list(token_ids)))
        return self._text.decode(tuple(token_ids))

    def special_ids(self) -> set[int]:
        return set(self._tokenizer.all_special_ids) if self._tokenizer is not None else set()

    # ----- runs -----------------------------------------------------------------------------------------------
    def submit(
        self,
        prompts: list[str],
        params: SamplingParams,
        salt: str | None,
        share_cache: bool = True,
        router: int | None = None,
    ) -> VllmRun:
        """``router``: which of ``routers`` the run goes through (a fleet; by default the first)."""
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("submit needs a non-empty list of prompts")
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"Panel {i + 1} has an empty prompt.")
        if router is not None and not 0 <= router < len(self._routers):
            raise ValueError(f"router {router}: this backend has {len(self._routers)} router(s)")
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
            payloads.append(
                completion_payload(self.model, prompt, params, request, request_salt, routed=bool(self._routers))
            )
        self._keys.sent([r.id for r in requests])
        with self._lock:
            for request in requests:
                self._requests[request.id] = request
            while len(self._requests) > KEEP_REQUESTS:
                old, _ = self._requests.popitem(last=False)
                self._runs.pop(old, None)
                self._keys.forget(old)
                for replica in self._replicas:
                    replica.sampler.forget(old)
        client, url = self._client, self.url
        if router is not None:
            client, url = self._router_clients[router], self._routers[router].url
        where = self._where if len(self._replicas) > 1 else None
        run = VllmRun(
            client,
            url,
            self._lock,
            self._outcomes,
            requests,
            payloads,
            where,
            routed=bool(self._routers),
            on_end=self._keys.ended,
        )
        with self._lock:
            for panel, request in enumerate(requests):
                self._runs[request.id] = (run, panel)
        return run

    def _where(self, request: _Request) -> str | None:
        """Where a failed request of a fleet ran, as far as the replicas' events tell, and which replicas do not
        answer now: the panel's message names the replica that went away."""
        served = self._observed.served_by([request.vllm_id]).get(request.vllm_id)
        down = [r.label for r in self._replicas if not r.answers()]
        ran = f"it ran on {served.replica} (by its KV events)" if served else "its replica is not known"
        return f"{ran}; not answering now: {', '.join(down)}" if down else ran

    def cancel(self, request_ids: list[int]) -> None:
        with self._lock:
            targets = [self._runs[r] for r in request_ids if r in self._runs]
        for run, panel in targets:
            run.close([panel])

    def clear(self) -> int:
        """``POST /reset_prefix_cache`` on every replica (vLLM serves it only in dev mode); returns the cached
        blocks freed, as the events counted them."""
        return sum(replica.clear() for replica in self._replicas)

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]:
        with self._lock:
            return [self._requests[r].info() for r in request_ids if r in self._requests]

    def served_by(self, request_ids: list[int]) -> dict[int, Served]:
        """Which replica served each request, where its KV events tell (a fleet; {} for one server)."""
        with self._lock:
            sessions = {self._requests[r].vllm_id: r for r in request_ids if r in self._requests}
        return {sessions[session]: served for session, served in self._observed.served_by(sessions).items()}

    def explain(self, request_ids: list[int], viewer_owns: Callable[[int | None], bool]) -> list[Explanation]:
        """Each request's prompt tokens with their causes, judged as of when it was sent (``explaining.py``)."""
        infos = self.request_info(request_ids)
        index = {replica.name: i for i, replica in enumerate(self._replicas)}
        served = {
            rid: index[name]
            for rid, where in self.served_by(request_ids).items()
            if (name := where.replica.split(" (")[0]) in index
        }
        page_size = self.stats().page_size or 1
        return self._keys.explain(infos, page_size, viewer_owns, served)

    # ----- observation: the one server's, or the replicas' seen as one cache (``fleet``) ------------------------
    def stats(self) -> CacheStats:
        return self._observed.stats()

    def snapshot(self) -> CacheSnapshot:
        return self._observed.snapshot()

    def events(self, after: int) -> list[EngineEvent]:
        return self._observed.events(after)

    def history(self, after_step: int) -> list[StepSample]:
        return self._observed.history(after_step)

    def subscriber_status(self) -> dict[str, Any] | None:
        """The one server's event subscriber, as it reports itself (None without KV events)."""
        subscriber = self._replicas[0].subscriber
        return subscriber.status() if subscriber is not None else None

    def _tick(self) -> None:
        """One sample of every replica now, on the caller's thread (their samplers do the same every
        ``sample_every_s``)."""
        for replica in self._replicas:
            replica.sampler.tick()


__all__ = ["ReplicaSpec", "VllmBackend"]
