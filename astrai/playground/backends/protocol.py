"""The interfaces the playground reads caches through.

- ``Backend``: one cache (one in-process engine, or one vLLM server) and its observations.
- ``Engines``: where a visitor's backend comes from. Locally, one engine per profile (``backends/engines.py``); for
  vLLM, the server's one pool whatever the profile (``SingleServer``).

The UI depends on these protocols and on the typed records of ``astrai.observation``; never on an engine's
internals, never on which class implements them. A backend that cannot give a quantity says so (``None``, or a
caption of its own) rather than inventing it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from astrai.explain import Explanation
from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.playground.backends.profiles import Profile
from astrai.sampling import SamplingParams


def chat_messages(prefix: str, prompt: str) -> list[dict[str, str]]:
    """The one rule for instruct models, whatever serves them: the shared prefix is the system turn."""
    messages = [{"role": "system", "content": prefix}] if prefix.strip() else []
    return [*messages, {"role": "user", "content": prompt}]


def format_prompt(tokenizer: Any, prefix: str, prompt: str) -> str:
    """The text that reaches the model: the chat template when the tokenizer has one, else ``prefix + prompt``
    (so the same prompt text reaches the local engine and a vLLM server)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(chat_messages(prefix, prompt), tokenize=False, add_generation_prompt=True)
        return str(text)
    return prefix + prompt


def fleet_page(page: int, replica: int, replicas: int) -> int:
    """How a fleet numbers its pages seen as one pool: page ``p`` of replica ``r`` of ``n`` is ``p * n + r`` (unique,
    and stable while the page stays). ``Backend.snapshot``/``history`` of a fleet use it; ``replica_of`` undoes it."""
    return page * replicas + replica


def replica_of(page: int, replicas: int) -> tuple[int, int]:
    """``(replica, its own page number)`` of a fleet page number (``fleet_page``)."""
    slot, replica = divmod(page, replicas)
    return replica, slot


class BackendError(RuntimeError):
    """Base of the errors a run can end with; the message is meant for the visitor."""


class BackendUnavailable(BackendError):
    """The cache behind the backend went away: the engine stopped, or the server is down."""


class EngineLimitReached(BackendError):
    """Building another engine would pass the operator's bound (engines, or their KV memory): the visitor is told,
    and nothing already serving changes."""


class RunFailed(BackendError):
    """A request of the run failed (a step that computed it raised, or the server answered an error)."""


@dataclass(frozen=True)
class Served:
    """Which replica of a fleet served a request, and how that is known."""

    replica: str  # the replica's label
    source: str  # where that comes from ("its KV events")


@dataclass(frozen=True)
class RouterMetrics:
    """What one read of a router's metrics said; empty maps where it sent nothing."""

    decisions: dict[str, int] = field(default_factory=dict)  # replica URL -> requests routed there
    prefix_outcomes: dict[str, int] = field(default_factory=dict)  # prefix-aware decisions by outcome
    healthy: dict[str, bool] = field(default_factory=dict)  # replica URL -> the router's health check
    running: dict[str, int] = field(default_factory=dict)  # replica URL -> requests running there
    policies: frozenset[str] = frozenset()


class ReplicaView(Protocol):
    """One replica of a fleet, observed on its own: the observation half of ``Backend``, for that server alone."""

    name: str  # "replica 1"
    url: str

    @property
    def label(self) -> str: ...

    @property
    def unreachable(self) -> str | None: ...

    @property
    def caveat(self) -> str | None: ...

    def stats(self) -> CacheStats: ...

    def snapshot(self) -> CacheSnapshot: ...

    def history(self, after_step: int) -> list[StepSample]: ...


class RouterView(Protocol):
    """A router in front of a fleet: its policy and what its metrics say (None while they cannot be read)."""

    @property
    def url(self) -> str: ...

    @property
    def policy(self) -> str: ...

    def metrics(self) -> RouterMetrics | None: ...


class Run(Protocol):
    """One batch of prompts in flight. Iterating yields ``(panel index, text delta)``; ``close`` cancels."""

    request_ids: list[int]

    def __iter__(self) -> Iterator[tuple[int, str]]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    # stats fields the backend computes rather than reads (vLLM derives cached and free pages): the UI marks them
    derived: frozenset[str]

    @property
    def label(self) -> str:
        """The model being served, as the UI names it."""
        ...

    @property
    def generation(self) -> int:
        """Grows whenever the cache behind the backend is replaced: sequence numbers restart with it."""
        ...

    @property
    def caveat(self) -> str | None:
        """Why the page map may be incomplete now (a vLLM server's resync, KV events it missed); None when whole."""
        ...

    @property
    def steps(self) -> int:
        """``stats().steps``, read without waiting for a step in progress: every change the views show comes with a
        step (an engine records a cancel or a clear as a step of its own; a vLLM sampler counts a sample in which
        anything moved), so a live view that drew this number has nothing new to draw while it stays. Cheap enough
        for every idle open page to read a few times a second (``callbacks/live.py``)."""
        ...

    @property
    def replicas(self) -> tuple[ReplicaView, ...]:
        """A fleet's replicas, each observed on its own; () for one cache (the backend's own observation)."""
        ...

    @property
    def routers(self) -> tuple[RouterView, ...]:
        """The routers runs can go through (a fleet); ()."""
        ...

    def format_prompt(self, prefix: str, prompt: str) -> str:
        """The text that reaches the model: instruct models get their chat template, base models ``prefix + prompt``."""
        ...

    def submit(
        self,
        prompts: list[str],
        params: SamplingParams,
        salt: str | None,
        share_cache: bool = True,
        router: int | None = None,
    ) -> Run:
        """Start every prompt at once (one batch); bad input raises ``ValueError``/``TypeError`` before any runs.

        ``salt`` gives the run its own prefix-cache namespace; ``share_cache=False`` gives each prompt a fresh one,
        so nothing is reused, not even within the batch (prefix caching off, for comparisons). ``router``: the index
        of the router in ``routers`` the run goes through (default: the first, where there is one).
        """
        ...

    def cancel(self, request_ids: list[int]) -> None: ...

    def clear(self) -> int:
        """Empty the prefix cache; returns the cached pages freed."""
        ...

    def stats(self) -> CacheStats: ...

    def snapshot(self) -> CacheSnapshot: ...

    def events(self, after: int) -> list[EngineEvent]: ...

    def history(self, after_step: int) -> list[StepSample]: ...

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]: ...

    def served_by(self, request_ids: list[int]) -> dict[int, Served]:
        """Which replica served each request, where that is known (a fleet); {} otherwise."""
        ...

    def explain(self, request_ids: list[int], viewer_owns: Callable[[int | None], bool]) -> list[Explanation]:
        """Why each prompt token of these requests was or was not served from the cache (``astrai.explain``), as
        the viewer may see it (``viewer_owns``: the storing requests that are theirs)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def special_ids(self) -> set[int]: ...

    def shutdown(self) -> None:
        """Stop its threads (and, for an engine, hand its model back)."""
        ...


@dataclass(frozen=True)
class EngineView:
    """What a visitor is told about the engine they are on (the stats line's first words)."""

    name: str  # the profile's name ("default", "small pool", "your settings"), or the server's
    description: str  # its pool, page size and batch in words
    visitors: int  # visitors on it now (the caller included)


Progress = Callable[[float, str], None]  # fraction done, what is happening


class Engines(Protocol):
    """Where a visitor's backend comes from. Every method is safe from any thread."""

    @property
    def chooses_pools(self) -> bool:
        """True when profiles get engines of their own (scenario pools, custom settings); False when every profile
        is served by one pool that belongs to a server (the scenarios then say so)."""
        ...

    @property
    def default(self) -> Profile: ...

    def model_choices(self) -> dict[str, str]:
        """Model labels a visitor may pick (label -> checkpoint)."""
        ...

    def backend(self, profile: Profile) -> Backend | None:
        """The backend serving ``profile`` now, or None when it is not built (never builds)."""
        ...

    def ensure(self, profile: Profile, progress: Progress | None = None) -> Backend:
        """The backend for ``profile``, built first when needed (it may take seconds; ``progress`` hears how it
        goes). Raises ``EngineLimitReached`` past the operator's bound, ``BackendError`` when it cannot build."""
        ...

    def run_on(self, profile: Profile) -> contextlib.AbstractContextManager[Backend]:
        """Hold ``profile``'s backend for one run: while held it is never retired. Builds it when needed."""
        ...

    def view(self, profile: Profile, visitors: int) -> EngineView: ...

    def own(self, profile: Profile, session: str) -> Profile:
        """The profile of a pool of ``session``'s own with ``profile``'s settings (never shared: no one else's run
        evicts or preempts theirs), where pools can be made so; else ``profile``."""
        ...

    def release_own(self, session: str, keep: Profile | None = None) -> None:
        """Give back ``session``'s own pools, all but ``keep``: the visitor moved to another pool or left. A step on
        one's own pool starts from an empty cache anyway, so nothing a visitor could see is lost; a pool a run still
        holds goes when that run ends."""
        ...

    def without_caching(self, profile: Profile) -> Profile | None:
        """The profile of an engine like ``profile``'s with prefix caching off, where Compare runs its second half;
        None where every profile is served by one pool (a server's own)."""
        ...

    def shutdown(self) -> None: ...


class SingleServer:
    """``Engines`` over one backend that owns its pool (a vLLM server): every profile is served by it."""

    chooses_pools = False

    def __init__(self, backend: Backend, default: Profile):
        self._backend = backend
        self._default = default

    @property
    def default(self) -> Profile:
        return self._default

    def model_choices(self) -> dict[str, str]:
        return {self._backend.label: self._backend.label}

    def backend(self, profile: Profile) -> Backend:
        return self._backend

    def ensure(self, profile: Profile, progress: Progress | None = None) -> Backend:
        return self._backend

    @contextlib.contextmanager
    def run_on(self, profile: Profile) -> Iterator[Backend]:
        yield self._backend

    def view(self, profile: Profile, visitors: int) -> EngineView:
        if self._backend.replicas:
            return EngineView(
                name=f"a fleet of {len(self._backend.replicas)} vLLM replicas",
                description="each with its own pool, behind vLLM's router",
                visitors=visitors,
            )
        return EngineView(
            name="the server's own pool", description="its pool and batch are the server's", visitors=visitors
        )

    def own(self, profile: Profile, session: str) -> Profile:
        return profile  # the server's pool is the only one

    def release_own(self, session: str, keep: Profile | None = None) -> None:
        return None  # no visitor has a pool of their own here

    def without_caching(self, profile: Profile) -> None:
        return None  # the server's pool is the only one

    def shutdown(self) -> None:
        self._backend.shutdown()
