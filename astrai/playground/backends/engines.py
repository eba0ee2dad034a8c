"""In-process engines by profile: the default profile's engine always serves; any other is built on first use,
shared by every visitor on that profile, and retired once no run holds it and it has been idle a while.

Invariants (all under ``_lock``, which is held only to read or change the table, never while building):

- A profile has at most one slot. A slot being built is in the table already, so a second visitor asking for the
  same profile waits for that build instead of starting another.
- A slot is retired only when ``runs == 0`` and it has been idle ``idle_retire_s``; ``run_on`` raises ``runs``
  under the same lock that retirement checks it, so no visitor's action can stop an engine another visitor's run
  is using. The default profile's slot is never retired. Nothing is ever rebuilt in place.
- Engines of one model and dtype share its weights: the model is loaded once and every engine over it is built
  from the same model object (``InferenceEngine`` shares a prepared model between engines and serialises their
  forwards). One extra engine costs its KV pool and its bookkeeping (docs/architecture.md has the measured figure).
- The operator bounds what visitors can make: ``max_engines`` engines in all, ``max_custom`` of them from visitors'
  own settings, and ``kv_budget_mb`` of KV pools in all. Past a bound the visitor gets ``EngineLimitReached``
  with a message; nothing serving changes.
- A visitor's own pool (a profile with an ``owner``, from ``own``) is a tenant of the default engine: its pages
  come out of that engine's reserve (``tenant_pages``, counted in the default engine's KV), its steps are the
  default engine's forwards, and it is made, held and retired as a slot like any other. It counts against no
  engine bound; past the reserve, ``EngineLimitReached``.
- A visitor holds at most one own pool: moving to another pool or leaving the page gives the others back
  (``release_own``), at once where no run holds them, else as their last run ends. A pool idle
  ``OWN_POOL_RECLAIM_S`` is taken back when the reserve is full and another visitor needs one (a visitor whose page
  closed without Gradio's unload reaching us). Each step on one's own pool starts empty, so neither loses anything
  a visitor could see.
- As runs end, the C heap's free memory goes back to the system (``heap.HeapTrim``): at once when no run is left,
  now and then while they go on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypedDict

from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from astrai import SUPPORTED_DTYPES, InferenceEngine, TenantReserveFull, precompile
from astrai.checkpoints import load_checkpoint
from astrai.model_runner import kv_bytes_per_token
from astrai.playground import knobs
from astrai.playground.backends.heap import HeapTrim
from astrai.playground.backends.local import LocalBackend
from astrai.playground.backends.profiles import (
    DEFAULT_PROFILE,
    TIER_STORE,
    TIER_WRITE,
    Profile,
    model_choices,
    owner_of,
    without_caching,
)
from astrai.playground.backends.protocol import BackendError, EngineLimitReached, EngineView, Progress

log = logging.getLogger("astrai.playground")


class ObservationBounds(TypedDict):
    """``add_tenant``'s bounds on what a pool keeps of its past."""

    history_size: int
    event_log_size: int
    keep_finished: int
    explain_keys: int


# What a visitor's own pool keeps of its past, sized to one visitor rather than to the pool everyone shares (a class
# of 30 holds 30 of them, one each): its steps (a run of the lesson's small pools takes ~200), its events, its ended
# requests (a run has at most 6) and the keys its explanations read.
OWN_POOL_OBSERVATION = ObservationBounds(history_size=1024, event_log_size=1024, keep_finished=64, explain_keys=1024)
# An own pool idle this long is taken back when the reserve is full and another visitor needs one: longer than a
# student reads a step's note between two presses, far shorter than the 600 s an engine is kept.
OWN_POOL_RECLAIM_S = 120.0


@dataclass
class _Slot:
    profile: Profile
    kv_bytes: int
    ready: threading.Event = field(default_factory=threading.Event)
    backend: LocalBackend | None = None  # set once built
    error: BaseException | None = None  # set when the build failed (the slot is then gone from the table)
    runs: int = 0  # runs holding it now
    last_used: float = field(default_factory=time.monotonic)
    released: bool = False  # its visitor gave it back while a run held it: it goes as the last run ends


@dataclass
class _Model:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig


class LocalEngines:
    """The ``Engines`` of the embedded playground. Thread-safe."""

    chooses_pools = True

    def __init__(
        self,
        default: Profile = DEFAULT_PROFILE,
        *,
        preload: tuple[Profile, ...] = (),
        allow_hub: bool = False,
        max_engines: int = knobs.MAX_ENGINES,
        max_custom: int = knobs.MAX_CUSTOM_ENGINES,
        kv_budget_mb: float = knobs.KV_BUDGET_MB,
        idle_retire_s: float = knobs.ENGINE_IDLE_S,
        tenant_pages: int = knobs.TENANT_PAGES,
        compile: bool | None = None,
    ):
        """``compile``: the engines serve the model compiled or eager; None, the engine's default (compiled on the
        CPU). A model's first engine serves eager at once while its compiled forward is loaded from disk or, the
        first time on a machine, compiled in a child process at a lower priority (``precompile.in_child``); it and
        every engine on the model switch to it once it is ready. So neither the app's start nor a visitor's new
        engine waits for a compile (20-80 s on 2 cores), and no compile holds the serving process's GIL.
        ``tenant_pages``: the default engine's reserve for visitors' own pools (0: every visitor shares the profile's
        engine)."""
        self._default = default
        self._tenant_pages = tenant_pages
        self._compile = compile
        self._choices = model_choices(allow_hub)
        self._max_engines, self._max_custom = max_engines, max_custom
        self._kv_budget = int(kv_budget_mb * 2**20)
        self._idle_retire_s = idle_retire_s
        self._lock = threading.Lock()  # guards _slots, _models and _configs; never held while building or fetching
        self._slots: dict[Profile, _Slot] = {}
        self._models: dict[tuple[str, str], _Model] = {}
        self._configs: dict[str, PretrainedConfig] = {}  # model label -> its config, read once
        self._closed = False
        self.heap_trim = HeapTrim()  # the C heap's free memory given back as runs end
        self.ensure(default)  # the default engine is built before the app serves
        if preload:  # cheap on the embedded model: the lesson then switches instantly
            threading.Thread(target=self._preload, args=(preload,), daemon=True, name="astrai-preload").start()

    # ----- the Engines protocol ---------------------------------------------------------------------------------
    @property
    def default(self) -> Profile:
        return self._default

    def model_choices(self) -> dict[str, str]:
        return dict(self._choices)

    def backend(self, profile: Profile) -> LocalBackend | None:
        self._retire_idle()
        with self._lock:
            slot = self._slots.get(profile)
            return slot.backend if slot is not None else None

    def ensure(self, profile: Profile, progress: Progress | None = None) -> LocalBackend:
        slot, build = self._claim(profile)
        if build:
            self._build(slot, progress)
        elif not slot.ready.is_set() and progress is not None:
            progress(0.5, f"Another visitor is building {profile.engine}…")
        slot.ready.wait()
        if isinstance(slot.error, BackendError):  # past a bound: its own message
            raise slot.error
        if slot.error is not None or slot.backend is None:
            raise BackendError(f"Could not build {profile.engine}: {slot.error}")
        return slot.backend

    @contextlib.contextmanager
    def run_on(self, profile: Profile) -> Iterator[LocalBackend]:
        while True:
            backend = self.ensure(profile)
            with self._lock:
                slot = self._slots.get(profile)
                if slot is not None and slot.backend is backend:  # not retired between ensure and here
                    slot.runs += 1
                    break
        try:
            yield backend
        finally:
            with self._lock:
                slot.runs -= 1
                slot.last_used = time.monotonic()
                done = slot.released and slot.runs == 0 and self._slots.get(profile) is slot
                if done:
                    del self._slots[profile]
                quiet = not any(other.runs for other in self._slots.values())
            if done:
                self._close(slot, "given back by its visitor, after its last run")
            self.heap_trim.run_ended(quiet)

    def view(self, profile: Profile, visitors: int) -> EngineView:
        if profile.owner is None:
            return EngineView(name=profile.name, description=profile.settings.describe(), visitors=visitors)
        description = f"{profile.settings.describe()}, run in the default engine's batches"
        return EngineView(name=f"your own {profile.name}", description=description, visitors=visitors)

    def own(self, profile: Profile, session: str) -> Profile:
        """A pool of ``session``'s own with ``profile``'s settings, where the default engine can host it (the same
        model, dtype and page size, and a reserve): then ``profile.own(session)``; else ``profile`` itself."""
        default = self._default.settings
        settings = profile.settings
        hostable = (profile.model, settings.dtype, settings.page_size) == (
            self._default.model,
            default.dtype,
            default.page_size,
        )
        return profile.own(session) if hostable and settings.n_pages <= self._tenant_pages else profile

    def release_own(self, session: str, keep: Profile | None = None) -> None:
        owner = owner_of(session)
        with self._lock:
            theirs = [p for p in self._slots if p.owner == owner and p != keep]
            given_back = []
            for profile in theirs:
                slot = self._slots[profile]
                if slot.runs > 0 or slot.backend is None:  # running or being built: goes as its last run ends, or idle
                    slot.released = True
                else:
                    given_back.append(self._slots.pop(profile))
        for slot in given_back:
            self._close(slot, "given back by its visitor")

    def without_caching(self, profile: Profile) -> Profile:
        return without_caching(profile)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            slots, self._slots = list(self._slots.values()), {}
        for slot in slots:
            slot.ready.wait()
            if slot.backend is not None:
                slot.backend.shutdown()

    # ----- what it holds, for the operator and the tests --------------------------------------------------------
    def built(self) -> list[Profile]:
        """Profiles whose engine is built now."""
        with self._lock:
            return [p for p, slot in self._slots.items() if slot.backend is not None]

    # ----- building and retiring --------------------------------------------------------------------------------
    def _claim(self, profile: Profile) -> tuple[_Slot, bool]:
        """The profile's slot, and whether this caller must build it (a new slot, checked against the bounds)."""
        if profile.model not in self._choices:
            raise BackendError(f"Model {profile.model!r} is not offered here (the operator has not enabled it).")
        profile.settings.validate()
        self._retire_idle()
        with self._lock:
            if (existing := self._existing_locked(profile)) is not None:
                return existing, False
        kv_bytes = self._kv_bytes(profile)  # outside the lock: a hub model's config may come over the network
        with self._lock:
            if (existing := self._existing_locked(profile)) is not None:  # another visitor claimed it meanwhile
                return existing, False
            slot = _Slot(profile, kv_bytes)
            self._check_bounds(slot)
            self._slots[profile] = slot
            return slot, True

    def _existing_locked(self, profile: Profile) -> _Slot | None:
        """The profile's slot, marked used, if it has one; raises once the playground shuts down. Under ``_lock``."""
        if self._closed:
            raise BackendError("The playground is shutting down.")
        slot = self._slots.get(profile)
        if slot is not None:
            slot.last_used = time.monotonic()
        return slot

    def _check_bounds(self, new: _Slot) -> None:
        slots = [slot for slot in self._slots.values() if slot.profile.owner is None]  # engines, not own pools
        if not slots:
            return  # the default engine: the operator's own choice, always built
        if new.profile.owner is None:  # an engine of its own (an own pool is in the default engine's reserve)
            if len(slots) >= self._max_engines:
                raise EngineLimitReached(
                    f"This Space already runs {len(slots)} engines, its limit: use a scenario's engine, or try again "
                    "in a few minutes, when an idle one has been retired."
                )
            if new.profile.custom and sum(s.profile.custom for s in slots) >= self._max_custom:
                raise EngineLimitReached(
                    f"All {self._max_custom} engines for visitors' own settings are taken. Pick settings another "
                    "visitor uses, a scenario, or try again in a few minutes, when an idle one has been retired."
                )
        if not new.kv_bytes:
            return  # an own pool without a second tier: its pages are the reserve's, counted with the default engine
        used = sum(s.kv_bytes for s in self._slots.values())  # own pools' second tiers too
        if used + new.kv_bytes > self._kv_budget:
            raise EngineLimitReached(
                f"A pool of {new.kv_bytes / 2**20:.0f} MB of KV does not fit: {used / 2**20:.0f} of the Space's "
                f"{self._kv_budget / 2**20:.0f} MB are in use. Choose fewer pages, or try again later."
            )

    def _kv_bytes(self, profile: Profile) -> int:
        """What the profile's KV pool and second tier take (a tier's pages are host memory too), from its model's
        config: the loaded model's, else the config read once and kept (a hub model's may come over the network).
        Never called under ``_lock``: every visitor's 1 Hz poll takes it, and a fetch of 3 s held it for as long."""
        settings = profile.settings
        if profile.owner is not None and not settings.offload_pages:
            return 0  # its pages are the default engine's reserve, counted with that engine
        with self._lock:
            loaded = self._models.get((profile.model, settings.dtype))
            config = loaded.config if loaded is not None else self._configs.get(profile.model)
        if config is None:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(self._choices[profile.model], trust_remote_code=False)
            except (OSError, ValueError) as exc:
                raise BackendError(f"Could not read {profile.model}'s config: {exc}") from exc
            with self._lock:
                self._configs[profile.model] = config
        per_token = kv_bytes_per_token(config, SUPPORTED_DTYPES[settings.dtype])
        if profile.owner is not None:  # its pool is in the default engine's reserve; its tier is its own
            return settings.offload_pages * settings.page_size * per_token
        reserve = self._tenant_pages if profile == self._default else 0
        return (settings.n_pages + reserve + settings.offload_pages) * settings.page_size * per_token

    def _build(self, slot: _Slot, progress: Progress | None) -> None:
        profile, settings = slot.profile, slot.profile.settings
        started = time.monotonic()
        try:
            if profile.owner is not None:
                slot.backend = self._own_pool(profile)
                return
            if progress is not None:
                progress(0.1, f"Building {profile.engine} ({settings.describe()})…")
            model = self._model(profile.model, settings.dtype)
            engine = InferenceEngine(
                model.model,
                model.tokenizer,
                page_size=settings.page_size,
                n_pages=settings.n_pages,
                max_batch_size=settings.max_batch_size,
                prefix_caching=settings.prefix_caching,
                dtype=settings.dtype,
                eviction=settings.eviction,
                offload_pages=settings.offload_pages,
                offload_to=TIER_STORE,
                offload_policy=TIER_WRITE,
                tenant_pages=self._tenant_pages if profile == self._default else 0,
                compile=self._compile,
                background_compile=precompile.in_child(self._choices[profile.model], settings.dtype),
            )
            slot.backend = LocalBackend(engine, profile.model)
            log.info("engine %s built in %.2f s", profile.key, time.monotonic() - started)
        except Exception as exc:  # offline, unsupported, out of memory: nothing that serves changes
            slot.error = exc
            with self._lock:
                if self._slots.get(profile) is slot:
                    del self._slots[profile]
        finally:
            slot.ready.set()

    def _own_pool(self, profile: Profile) -> LocalBackend:
        """A tenant of the default engine with ``profile``'s pool and batch: a visitor's own pool."""
        settings = profile.settings
        host = self.ensure(self._default).engine
        assert host is not None  # the default profile's backend is an engine, never a tenant
        add = functools.partial(
            host.add_tenant,
            settings.n_pages,
            max_batch_size=settings.max_batch_size,
            prefix_caching=settings.prefix_caching,
            eviction=settings.eviction,
            offload_pages=settings.offload_pages,
            offload_to=TIER_STORE,
            offload_policy=TIER_WRITE,
            **OWN_POOL_OBSERVATION,
        )
        try:
            try:
                tenant = add()
            except TenantReserveFull:
                if not self._reclaim_own_pools():
                    raise
                tenant = add()
        except TenantReserveFull as exc:
            log.info("no own pool for a visitor: %s", exc)
            raise EngineLimitReached(
                f"The {self._tenant_pages} pages this Space keeps for visitors' own pools are taken."
            ) from exc
        return LocalBackend(tenant, profile.model)

    def _reclaim_own_pools(self) -> bool:
        """Take back every own pool no run holds that has been idle ``OWN_POOL_RECLAIM_S``; True if any was."""
        now = time.monotonic()
        with self._lock:
            idle = [
                p
                for p, slot in self._slots.items()
                if p.owner is not None
                and slot.backend is not None
                and slot.runs == 0
                and now - slot.last_used >= OWN_POOL_RECLAIM_S
            ]
            reclaimed = [self._slots.pop(p) for p in idle]
        for slot in reclaimed:
            self._close(slot, f"taken back for another visitor after {now - slot.last_used:.0f} s idle")
        return bool(reclaimed)

    def _model(self, label: str, dtype: str) -> _Model:
        """The loaded model for ``label`` in ``dtype``: loaded once, shared by every engine over it. Only the
        building threads load, and a profile is built by one thread at a time."""
        with self._lock:
            loaded = self._models.get((label, dtype))
        if loaded is None:
            model, tokenizer = load_checkpoint(self._choices[label], dtype)
            loaded = _Model(model, tokenizer, model.config)
            with self._lock:
                loaded = self._models.setdefault((label, dtype), loaded)
        return loaded

    def _retire_idle(self) -> None:
        now = time.monotonic()
        with self._lock:
            idle = [
                p
                for p, slot in self._slots.items()
                if p != self._default
                and slot.backend is not None
                and slot.runs == 0
                and now - slot.last_used >= self._idle_retire_s
            ]
            retired = [self._slots.pop(p) for p in idle]
            in_use = {(p.model, p.settings.dtype) for p in self._slots}
            for key in [k for k in self._models if k not in in_use]:
                del self._models[key]  # no engine over it is left: its weights can go
        for slot in retired:
            self._close(slot, f"retired after {now - slot.last_used:.0f} s idle")

    @staticmethod
    def _close(slot: _Slot, why: str) -> None:
        """Stop a slot's engine, or close its tenant (its pages go back to the reserve). Called with the slot
        already out of the table, and never under ``_lock`` (a tenant's close waits for a running forward)."""
        log.info("engine %s %s", slot.profile.key, why)
        assert slot.backend is not None
        slot.backend.shutdown()

    def _preload(self, profiles: tuple[Profile, ...]) -> None:
        for profile in profiles:
            try:
                self.ensure(profile)
            except BackendError:
                log.warning("could not preload the %s engine", profile.name, exc_info=True)
