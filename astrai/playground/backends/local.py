"""One in-process ``InferenceEngine`` as a playground ``Backend``. Which engines exist, and for which profile, is
``engines.py``'s business: a ``LocalBackend`` serves the engine it was given until it is shut down."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator, Sequence

from astrai import EngineClosedError, InferenceEngine, RequestFailedError, SamplingParams, Tenant
from astrai.explain import Explanation
from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.playground.backends.protocol import (
    BackendUnavailable,
    ReplicaView,
    RouterView,
    RunFailed,
    Served,
    format_prompt,
)
from astrai.streams import GenerationStream


class LocalRun:
    """A ``GenerationStream`` whose errors are the backend's own (the UI never sees engine exception types)."""

    def __init__(self, stream: GenerationStream):
        self._stream = stream
        self.request_ids = stream.request_ids

    def __iter__(self) -> Iterator[tuple[int, str]]:
        try:
            yield from self._stream
        except EngineClosedError as exc:
            raise BackendUnavailable(f"The engine stopped, so this run ended early ({exc}).") from exc
        except RequestFailedError as exc:
            raise RunFailed(str(exc)) from exc

    def close(self) -> None:
        self._stream.close()


_generations = itertools.count(1)


class LocalBackend:
    """One engine, or one tenant of an engine (a visitor's own pool, served in that engine's forwards), and its
    label; both have the same surface, and everything read here is that pool's own. Its generation is its own,
    unique in the process: a profile's engine is never rebuilt in place, and the engine (or tenant) that replaces a
    retired one has another generation, so nothing recorded from the old one (a replay, a live view's cursor) takes
    in the new one's steps, whose numbers start again."""

    derived: frozenset[str] = frozenset()  # the engine reports every field itself
    caveat = None  # the engine's page map is always whole
    replicas: tuple[ReplicaView, ...] = ()  # one engine: its own observation is the whole cache
    routers: tuple[RouterView, ...] = ()

    def __init__(self, engine: Tenant, label: str):
        self._engine = engine
        self._label = label
        self.generation = next(_generations)

    @property
    def label(self) -> str:
        return self._label

    @property
    def engine(self) -> InferenceEngine | None:
        """The engine, where this backend serves one (not a tenant of one): the host of visitors' own pools."""
        return self._engine if isinstance(self._engine, InferenceEngine) else None

    @property
    def steps(self) -> int:
        return self._engine.steps  # an int the loop alone writes: read without the engine's lock

    def shutdown(self) -> None:
        """Stop the engine, or close the tenant (its pages go back to its engine's reserve)."""
        if isinstance(self._engine, InferenceEngine):
            self._engine.shutdown()
        else:
            self._engine.close()

    def format_prompt(self, prefix: str, prompt: str) -> str:
        return format_prompt(self._engine.tokenizer, prefix, prompt)

    def submit(
        self,
        prompts: list[str],
        params: SamplingParams,
        salt: str | None,
        share_cache: bool = True,
        router: int | None = None,
    ) -> LocalRun:
        if router is not None:
            raise ValueError("an in-process engine has no router")
        salts: str | list[str] | None = salt
        if not share_cache:
            salts = [f"{salt or ''}/no-sharing/{uuid.uuid4().hex}" for _ in prompts]
        try:
            stream = self._engine.generate(
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
        self._engine.cancel(request_ids)

    def clear(self) -> int:
        return self._engine.clear()

    def stats(self) -> CacheStats:
        return self._engine.cache_stats()

    def snapshot(self) -> CacheSnapshot:
        return self._engine.cache_snapshot()

    def events(self, after: int) -> list[EngineEvent]:
        return self._engine.events(after)

    def history(self, after_step: int) -> list[StepSample]:
        return self._engine.history(after_step)

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]:
        return self._engine.request_info(request_ids)

    def served_by(self, request_ids: list[int]) -> dict[int, Served]:
        return {}

    def explain(self, request_ids: list[int], viewer_owns: Callable[[int | None], bool]) -> list[Explanation]:
        return self._engine.explain(request_ids, viewer_owns)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._engine.tokenizer.decode(list(token_ids)))

    def special_ids(self) -> set[int]:
        return set(self._engine.tokenizer.all_special_ids)
