"""The in-process backend: one ``InferenceEngine`` shared by every visitor, rebuilt when the settings change."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from astrai import SUPPORTED_DTYPES, EngineClosedError, InferenceEngine, RequestFailedError, SamplingParams
from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.playground.backends.protocol import BackendUnavailable, RunFailed, format_prompt
from astrai.streams import GenerationStream

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
PAGE_SIZES = (4, 8, 16, 32, 64)
DTYPES = tuple(SUPPORTED_DTYPES)
POOL_PAGES = (8, 4096)
BATCH_SIZES = (1, 64)


@dataclass(frozen=True)
class EngineSettings:
    page_size: int = 16
    n_pages: int = 1024  # room for a full batch of 64 requests (~8 pages each: 16 four-panel runs) without preempting
    max_batch_size: int = int(os.environ.get("ASTRAI_MAX_BATCH_SIZE", 64))  # docs/benchmarks.md: the load curve
    prefix_caching: bool = True
    dtype: str = "float32"

    def validate(self) -> None:
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page size must be one of {', '.join(map(str, PAGE_SIZES))}")
        if not POOL_PAGES[0] <= self.n_pages <= POOL_PAGES[1]:
            raise ValueError(f"pool size must be between {POOL_PAGES[0]} and {POOL_PAGES[1]} pages")
        if not BATCH_SIZES[0] <= self.max_batch_size <= BATCH_SIZES[1]:
            raise ValueError(f"max batch must be between {BATCH_SIZES[0]} and {BATCH_SIZES[1]}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")


class LocalRun:
    """A ``GenerationStream`` whose errors are the backend's own (the UI never sees engine exception types)."""

    def __init__(self, stream: GenerationStream):
        self._stream = stream
        self.request_ids = stream.request_ids

    def __iter__(self) -> Iterator[tuple[int, str]]:
        try:
            yield from self._stream
        except EngineClosedError as exc:
            raise BackendUnavailable(f"The engine was rebuilt or stopped, so this run ended early ({exc}).") from exc
        except RequestFailedError as exc:
            raise RunFailed(str(exc)) from exc

    def close(self) -> None:
        self._stream.close()


class LocalBackend:
    """Thread-safe holder of the shared engine. A rebuild that fails leaves the current engine serving."""

    def __init__(self, model_label: str = EMBEDDED_LABEL, settings: EngineSettings | None = None):
        self._lock = threading.Lock()  # guards the engine reference, its label, settings and generation
        self._settings = settings or EngineSettings()
        self._label = model_label
        self._engine = self._build(model_label, self._settings)
        self._generation = 1

    @staticmethod
    def _build(label: str, settings: EngineSettings) -> InferenceEngine:
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
        )

    def rebuild(self, label: str, settings: EngineSettings) -> None:
        """Load a model or apply settings; on failure the error propagates and nothing changes."""
        new = self._build(label, settings)
        with self._lock:
            old, self._engine = self._engine, new
            self._label, self._settings = label, settings
            self._generation += 1
        old.shutdown()

    def shutdown(self) -> None:
        self._current().shutdown()

    def _current(self) -> InferenceEngine:
        with self._lock:
            return self._engine

    @property
    def label(self) -> str:
        with self._lock:
            return self._label

    @property
    def settings(self) -> EngineSettings:
        with self._lock:
            return self._settings

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    def format_prompt(self, prefix: str, prompt: str) -> str:
        return format_prompt(self._current().tokenizer, prefix, prompt)

    def submit(
        self, prompts: list[str], params: SamplingParams, salt: str | None, share_cache: bool = True
    ) -> LocalRun:
        salts: str | list[str] | None = salt
        if not share_cache:
            salts = [f"{salt or ''}/no-sharing/{uuid.uuid4().hex}" for _ in prompts]
        try:
            stream = self._current().generate(
                prompts,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                stream=True,
                cache_salt=salts,
            )
        except EngineClosedError as exc:
            raise BackendUnavailable(str(exc)) from exc
        assert isinstance(stream, GenerationStream)
        return LocalRun(stream)

    def cancel(self, request_ids: list[int]) -> None:
        self._current().cancel(request_ids)

    def clear(self) -> int:
        return self._current().clear()

    def stats(self) -> CacheStats:
        return self._current().cache_stats()

    def snapshot(self) -> CacheSnapshot:
        return self._current().cache_snapshot()

    def events(self, after: int) -> list[EngineEvent]:
        return self._current().events(after)

    def history(self, after_step: int) -> list[StepSample]:
        return self._current().history(after_step)

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]:
        return self._current().request_info(request_ids)

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        return self._current().tokenizer.decode(list(token_ids))

    def special_ids(self) -> set[int]:
        return set(self._current().tokenizer.all_special_ids)
