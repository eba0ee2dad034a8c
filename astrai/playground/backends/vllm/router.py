"""vLLM's router (``vllm-router``, PyPI) in front of a fleet: where runs go, and what its metrics say.

The router is vLLM's own (Rust; policies ``round_robin``, ``cache_aware``, ``kv_aware``, ``power_of_two``,
``consistent_hash``, ...); the playground never routes by itself. It sends runs to a router's OpenAI endpoint and
reads the router's Prometheus metrics (its ``--prometheus-port``) for the fleet line:

- ``vllm_router_policy_decisions_total{policy, worker}``: the decisions, per replica;
- ``vllm_router_prefix_routing_decisions_total{policy, stage, outcome}``: how prefix-aware policies decided
  (``prefix_hit``, ``prefix_miss``; ``missing_tokens`` when a request came as text, which they cannot match);
- ``vllm_router_worker_health{worker}`` and ``vllm_router_running_requests{worker}``.

The router does not say which replica served a given request (its answer carries only ``x-request-id``), nor
which policy it runs before it has decided once: the operator may name it (``POLICY=URL``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from astrai.playground.backends.protocol import RouterMetrics

POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash")
METRICS_TTL_S = 1.0  # a router's metrics are read at most this often, however many visitors look
METRICS_TIMEOUT = httpx.Timeout(2.0, connect=1.0)


@dataclass(frozen=True)
class RouterSpec:
    """One router: where runs go (``url``), optionally the policy it runs and where its metrics are."""

    url: str
    policy: str | None = None
    metrics_url: str | None = None

    @classmethod
    def parse(cls, text: str, metrics_url: str | None = None) -> RouterSpec:
        """``[POLICY=]URL``: the operator's form (``cache_aware=http://127.0.0.1:8099``)."""
        policy, sep, url = text.partition("=")
        if not sep:
            policy, url = "", text
        if policy and policy not in POLICIES:
            raise ValueError(f"--router-url {text!r}: unknown policy {policy!r} (one of {', '.join(POLICIES)})")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--router-url {text!r}: expected [POLICY=]http(s)://HOST:PORT")
        return cls(url.rstrip("/"), policy or None, metrics_url.rstrip("/") if metrics_url else None)


def parse_router_metrics(text: str) -> RouterMetrics:
    decisions: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    healthy: dict[str, bool] = {}
    running: dict[str, int] = {}
    policies: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            worker = labels.get("worker", "").rstrip("/")
            if sample.name == "vllm_router_policy_decisions_total":
                decisions[worker] = decisions.get(worker, 0) + int(value)
                policies.add(labels.get("policy", ""))
            elif sample.name == "vllm_router_prefix_routing_decisions_total":
                outcome = labels.get("outcome", "?")
                outcomes[outcome] = outcomes.get(outcome, 0) + int(value)
            elif sample.name == "vllm_router_worker_health":
                healthy[worker] = value > 0
            elif sample.name == "vllm_router_running_requests":
                running[worker] = int(value)
    return RouterMetrics(decisions, outcomes, healthy, running, frozenset(policies - {""}))


class Router:
    """A router as the fleet uses it: its policy, and its metrics read at most once a ``METRICS_TTL_S``."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self._lock = threading.Lock()
        self._metrics: RouterMetrics | None = None
        self._read_at = float("-inf")
        self._http = httpx.Client(timeout=METRICS_TIMEOUT) if spec.metrics_url else None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def policy(self) -> str:
        """The operator's name for it, else what its metrics say, else "unknown" (it has not decided yet)."""
        if self.spec.policy:
            return self.spec.policy
        metrics = self.metrics()
        return ", ".join(sorted(metrics.policies)) if metrics and metrics.policies else "unknown policy"

    def metrics(self) -> RouterMetrics | None:
        """Its metrics, at most ``METRICS_TTL_S`` old; None without a metrics URL or while it does not answer."""
        if self._http is None:
            return None
        with self._lock:  # one reader scrapes; the others meanwhile get the last answer, never wait for it
            if time.monotonic() - self._read_at < METRICS_TTL_S:
                return self._metrics
            self._read_at = time.monotonic()
        try:
            response = self._http.get(f"{self.spec.metrics_url}/metrics")
            response.raise_for_status()
            metrics: RouterMetrics | None = parse_router_metrics(response.text)
        except (httpx.HTTPError, ValueError):
            metrics = None
        with self._lock:
            self._metrics = metrics
            return metrics

    def close(self) -> None:
        if self._http is not None:
            self._http.close()


__all__ = ["POLICIES", "Router", "RouterSpec", "parse_router_metrics"]
