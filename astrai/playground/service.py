"""The one engine every visitor shares, plus what the dashboards need around it.

It owns model loading and engine rebuilds, remembers which session and panel each request belongs to (so a
visitor's page map can hide other visitors' text), and samples the cache's counters into a short history that
the charts draw.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from astrai import InferenceEngine

log = logging.getLogger("astrai.playground")

EMBEDDED_MODEL = os.environ.get(
    "ASTRAI_EMBEDDED_MODEL", str(Path(__file__).resolve().parents[2] / "assets" / "models" / "tinystories-llama")
)
EMBEDDED_LABEL = "tinystories-llama (embedded, offline)"
MODEL_CHOICES = {
    EMBEDDED_LABEL: EMBEDDED_MODEL,
    "SmolLM2-135M-Instruct (hub)": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "Qwen2.5-0.5B-Instruct (hub)": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen3-0.6B (hub)": "Qwen/Qwen3-0.6B",
}
HISTORY_POINTS = 240  # samples kept for the time-series charts
SAMPLE_SECONDS = 0.5


@dataclass(frozen=True)
class EngineSettings:
    page_size: int = 16
    n_pages: int = 256
    max_batch_size: int = 8
    prefix_caching: bool = True
    dtype: str = "float32"

    def validate(self) -> None:
        if self.page_size not in (4, 8, 16, 32, 64):
            raise ValueError("page size must be one of 4, 8, 16, 32, 64")
        if not 8 <= self.n_pages <= 4096:
            raise ValueError("pool size must be between 8 and 4096 pages")
        if not 1 <= self.max_batch_size <= 32:
            raise ValueError("max batch must be between 1 and 32")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError("dtype must be float32 or bfloat16")


@dataclass
class Owner:
    session: str
    panel: int


@dataclass
class Sample:
    time: float
    used: int
    cached: int
    free: int
    hit_rate: float
    recent_hit_rate: float
    evictions: int


@dataclass
class EngineService:
    """Thread-safe holder of the shared engine. Swapping the engine never loses the old one on failure."""

    model_label: str = EMBEDDED_LABEL
    settings: EngineSettings = field(default_factory=EngineSettings)
    engine: InferenceEngine | None = None
    owners: dict[int, Owner] = field(default_factory=dict)
    origins: dict[int, int] = field(default_factory=dict)  # cached page -> the request that stored it
    history: deque[Sample] = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def start(self) -> EngineService:
        self.engine = self._build(self.model_label, self.settings)
        threading.Thread(target=self._sample_loop, name="astrai-playground-sampler", daemon=True).start()
        return self

    def _build(self, label: str, settings: EngineSettings) -> InferenceEngine:
        settings.validate()
        if label not in MODEL_CHOICES:
            raise ValueError(f"unknown model {label!r}")
        return InferenceEngine.from_pretrained(
            MODEL_CHOICES[label],
            page_size=settings.page_size,
            n_pages=settings.n_pages,
            max_batch_size=settings.max_batch_size,
            prefix_caching=settings.prefix_caching,
            dtype=settings.dtype,
            on_event=self._on_event,
        )

    def _on_event(self, event: dict) -> None:
        """Runs on the engine loop: remember who stored each cached page, so only they see its text."""
        kind = event["kind"]
        if kind == "page_stored":
            self.origins[event["page"]] = event["request"]
        elif kind == "page_evicted":
            self.origins.pop(event["page"], None)
        elif kind == "cache_cleared":
            self.origins.clear()

    def rebuild(self, label: str, settings: EngineSettings) -> None:
        """Load a model or apply settings. On failure the current engine stays and the error propagates."""
        new = self._build(label, settings)
        with self._lock:
            old, self.engine = self.engine, new
            self.model_label, self.settings = label, settings
            self.owners.clear()
            self.origins.clear()
            self.history.clear()
        if old is not None:
            old.shutdown()

    def current(self) -> InferenceEngine:
        with self._lock:
            if self.engine is None:
                raise RuntimeError("the engine is not started")
            return self.engine

    def register(self, request_ids: list[int], session: str) -> None:
        with self._lock:
            for panel, rid in enumerate(request_ids):
                self.owners[rid] = Owner(session, panel)
            while len(self.owners) > 4096:
                self.owners.pop(next(iter(self.owners)))

    def owner(self, request_id: int) -> Owner | None:
        return self.owners.get(request_id)

    def origin(self, page: int) -> str | None:
        """The session whose request stored this page (looked up late: events can beat ``register``)."""
        owner = self.owners.get(self.origins.get(page, -1))
        return owner.session if owner else None

    def _sample_loop(self) -> None:
        while True:  # a daemon thread: it ends with the app
            time.sleep(SAMPLE_SECONDS)
            try:
                stats = self.current().cache_stats()
            except Exception:  # an engine swap in progress: try again next tick
                continue
            self.history.append(
                Sample(
                    time=time.time(),
                    used=stats["used_pages"],
                    cached=stats["cached_pages"],
                    free=stats["free_pages"],
                    hit_rate=stats["hit_rate"],
                    recent_hit_rate=stats["recent_hit_rate"],
                    evictions=stats["evictions"],
                )
            )
