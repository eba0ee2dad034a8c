"""Engines by profile: built on first use, shared, never stopped under a run, retired when idle, bounded."""

from __future__ import annotations

import threading

import pytest

from astrai.playground.backends.engines import LocalEngines
from astrai.playground.backends.profiles import (
    DEFAULT_PROFILE,
    EMBEDDED_LABEL,
    HUB_MODELS,
    HUB_MODELS_ENV,
    EngineSettings,
    Profile,
    hub_models_allowed,
    model_choices,
)
from astrai.playground.backends.protocol import BackendError, EngineLimitReached
from astrai.sampling import SamplingParams
from tests.support.waiting import wait_until

SMALL = Profile(settings=EngineSettings(n_pages=40, max_batch_size=8), name="small")
TINY = Profile(settings=EngineSettings(n_pages=16, max_batch_size=4), name="tiny")


def custom(n_pages: int) -> Profile:
    return Profile(settings=EngineSettings(n_pages=n_pages, max_batch_size=4), name="mine", custom=True)


@pytest.fixture
def engines():
    made = LocalEngines(idle_retire_s=3600, compile=False)
    yield made
    made.shutdown()


def test_a_profile_gets_its_own_engine_on_first_use_and_shares_it(engines):
    assert engines.built() == [DEFAULT_PROFILE]
    assert engines.backend(SMALL) is None, "backend() never builds"
    small = engines.ensure(SMALL)
    assert small.stats().n_pages == 40 and engines.ensure(SMALL) is small, "one engine per profile"
    same = Profile(settings=EngineSettings(n_pages=40, max_batch_size=8), name="another name")
    assert engines.ensure(same) is small, "equal settings name the same profile"
    assert engines.ensure(DEFAULT_PROFILE).stats().n_pages == 2048, "the default engine is untouched"


def test_concurrent_first_uses_build_one_engine(engines):
    got = []
    threads = [threading.Thread(target=lambda: got.append(engines.ensure(SMALL))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(got) == 4 and len({id(b) for b in got}) == 1


def test_an_idle_engine_is_retired_but_never_under_a_run():
    engines = LocalEngines(idle_retire_s=0.0, compile=False)
    try:
        with engines.run_on(SMALL) as backend:
            run = backend.submit(["Once upon a time"], SamplingParams(max_tokens=4), None)
            assert engines.backend(SMALL) is backend, "a held engine is not retired, however idle"
            assert "".join(d for _, d in run)
        assert engines.backend(SMALL) is None, "released and idle: retired"
        assert engines.backend(DEFAULT_PROFILE) is not None, "the default engine is never retired"
        assert engines.ensure(SMALL).stats().n_pages == 40, "built again on next use"
    finally:
        engines.shutdown()


def test_custom_engines_are_bounded_with_a_clear_message():
    engines = LocalEngines(max_custom=1, idle_retire_s=3600, compile=False)
    try:
        engines.ensure(custom(64))
        with pytest.raises(EngineLimitReached, match="engines for visitors' own settings are taken"):
            engines.ensure(custom(72))
        assert engines.ensure(custom(64)), "settings another visitor uses are still served"
        assert engines.ensure(SMALL), "scenario profiles are not custom"
    finally:
        engines.shutdown()


def test_engines_and_kv_memory_are_bounded():
    # the embedded model: 3 KiB of KV per token; the default engine's 2048 pages of 16 tokens, and as many again in
    # its reserve for visitors' own pools
    default_mb = 96 + 96
    engines = LocalEngines(
        max_engines=2, kv_budget_mb=default_mb + 1, idle_retire_s=3600, tenant_pages=2048, compile=False
    )
    try:
        with pytest.raises(EngineLimitReached, match="MB of KV does not fit"):
            engines.ensure(custom(64))  # 3 MB: over the budget the default engine leaves
        engines.ensure(TINY)  # 0.75 MB
        with pytest.raises(EngineLimitReached, match="engines, its limit"):
            engines.ensure(Profile(settings=EngineSettings(n_pages=8), name="x"))
        # own pools are past the engine bound (their pages are the reserve's), but a second tier of their own is KV
        # memory beside it: 0.25 MB left of the budget holds one 3-page tier (0.14 MB), not two
        tiered = Profile(settings=EngineSettings(n_pages=8, offload_pages=3), name="tiered", per_visitor=True)
        engines.ensure(engines.own(tiered, "first"))
        with pytest.raises(EngineLimitReached, match="MB of KV does not fit"):
            engines.ensure(engines.own(tiered, "second"))
        engines.ensure(engines.own(TINY, "second"))  # an own pool without a tier takes nothing of the budget
    finally:
        engines.shutdown()


def test_hub_models_are_offered_only_when_the_operator_allows(monkeypatch):
    monkeypatch.delenv(HUB_MODELS_ENV, raising=False)
    assert not hub_models_allowed() and hub_models_allowed(flag=True)
    monkeypatch.setenv(HUB_MODELS_ENV, "1")
    assert hub_models_allowed()
    assert list(model_choices(allow_hub=False)) == [EMBEDDED_LABEL]
    assert set(HUB_MODELS) <= set(model_choices(allow_hub=True))
    engines = LocalEngines(idle_retire_s=3600, compile=False)
    try:
        hub = Profile(model=next(iter(HUB_MODELS)), name="hub")
        with pytest.raises(BackendError, match="not offered here"):
            engines.ensure(hub)
        assert engines.built() == [DEFAULT_PROFILE]
    finally:
        engines.shutdown()


def test_a_failed_build_leaves_everything_serving(engines):
    with pytest.raises(ValueError, match="pool size"):
        engines.ensure(Profile(settings=EngineSettings(n_pages=5), name="bad"))
    assert engines.built() == [DEFAULT_PROFILE]


def test_the_lessons_profiles_are_built_in_the_background_at_start():
    engines = LocalEngines(preload=(SMALL, TINY), idle_retire_s=3600, compile=False)
    try:
        assert DEFAULT_PROFILE in engines.built(), "the default engine is built before the constructor returns"
        assert wait_until(lambda: set(engines.built()) == {DEFAULT_PROFILE, SMALL, TINY}, timeout=60)
    finally:
        engines.shutdown()
