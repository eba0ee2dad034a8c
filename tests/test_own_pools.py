"""A class on a small-pool lesson step: each visitor runs in a pool of their own (a tenant of the default engine),
and every visitor's tokens go through the default engine's one forward per step."""

from __future__ import annotations

import threading

from astrai.observation import PageStored, RequestAdmitted
from astrai.playground.backends.profiles import DEFAULT_PROFILE, SMALL_POOL_PROFILE
from astrai.playground.scenarios import LESSON, SCENARIO_BY_NAME
from tests.support.playground import Playground, no_progress, playground, request

EVICTION = SCENARIO_BY_NAME["Eviction pressure (small pool)"]
STEP_3 = next(i for i, step in enumerate(LESSON) if step.scenario == EVICTION.name)
MAX_TOKENS = 96  # six prompts and answers of 96 tokens need 11 pages each, more than the 40 pages hold: it evicts


def fields(pg: Playground) -> dict[str, object]:
    prompts = {f"prompt_{i + 1}": p for i, p in enumerate(EVICTION.prompts)}
    base = dict(n_panels=len(EVICTION.prompts), shared_prefix=EVICTION.prefix, max_tokens=MAX_TOKENS)
    base["cache_namespace"] = EVICTION.namespace
    return pg.fields(**(base | prompts))


def run_at_once(pg: Playground, sessions: list[str]) -> None:
    """Every visitor presses Run at the same moment; returns once every run has ended."""
    barrier = threading.Barrier(len(sessions))
    errors: list[BaseException] = []

    def press(session: str) -> None:
        try:
            barrier.wait(10)
            for _ in pg.runs.run(fields(pg), request(session)):
                pass
            pg.runs.after_run(request(session))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=press, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors


def test_two_visitors_on_a_small_pool_step_each_see_only_their_own_pool_and_share_forwards():
    with playground() as pg:
        ann, bob = "ann", "bob"
        for session in (ann, bob):
            update = pg.setup.lesson(STEP_3, 0, request(session), no_progress)
            assert "your own “small pool” pool" in update[pg.ctx.ui.setup.engine.status]
        mine, theirs = (pg.ctx.visitors.peek(s).profile for s in (ann, bob))
        assert mine.owner and theirs.owner and mine != theirs and mine.shared() == theirs.shared() == SMALL_POOL_PROFILE
        host = pg.ctx.engines.ensure(DEFAULT_PROFILE).engine
        assert host is not None
        forwards = host.forwards
        run_at_once(pg, [ann, bob])
        shared = host.forwards - forwards
        pools = {s: pg.ctx.engines.backend(p) for s, p in ((ann, mine), (bob, theirs))}
        steps = {}
        for session, backend in pools.items():
            assert backend is not None
            own = set(pg.ctx.visitors.requests_of(session))
            other = set(pg.ctx.visitors.requests_of(bob if session == ann else ann))
            stats = backend.stats()
            assert stats.n_pages == 40 and stats.evictions > 0, "the visitor's own 40 pages, under pressure"
            assert stats.finished == len(EVICTION.prompts), "their own requests only"
            events = backend.events(after=0)
            assert {e.request for e in events if isinstance(e, RequestAdmitted)} == own
            assert {e.request for e in events if isinstance(e, PageStored)} <= own
            snapshot = backend.snapshot()
            assert len(snapshot.pages) == 40
            assert {p.stored_by for p in snapshot.pages if p.stored_by is not None} <= own
            assert all(set(s.requests) <= own for s in backend.history(0))
            assert backend.request_info(sorted(other)) == []
            recording = pg.ctx.visitors.peek(session).recording
            assert recording is not None and recording.closed and set(recording.request_ids) == own
            line = pg.live.refresh(None, request(session))[pg.ctx.ui.cache.stats]
            assert "your own small pool" in line and "only you on it now" in line, line
            steps[session] = stats.steps
        # one run's steps, not two: the two pools' tokens went through the same forwards
        assert shared < 1.3 * max(steps.values()) < steps[ann] + steps[bob], (shared, steps)
        shared_engine = pg.ctx.engines.backend(SMALL_POOL_PROFILE)
        assert shared_engine is None or shared_engine.stats().query_tokens == 0, "nobody ran on the shared pool"


def test_a_visitor_who_chooses_the_shared_pool_shares_it_and_past_the_reserve_is_told():
    with playground(tenant_pages=40) as pg:
        pg.setup.lesson(STEP_3, 0, request("first"), no_progress)
        assert pg.ctx.visitors.peek("first").profile.owner is not None, "the reserve holds one pool of 40 pages"
        update = pg.setup.lesson(STEP_3, 0, request("second"), no_progress)
        status = update[pg.ctx.ui.setup.engine.status]
        assert "taken" in status and "You share this pool" in status, status
        assert pg.ctx.visitors.peek("second").profile == SMALL_POOL_PROFILE
        update = pg.setup.share_pools(True, request("first"), no_progress)
        assert pg.ctx.visitors.peek("first").profile == SMALL_POOL_PROFILE, "the teacher's choice: one shared pool"
        assert "Everyone on this step" in update[pg.ctx.ui.setup.engine.status]
        line = pg.live.refresh(None, request("first"))[pg.ctx.ui.cache.stats]
        assert "shared with 1 other visitor" in line, line
        pg.setup.share_pools(False, request("first"), no_progress)
        assert pg.ctx.visitors.peek("first").profile.owner is not None, "back to their own pool"


def test_a_step_on_ones_own_pool_starts_from_an_empty_cache_each_visit():
    """Step 8 promises what a first visit shows; back on the step, the last visit's pages would read "another
    namespace" (stored under its fresh salt) unless the visitor's own pool starts empty again."""
    with playground() as pg:
        pg.setup.lesson(STEP_3, 0, request("ann"), no_progress)
        run_at_once(pg, ["ann"])
        own = pg.ctx.engines.backend(pg.ctx.visitors.peek("ann").profile)
        assert own is not None and own.stats().cached_pages > 0
        pg.setup.lesson(STEP_3, 0, request("ann"), no_progress)  # the class goes over the step again
        assert pg.ctx.engines.backend(pg.ctx.visitors.peek("ann").profile) is own, "the same pool of ann's own"
        assert own.stats().cached_pages == 0


WHY_MISS = next(i for i, step in enumerate(LESSON) if step.scenario == "Why did it miss?")


def own_pools(pg: Playground) -> set[str]:
    return {p.owner for p in pg.ctx.engines.built() if p.owner is not None}


def test_a_visitor_holds_one_own_pool_and_gives_it_back_on_leaving():
    """A reserve of 49 pages holds one 40-page and one 9-page pool. Ann on step 3, then step 8, holds only the
    second: so Bob still gets a 40-page pool of his own. Ann's page closes: hers goes back, and her state with it."""
    with playground(tenant_pages=49) as pg:
        pg.setup.lesson(STEP_3, 0, request("ann"), no_progress)
        pg.setup.lesson(WHY_MISS, 0, request("ann"), no_progress)
        ann = pg.ctx.visitors.peek("ann").profile
        assert ann.owner is not None and [p for p in pg.ctx.engines.built() if p.owner] == [ann]
        update = pg.setup.lesson(STEP_3, 0, request("bob"), no_progress)
        assert pg.ctx.visitors.peek("bob").profile.owner is not None, update[pg.ctx.ui.setup.engine.status]
        pg.setup.leave(request("ann"))
        assert own_pools(pg) == {pg.ctx.visitors.peek("bob").profile.owner}
        assert pg.ctx.visitors.peek("ann").profile == DEFAULT_PROFILE, "a fresh visitor: ann's state is gone"
        host = pg.ctx.engines.ensure(DEFAULT_PROFILE).engine
        assert host is not None and [t.pool.n_pages for t in host.tenants] == [40]


def test_an_own_pool_given_back_during_its_run_goes_when_the_run_ends():
    with playground() as pg:
        pg.setup.lesson(STEP_3, 0, request("ann"), no_progress)
        step_3 = pg.ctx.visitors.peek("ann").profile
        run = pg.runs.run(fields(pg), request("ann"))
        next(run)  # streaming on ann's step-3 pool
        pg.setup.lesson(WHY_MISS, 0, request("ann"), no_progress)
        assert step_3 in pg.ctx.engines.built(), "a pool a run holds stays until that run ends"
        *_, last = run
        assert not any("rror" in str(v) for v in last.values()), "the run ended as runs end"
        pool = pg.ctx.engines.backend(step_3)
        assert pool is None and step_3 not in pg.ctx.engines.built()


def test_an_idle_own_pool_is_taken_back_when_another_visitor_needs_the_reserve(monkeypatch):
    """Past the reserve, a pool idle ``OWN_POOL_RECLAIM_S`` (a page closed without its unload reaching us) goes to
    the newcomer; a pool used more recently stays, and the newcomer is told they share (the test above it)."""
    from astrai.playground.backends import engines

    with playground(tenant_pages=40) as pg:
        pg.setup.lesson(STEP_3, 0, request("gone"), no_progress)
        monkeypatch.setattr(engines, "OWN_POOL_RECLAIM_S", 0.0)
        pg.setup.lesson(STEP_3, 0, request("new"), no_progress)
        assert own_pools(pg) == {pg.ctx.visitors.peek("new").profile.owner}
