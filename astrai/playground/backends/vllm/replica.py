"""One vLLM server's cache as the playground observes it: its ``/metrics`` and KV events, sampled on a thread.

A single server is one ``Replica``; a fleet is several, each read directly (never through the router), so each
replica's page map, occupancy and hit rate are its own. The requests, their outcomes and the lock belong to the
backend that submits them (``backend.VllmBackend``): every replica's sampler reads the same requests, so a block
is attributed to this app's panel on whichever replica stored it.

Which replica served a request: each request is sent with ``session_id`` set to its vLLM request id, and vLLM
stamps that on every ``BlockStored`` the request causes (a store, or, in ``kv_cache_report_mode: full``, a report
of the cached blocks it reused). ``served`` answers from those events; a request shorter than one block stores
nothing and is not seen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import httpx

from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, StepSample
from astrai.playground.backends.protocol import BackendUnavailable, RunFailed
from astrai.playground.backends.vllm.run import _Request
from astrai.playground.backends.vllm.sampler import Clock, Sampler
from astrai.playground.backends.vllm.subscriber import KvEventSubscriber

HTTP_TIMEOUT = httpx.Timeout(5.0, connect=2.0)


class Replica:
    """One server's cache: ``stats``, ``snapshot``, ``events``, ``history`` and ``caveat`` as the ``Backend``
    protocol reads them, for this server alone. Thread-safe; ``shutdown()`` stops its threads."""

    def __init__(
        self,
        url: str,
        model: str,
        lock: threading.Lock,
        requests: OrderedDict[int, _Request],
        outcomes: dict[str, int],
        *,
        name: str,
        kv_events: str | None = None,
        kv_replay: str | None = None,
        subscriber: Any = None,
        sample_every_s: float,
        clock: Clock | None = None,
    ):
        """``subscriber``: a stand-in for tests (``start``, ``stop``, ``resync``, ``snapshot``, ``status`` and
        ``tracker.sessions_seen``); by default a ``KvEventSubscriber`` on ``kv_events`` when given."""
        self.url = url.rstrip("/")
        self.name = name
        self.http = httpx.Client(base_url=self.url, timeout=HTTP_TIMEOUT)
        if subscriber is None and kv_events:
            subscriber = KvEventSubscriber(kv_events, replay_endpoint=kv_replay, topic="")
        self.subscriber = subscriber
        if subscriber is not None:
            subscriber.start()
        self.sampler = Sampler(
            self.http, self.url, model, lock, requests, outcomes, subscriber, sample_every_s, clock=clock
        )

    @property
    def label(self) -> str:
        """How the UI names it: its name and where it is."""
        return f"{self.name} ({self.url.split('://', 1)[-1]})"

    def start(self) -> None:
        self.sampler.tick()  # a first sample before the UI asks
        self.sampler.start()

    def shutdown(self) -> None:
        self.sampler.stop()
        if self.subscriber is not None:
            self.subscriber.stop()
        self.http.close()

    @property
    def generation(self) -> int:
        return self.sampler.generation

    @property
    def steps(self) -> int:
        return self.sampler.steps

    @property
    def unreachable(self) -> str | None:
        return self.sampler.unreachable

    @property
    def caveat(self) -> str | None:
        return self.sampler.caveat()

    def stats(self) -> CacheStats:
        return self.sampler.stats()

    def snapshot(self) -> CacheSnapshot:
        return self.sampler.snapshot()

    def events(self, after: int) -> list[EngineEvent]:
        return self.sampler.events(after)

    def catch_up(self) -> None:
        self.sampler.catch_up()

    def history(self, after_step: int) -> list[StepSample]:
        return self.sampler.history(after_step)

    def answers(self) -> bool:
        """Whether its /health answers now (a quick probe, for a message about a run that just failed)."""
        try:
            return self.http.get("/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def served(self, session_ids: Iterable[str]) -> set[str]:
        """Those of ``session_ids`` whose blocks this server stored or reused, by its KV events (empty without)."""
        if self.subscriber is None:
            return set()
        return self.subscriber.tracker.sessions_seen(session_ids)

    def clear(self) -> int:
        """``POST /reset_prefix_cache`` (vLLM serves it only in dev mode); returns the cached blocks it freed, as
        the events counted them."""
        before = self.subscriber.snapshot().cached_copies if self.subscriber is not None else 0
        try:
            response = self.http.post("/reset_prefix_cache")
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


__all__ = ["Replica"]
