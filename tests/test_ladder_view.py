"""Why is my hit rate low? in the page: the ladder's chart from a hand-made ladder, and the callback for the
visitor's last run, their engine since it started and a shipped trace, with its exports, driven in process as
Gradio would call it (issue 44)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from astrai.explain import Cause
from astrai.lab.ladder import Gap, Ladder, Rung
from astrai.lab.report import ladder_csv
from astrai.playground.callbacks.ladder import trace_ladder
from astrai.playground.scenarios import SCENARIO_BY_NAME
from astrai.playground.views import causes
from astrai.playground.views import ladder as view
from astrai.playground.views.text import TABLE_COLUMNS
from tests.support.playground import Playground, no_progress, playground, request

PROMPT = 1000


def _rung(name: str, tokens: int) -> Rung:
    return Rung(name, tokens, tokens / PROMPT)


def _gap(name: str, above: str, below: str, causes: tuple[tuple[str, int], ...]) -> Gap:
    tokens = sum(t for _, t in causes)
    return Gap(name, above, below, tokens, tokens / PROMPT, causes)


# Worked out by hand: 1000 prompt tokens, 100 below full pages, 450 never seen, 50 lost to capacity, 100 to the
# policy, and the engine delivering 20 more than the one-at-a-time replay (a same-step hit): a negative gap.
HAND_MADE = Ladder(
    trace="hand-made",
    requests=7,
    replicas=1,
    block_size=16,
    capacity=40,
    policy="lru",
    semantics="engine",
    rungs=(
        _rung("prompt_tokens", 1000),
        _rung("reachable", 900),
        _rung("ceiling", 450),
        _rung("belady", 400),
        _rung("lru", 300),
        _rung("delivered", 320),
    ),
    gaps=(
        _gap("page_floor", "prompt_tokens", "reachable", (("partial_page", 84), ("last_token", 16))),
        _gap("never_seen", "reachable", "ceiling", (("new", 418), ("diverged", 32))),
        _gap("capacity", "ceiling", "belady", (("evicted", 50),)),
        _gap("policy", "belady", "lru", (("evicted_by_policy", 100),)),
        _gap("scheduling", "lru", "delivered", (("scheduling", -20),)),
    ),
)


def test_the_chart_draws_each_rung_and_each_gap_with_its_causes():
    fig = view.ladder_chart(HAND_MADE)
    rungs, gaps = fig.data
    assert list(rungs.y) == [r.name for r in HAND_MADE.rungs]
    assert list(rungs.x) == pytest.approx([100 * r.share for r in HAND_MADE.rungs])
    assert list(gaps.y) == [g.below for g in HAND_MADE.gaps]
    for k, gap in enumerate(HAND_MADE.gaps):
        above, below = HAND_MADE.rung(gap.above), HAND_MADE.rung(gap.below)
        # the segment spans the two rungs' bars, whichever is longer
        assert gaps.base[k] == pytest.approx(100 * min(above.share, below.share))
        assert gaps.base[k] + gaps.x[k] == pytest.approx(100 * max(above.share, below.share))
        assert gaps.text[k] == f"{gap.name.replace('_', ' ')} {gap.tokens:,}"
        hover = gaps.customdata[k][0]
        listed = dict(re.findall(r"<br>([a-z ]+): (-?[\d,]+) tokens", hover))
        assert listed == {c.replace("_", " "): f"{t:,}" for c, t in gap.causes}, hover
        assert sum(int(t.replace(",", "")) for t in listed.values()) == gap.tokens
    assert gaps.marker.color[-1] == view.GAIN_COLOUR and gaps.marker.color[0] == view.LOSS_COLOUR


def test_the_caption_says_exactly_what_is_counted():
    words = view.caption(HAND_MADE, view.LAST_RUN, ("a note",))
    for said in ("**your last run**", "7 requests", "1,000 prompt tokens", "pages of 16 tokens", "**40 pages**"):
        assert said in words, words
    assert "policy **lru**" in words and "'engine'" in words and "pages of an engine's pool" in words
    assert words.endswith("a note")


def test_a_ladder_with_a_second_tier_shows_its_rung_and_says_so():
    """The lab's ladder with a tier (A, B, A on 2 pages, a tier 2 of 1 block written on_evict): the chart has the
    tier's rung and its gap, and the caption names the tier and what its rung counts."""
    from astrai.lab.ladder import ladder
    from astrai.lab.trace import Trace, TraceRequest

    requests = tuple(TraceRequest(t, 3, 1, (ids, 9 + t)) for t, ids in enumerate((1, 2, 1)))
    built = ladder(Trace(requests, 2, "hand"), 2, "lru", tier2=1, write="on_evict")
    rungs, gaps = view.ladder_chart(built).data
    assert list(rungs.y)[-2:] == ["lru + tier 2", "lru"]
    assert gaps.text[-1] == "tier 2" and "loaded from tier2: 2 tokens" in gaps.customdata[-1][0]
    words = view.caption(built, "hand")
    assert "policy **lru**, behind it a second tier of **1 blocks** (LRU) written on_evict" in words
    assert "'lru + tier 2' counts both tiers' hits" in words
    assert "second tier" not in view.caption(HAND_MADE, "hand")


def test_an_engine_with_a_second_tier_is_said_to_deliver_what_the_replay_has_no_tier_for():
    """The visitor's ladder replays no tier: on an engine with one, its caption says the tier's loads show in the
    scheduling gap."""
    from astrai.observation import CacheStats, RequestInfo, TierStats
    from astrai.playground.callbacks.ladder import visitor_ladder

    tier = TierStats(**dict.fromkeys(f.name for f in dataclasses.fields(TierStats)))  # type: ignore[arg-type]
    base = dict.fromkeys(f.name for f in dataclasses.fields(CacheStats))
    fields = dict(finished=1, cancelled=0, failed=0, generated_tokens=0, steps=1, prefix_caching=True)
    stats = CacheStats(**(base | fields | {"page_size": 4, "n_pages": 8, "eviction": "lru"}))
    info = RequestInfo(0, "finished", 10, 0, 2, 0, tuple(range(10)), (), 0.1, 1.0, None)
    for second_tier, said in ((None, False), (tier, True)):
        engine = SimpleNamespace(
            replicas=(None,), stats=lambda t=second_tier: dataclasses.replace(stats, second_tier=t), events=lambda _: []
        )
        counted = visitor_ladder(engine, [info], view.ENGINE)
        assert not isinstance(counted, str), counted
        assert ("show in the scheduling gap (the lab's ladder replays a tier" in " ".join(counted.notes)) == said


@pytest.fixture(scope="module")
def pg():
    with playground() as pg:
        yield pg


def run(pg: Playground, session: str, **changes: object) -> None:
    for _ in pg.runs.run(pg.fields(**changes), request(session)):
        pass
    pg.runs.after_run(request(session))


def ladder_of(update: dict, pg: Playground) -> dict:
    """The ladder as its JSON download has it (the chart and the files are made from the same one)."""
    return json.loads(downloaded(update, pg, "json").read_text())


def downloaded(update: dict, pg: Playground, kind: str) -> Path:
    """The file a download button of the update serves (Gradio's copy of the visitor's file)."""
    return Path(update[pg.ctx.ui.ladder.downloads[kind]].value["path"])


def test_the_ladder_of_your_last_run_and_of_your_engine_delivers_what_the_engine_reported(pg):
    a, b, views = "ladder-a", "ladder-b", pg.ctx.ui.ladder
    early = pg.ladders.compute(view.LAST_RUN, "lru", None, request(a), no_progress)
    assert "press Run first" in early[views.note] and early[views.chart] is None
    prefix = "Once upon a time there was a little dog who liked to run in the park with his red ball every day. "
    run(pg, b, n_panels=2, shared_prefix=prefix, prompt_1="He ran.", prompt_2="She sat.", max_tokens=2)
    run(pg, a, n_panels=3, shared_prefix=prefix, prompt_1="A cat.", prompt_2="A hen.", prompt_3="A pig.", max_tokens=2)
    backend = pg.ctx.engines.backend(pg.ctx.visitors.peek(a).profile)
    shown = pg.ctx.visitors.peek(a).shown
    infos = backend.request_info(list(shown.request_ids))

    last = pg.ladders.compute(view.LAST_RUN, "arc", None, request(a), no_progress)
    counted = ladder_of(last, pg)
    assert counted["requests"] == 3 and counted["policy"] == backend.stats().eviction  # the engine's, not "arc"
    assert counted["capacity"] == backend.stats().n_pages and counted["block_size"] == backend.stats().page_size
    assert counted["rungs"]["prompt_tokens"]["tokens"] == sum(i.prompt_tokens for i in infos)
    assert counted["rungs"]["delivered"]["tokens"] == sum(i.cached_tokens for i in infos)
    assert counted["rungs"]["delivered"]["tokens"] > 0, "panels 2 and 3 hit the prefix"
    assert last[views.chart].data[0].x[-1] == pytest.approx(100 * counted["rungs"]["delivered"]["share"])
    assert "**your last run**" in last[views.note] and "3 requests" in last[views.note]

    engine = pg.ladders.compute(view.ENGINE, "lru", None, request(a), no_progress)
    everyone = backend.request_info(pg.ctx.visitors.requests())
    counted = ladder_of(engine, pg)
    assert counted["requests"] == len(everyone) >= 5  # b's requests too
    assert counted["rungs"]["delivered"]["tokens"] == sum(i.cached_tokens for i in everyone)
    assert counted["rungs"]["prompt_tokens"]["tokens"] == sum(i.prompt_tokens for i in everyone)
    for gap in counted["gaps"]:
        assert sum(gap["causes"].values()) == gap["tokens"]
    assert "no one's text is read" in engine[views.note]


def test_a_shipped_trace_is_computed_once_and_its_exports_are_self_contained(pg):
    source = next(s for s in view.TRACE_FILES if "synthetic" in s)
    trace_ladder.cache_clear()
    a, b, views = "trace-a", "trace-b", pg.ctx.ui.ladder
    shown = pg.ladders.compute(source, "lru", 100, request(a), no_progress)
    pg.ladders.compute(source, "lru", 100, request(b), no_progress)
    assert trace_ladder.cache_info().misses == 1 and trace_ladder.cache_info().hits == 1
    counted = ladder_of(shown, pg)
    assert counted["trace"] == "synthetic_trace.jsonl" and counted["capacity"] == 100 and "delivered" not in counted
    assert "**100 pages**" in shown[views.note] and "pages of 512 tokens" in shown[views.note]
    built = trace_ladder(view.TRACE_FILES[source], 100, "lru", "engine")
    assert counted == json.loads(json.dumps(built.to_dict()))  # the JSON round-trips
    files = {kind: downloaded(shown, pg, kind) for kind in views.downloads}
    html = files["html"].read_text()
    assert "<svg" in html and "<script" not in html.lower() and not re.search(r"(src|href)=\"?https?:", html)
    assert files["csv"].read_text() == ladder_csv(built)
    assert {f.name for f in pg.ladders.folder(a).iterdir()} == {f.name for f in files.values()}
    mine = pg.ladders.folder(a)
    assert mine != pg.ladders.folder(b), "each visitor's files are their own"
    pg.ladders.compute(source, "lru", 100, request(a), no_progress)
    assert not mine.exists() and pg.ladders.folder(a).exists(), "a visitor's previous files are removed"


def test_the_lessons_end_points_at_the_ladder_of_the_visitors_engine(pg):
    """The end's text: 'your engine since it started' gives a ladder from every prompt token down to what the
    engine served from its cache ('delivered'), each gap split into causes. After the last step (the visitor's own
    pool), on the end page, that ladder's top rung is the step's prompt tokens and its last the step's cached tokens,
    as the request table counted them."""
    session, ui, end = "ladder-end", pg.ctx.ui, pg.ctx.lesson.end
    assert ui.ladder.compute.value in end.text and view.ENGINE in end.text and "'delivered'" in end.text
    step = len(pg.ctx.lesson.steps) - 1
    loaded = pg.setup.lesson(step, 0, request(session), no_progress)
    scenario = SCENARIO_BY_NAME[pg.ctx.lesson.steps[step].scenario]
    fields = {f"prompt_{i + 1}": p for i, p in enumerate(scenario.prompts)}
    fields |= {"n_panels": len(scenario.prompts), "shared_prefix": scenario.prefix, "max_tokens": scenario.max_tokens}
    run(pg, session, **fields, cache_namespace=loaded[ui.form.cache_namespace])
    table = pg.runs.after_run(request(session))[ui.cache.table]
    pg.setup.lesson(step, 1, request(session), no_progress)  # Lesson ▶: the end
    shown = pg.ladders.compute(view.ENGINE, "lru", None, request(session), no_progress)
    counted = ladder_of(shown, pg)
    prompt, cached = TABLE_COLUMNS.index("prompt tokens"), TABLE_COLUMNS.index(causes.CAUSES[Cause.CACHED][0])
    assert counted["rungs"]["prompt_tokens"]["tokens"] == sum(int(row[prompt]) for row in table)
    assert counted["rungs"]["delivered"]["tokens"] == sum(int(row[cached]) for row in table) > 0
    assert list(counted["rungs"])[-1] == "delivered"
    assert all(sum(g["causes"].values()) == g["tokens"] for g in counted["gaps"])


def test_a_fleets_ladder_puts_each_request_on_the_replica_that_served_it():
    """A vLLM fleet, as its backend reports it (no policy, no salts, replicas named by their KV events): the same
    10-token prompt on replica 1, replica 2, then replica 1 again (pages of 4: 2 reusable). One pool would serve the
    second and the third (16 tokens); replica 1's own pool serves only the third (8): 8 lost to routing. A fourth
    request whose replica no event names is left out, and the caption says so."""
    from astrai.observation import CacheStats, RequestInfo
    from astrai.playground.backends.protocol import Served
    from astrai.playground.callbacks.ladder import visitor_ladder

    def stats(n_pages: int | None) -> CacheStats:
        base = dict.fromkeys(f.name for f in dataclasses.fields(CacheStats))
        fields = dict(finished=4, cancelled=0, failed=0, generated_tokens=0, steps=1, prefix_caching=True)
        return CacheStats(**(base | fields | {"page_size": 4, "n_pages": n_pages}))

    replicas = tuple(
        SimpleNamespace(name=f"replica {r}", label=f"replica {r} (127.0.0.1:80{r})", stats=lambda: stats(100))
        for r in (1, 2)
    )
    prompt = tuple(range(10))
    infos = [
        RequestInfo(i, "finished", 10, hit, 2, 0, prompt, (), 0.1, 1.0, None) for i, hit in enumerate((0, 0, 8, 0))
    ]
    where = {0: replicas[0], 1: replicas[1], 2: replicas[0]}
    fleet = SimpleNamespace(
        replicas=replicas,
        stats=lambda: stats(200),
        events=lambda after: [],
        served_by=lambda ids: {i: Served(where[i].label, "its KV events") for i in ids if i in where},
    )
    counted = visitor_ladder(fleet, infos, view.ENGINE)
    assert not isinstance(counted, str), counted
    built = counted.ladder
    assert (built.replicas, built.requests, built.capacity, built.policy) == (2, 3, 100, "lru")
    assert [(r.name, r.tokens) for r in built.rungs[-3:]] == [("single_pool", 16), ("lru", 8), ("delivered", 8)]
    assert built.gap("routing").causes == (("other_replica", 8),)
    words = view.caption(built, view.ENGINE, counted.notes)
    assert "1 requests whose replica is not known are left out" in words and "on 2 replicas" in words
    assert "does not report its eviction policy" in words and "do not say each request's namespace" in words
