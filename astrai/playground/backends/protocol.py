"""The one interface the playground reads a cache through: the in-process engine, or (later) a vLLM server.

The UI depends on this protocol and on the typed records of ``astrai.observation``; never on an engine's internals.
A backend that cannot give a quantity says so (``None``, or a caption of its own) rather than inventing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, RequestInfo, StepSample
from astrai.sampling import SamplingParams


def chat_messages(prefix: str, prompt: str) -> list[dict[str, str]]:
    """The one rule for instruct models, whatever serves them: the shared prefix is the system turn."""
    messages = [{"role": "system", "content": prefix}] if prefix.strip() else []
    return [*messages, {"role": "user", "content": prompt}]


def format_prompt(tokenizer, prefix: str, prompt: str) -> str:
    """The text that reaches the model: the chat template when the tokenizer has one, else ``prefix + prompt``
    (so the same prompt text reaches the local engine and a vLLM server)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(chat_messages(prefix, prompt), tokenize=False, add_generation_prompt=True)
    return prefix + prompt


class BackendError(RuntimeError):
    """Base of the errors a run can end with; the message is meant for the visitor."""


class BackendUnavailable(BackendError):
    """The cache behind the backend went away: the engine was rebuilt or stopped, or the server is down."""


class RunFailed(BackendError):
    """A request of the run failed (a step that computed it raised, or the server answered an error)."""


class Run(Protocol):
    """One batch of prompts in flight. Iterating yields ``(panel index, text delta)``; ``close`` cancels."""

    request_ids: list[int]

    def __iter__(self) -> Iterator[tuple[int, str]]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    @property
    def label(self) -> str:
        """The model being served, as the UI names it."""
        ...

    @property
    def generation(self) -> int:
        """Grows whenever the cache behind the backend is replaced: sequence numbers restart with it."""
        ...

    def format_prompt(self, prefix: str, prompt: str) -> str:
        """The text that reaches the model: instruct models get their chat template, base models ``prefix + prompt``."""
        ...

    def submit(self, prompts: list[str], params: SamplingParams, salt: str | None, share_cache: bool = True) -> Run:
        """Start every prompt at once (one batch); bad input raises ``ValueError``/``TypeError`` before any runs.

        ``salt`` gives the run its own prefix-cache namespace; ``share_cache=False`` gives each prompt a fresh one,
        so nothing is reused, not even within the batch (prefix caching off, for comparisons).
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

    def decode(self, token_ids: tuple[int, ...] | list[int]) -> str: ...

    def special_ids(self) -> set[int]: ...
