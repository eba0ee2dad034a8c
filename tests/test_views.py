"""The pure view functions, without a browser: the privacy rule, badges and the chart series."""

from __future__ import annotations

import dataclasses

import pytest

from astrai.observation import CacheStats, PageEvicted, PageRecord, RequestInfo, StepSample, TierStats
from astrai.playground.views import charts, tree
from astrai.playground.views import pages as page_rules
from astrai.playground.views import series as chart_series
from astrai.playground.views import text as views
from astrai.playground.views.pages import Owner

ME, THEM = "session-me", "session-them"
OWNERS = {1: Owner(ME, 0), 2: Owner(ME, 1), 7: Owner(THEM, 0)}


def record(page: int, state: str, requests=(), stored_by=None, tokens=(5, 6)) -> PageRecord:
    return PageRecord(
        page=page,
        state=state,
        ref_count=len(requests),
        lru_rank=0 if state == "cached" else None,
        requests=tuple(requests),
        chain_pos=0 if tokens else -1,
        key=b"k" if stored_by is not None else None,
        parent_key=None,
        stored_by=stored_by,
        hits=0,
        token_ids=tuple(tokens),
    )


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def test_a_visitor_sees_only_the_text_of_pages_their_requests_use_or_stored():
    records = [
        record(0, "in_use", requests=[1, 7], stored_by=7),  # theirs, but my panel 1 uses it now
        record(1, "cached", stored_by=2),  # mine, cached
        record(2, "cached", stored_by=7),  # theirs, cached
        record(3, "in_use", requests=[7]),  # theirs, still being filled
        record(4, "in_use", requests=[7], stored_by=1),  # they hit a page I stored
        record(5, "cached", stored_by=99),  # a request nobody remembers
        record(6, "free", tokens=()),
    ]
    pages = page_rules.page_views(records, OWNERS, ME, evicted={2}, decode=decode)
    assert [p.text is not None for p in pages] == [True, True, False, False, True, False, False]
    assert pages[0].panels == (0,) and pages[0].other_users == 1
    assert pages[3].panels == () and pages[3].other_users == 1
    assert pages[2].just_evicted and not pages[1].just_evicted
    theirs = page_rules.page_views(records, OWNERS, THEM, evicted=set(), decode=decode)
    assert [p.text is not None for p in theirs] == [True, False, True, True, True, False, False]


def info(**changes) -> RequestInfo:
    base = RequestInfo(
        id=1,
        status="running",
        prompt_tokens=40,
        cached_tokens=32,
        generated_tokens=3,
        preemptions=0,
        prompt_ids=(0, 5, 6),
        output_ids=(1, 2, 3),
        ttft=0.123,
        tokens_per_s=50.0,
        error=None,
    )
    return dataclasses.replace(base, **changes)


def test_badges_say_what_was_counted():
    finished = info(status="finished")
    assert views.badge(finished) == "**40** prompt tokens · **32** cached (80%) · TTFT 0.12 s · 50.0 tok/s"
    assert views.badge(info(status="finished", cached_tokens=None, ttft=None, tokens_per_s=None)) == (
        "**40** prompt tokens"
    )


def test_a_running_badge_shows_only_settled_figures_so_it_changes_rarely():
    assert views.badge(info()) == "**40** prompt tokens · **32** cached (80%) · TTFT 0.12 s · streaming…"
    assert views.badge(info(tokens_per_s=99.0)) == views.badge(info()), "the moving rate waits for the end"
    assert views.badge(info(status="waiting", cached_tokens=None, ttft=None)).endswith("waiting…")
    assert views.badge(info(status="cancelled", preemptions=2)).endswith("preempted ×2 · cancelled")
    assert views.badge(None) == ""


def test_a_special_token_reads_the_same_in_every_view():
    """The start-of-text token read "<s>" in the prompt's tokens but its raw text in the page hovers and the tree:
    every view writes tokens through ``readable``."""
    shown = views.readable(decode, {0})
    assert shown([0, 5, 0, 6]) == f"{views.SPECIAL_TOKEN_TEXT}<5>{views.SPECIAL_TOKEN_TEXT}<6>"
    pages = page_rules.page_views([record(0, "cached", stored_by=1, tokens=(0, 5))], OWNERS, ME, set(), shown)
    assert pages[0].text == f"{views.SPECIAL_TOKEN_TEXT}<5>"
    shape = tree.prefix_tree([record(0, "cached", stored_by=1, tokens=(0, 5))], [], OWNERS, ME, shown)
    assert shape.nodes[0].label == f"{views.SPECIAL_TOKEN_TEXT}<5>"


def test_with_prefix_caching_off_badges_and_rows_say_off_not_zero_cached():
    off = info(status="finished", cached_tokens=0)
    assert "prefix caching off" in views.badge(off, caching=False) and "cached" not in views.badge(off, False)
    assert views.request_rows([off], ["p"], caching=False)[0][4] == "off"


def stats(**changes) -> CacheStats:
    zero = {f.name: 0 for f in dataclasses.fields(CacheStats) if f.default is dataclasses.MISSING}
    base = dict(n_pages=16, page_size=4, hit_rate=0.0, recent_hit_rate=0.0, prefix_caching=True)
    return CacheStats(**(zero | base | changes))


def sample(
    step: int, t: float, hits: int = 0, queries: int = 0, evictions: int = 0, tier_pages: int | None = None
) -> StepSample:
    return StepSample(
        step=step,
        time=t,
        duration_s=0.01,
        free_pages=10,
        used_pages=6,
        cached_pages=0,
        prefill_tokens=queries,
        decode_tokens=0,
        hit_tokens=hits,
        query_tokens=queries,
        evictions=evictions,
        preemptions=0,
        requests=(1,),
        sampled=(),
        page_changes=(),
        tier_pages=tier_pages,
    )


def test_series_recover_the_cumulative_hit_rate_at_every_step():
    history = [
        sample(1, 100.0, hits=0, queries=40),
        sample(2, 100.5),
        sample(3, 101.0, hits=30, queries=40, evictions=2),
    ]
    now_stats = stats(hit_tokens=30, query_tokens=80, hit_rate=30 / 80, free_pages=16)
    data = chart_series.series(history, now_stats, now=102.0)
    assert data.x_title == "seconds ago" and data.marker is None
    assert data.ages == [-2.0, -1.0, 0.0]  # step 2 repeats step 1: a step-shaped line does not need it
    assert data.hit_rate == [0.0, 30 / 80, 30 / 80]
    assert data.step_hit_rate == [0.0, 0.75] and data.step_hit_ages == [-2.0, -1.0]
    assert data.evictions == [0, 2, 2]
    assert data.free[-1] == 16  # the right edge is now, not the last step


def test_series_keep_only_the_window_and_never_exceed_one():
    history = [sample(1, 0.0, hits=10, queries=10), sample(2, 500.0, hits=5, queries=10)]
    data = chart_series.series(history, stats(hit_tokens=15, query_tokens=20, hit_rate=0.75), now=510.0, window_s=60)
    assert data.ages == [-10.0, 0.0]
    assert data.hit_rate == [0.75, 0.75]
    assert all(r is None or 0 <= r <= 1 for r in data.hit_rate)


def test_the_stats_line_names_what_the_hit_rate_counts_in_plain_words():
    line = views.stats_line(stats(hit_tokens=30, query_tokens=80, hit_rate=0.375, readmitted_query_tokens=9))
    assert "**30** of 80 prompt tokens came from the cache (38%)" in line
    assert "preempted requests, re-admitted, found 0 of their 9 tokens again (counted apart)" in line
    assert line.index("came from the cache") < line.index("preempted requests"), "plain words before the jargon"


@pytest.mark.parametrize(
    ("forward", "said"),
    [
        ("compiling", "forward: **eager** while the compiled one is built"),
        ("compiled", "forward: **compiled**"),
        ("failed", "forward: **eager** (the compiled one could not be built: the log says why)"),
        ("eager", "forward: **eager**"),
    ],
)
def test_the_stats_line_says_which_forward_serves(forward, said):
    assert views.stats_line(stats(forward=forward)).endswith(said)


def test_a_backend_without_a_forward_to_report_says_nothing_of_it():
    assert "forward" not in views.stats_line(stats(forward=None)), "vLLM's server has no such thing"


def test_with_prefix_caching_off_the_stats_line_says_off_not_zero_percent():
    line = views.stats_line(stats(prefix_caching=False, hit_tokens=0, query_tokens=0, hit_rate=0.0))
    assert "prefix caching is off" in line and "%" not in line


def test_with_prefix_caching_off_the_hit_rate_chart_says_off_and_draws_no_zero():
    from astrai.playground.views import charts

    off = stats(prefix_caching=False)
    data = chart_series.series([sample(1, 100.0, hits=0, queries=0)], off, now=101.0)
    figure = charts.hit_rate_chart(data).to_plotly_json()
    assert "prefix caching is off" in figure["layout"]["title"]["text"]
    assert all(y is None for y in figure["data"][0]["y"]), "no 0% where nothing was looked up"


def test_the_engine_line_names_the_pool_and_who_shares_it():
    from astrai.playground.backends.protocol import EngineView

    line = views.engine_line(EngineView("small pool", "40 pages × 16 tokens, batch 8, float32", 3), "tiny")
    assert line == (
        "**Your engine:** small pool · 40 pages × 16 tokens, batch 8, float32 · shared with 2 other visitors · "
        "model: tiny"
    )
    assert "only you" in views.engine_line(EngineView("default", "d", 1), "tiny")


def test_a_run_whose_requests_are_unknown_has_no_summary_rather_than_an_error():
    """An engine that stopped under a run knows none of its requests: the summary is None (it raised
    AttributeError on the None entries)."""
    assert views.run_summary([None, info()]) is None
    assert views.run_summary([info(), info(cached_tokens=8)]).computed_tokens == 8 + 32


def test_what_caching_saved_counts_the_tokens_preemptions_made_it_compute_again():
    """48 prompt tokens computed where the engine ran 308 after 3 preemptions: recomputation is prefill work."""
    summary = views.run_summary([info(cached_tokens=0, prompt_tokens=48, preemptions=3, recomputed_tokens=260)])
    assert summary is not None and summary.computed_tokens == 308 and summary.recomputed_tokens == 260
    note = views.savings_note(summary, None, small_model=True)
    assert "**308** prefill tokens were computed for 48 prompt tokens" in note and "260 were computed again" in note


def test_long_histories_are_thinned_for_the_browser_but_keep_their_ends():
    history = [sample(i, 1000.0 + i / 100, hits=i % 2, queries=1, evictions=i % 3 == 0) for i in range(1, 4001)]
    data = chart_series.series(history, stats(hit_tokens=2000, query_tokens=4000, hit_rate=0.5), now=1041.0)
    assert len(data.ages) <= chart_series.MAX_POINTS + 2
    assert data.ages[0] == round(history[0].time - 1041.0, 3) and data.ages[-1] == 0.0
    assert data.evictions[-1] == sum(s.evictions for s in history) and data.hit_rate[-1] == 0.5


def chain(n: int, branch_at: int | None = None) -> list[PageRecord]:
    """n cached pages in one chain (keys k0, k1, ...), plus a second child under page ``branch_at``."""
    records = [
        dataclasses.replace(
            record(i, "cached", stored_by=2), key=b"k%d" % i, parent_key=b"k%d" % (i - 1) if i else None
        )
        for i in range(n)
    ]
    if branch_at is not None:
        extra = record(n, "cached", stored_by=2)
        records.append(dataclasses.replace(extra, key=b"b", parent_key=b"k%d" % branch_at))
    return records


def test_the_prefix_tree_keeps_every_page_as_a_node_when_small_and_collapses_chains_when_large():
    small = tree.prefix_tree(chain(5, branch_at=2), [], OWNERS, ME, decode)
    assert small.pages == len(small.nodes) == 6 and small.cached == 6
    assert {n.parent for n in small.nodes if n.id == b"b".hex()} == {b"k2".hex()}
    large = tree.prefix_tree(chain(200, branch_at=99), [], OWNERS, ME, decode)
    assert large.pages == 201 and sum(len(n.pages) for n in large.nodes) == 201
    assert len(large.nodes) == 3  # pages 0-99, the branch, and pages 100-199: split where the chain branches


def test_the_tree_draws_the_last_run_and_gathers_the_rest_but_counts_the_whole_index():
    """Lesson step 4's tree was crowded by every earlier run: with a focus, the run's pages (and the pages they chain
    from, which it hit) are drawn and the rest gathered into one node; the counts stay the whole index's."""
    records = chain(5, branch_at=2)  # k0..k4 and b (under k2), stored by request 2
    records[4] = dataclasses.replace(records[4], stored_by=7)  # k4: another session's
    focused = tree.prefix_tree(records, [], OWNERS, ME, decode, focus={99})
    assert focused.pages == 6 and focused.focused == 0 and focused.others == 6
    only_b = [r if r.key != b"b" else dataclasses.replace(r, stored_by=99) for r in records]
    shape = tree.prefix_tree(only_b, [], {**OWNERS, 99: Owner(ME, 0)}, ME, decode, focus={99})
    drawn = {n.id for n in shape.nodes}
    assert drawn == {b"b".hex(), b"k2".hex(), b"k1".hex(), b"k0".hex(), tree.OTHERS}
    assert shape.pages == 6 and shape.focused == 4 and shape.others == 2 and shape.cached == 6


def test_evicted_pages_in_the_tree_are_not_called_another_sessions_and_its_title_adds_up():
    """Issue 43: the tree labelled the visitor's own evicted pages "other session", and its title's counts did not
    add up (39 pages; 39 of them the run's, 13 gathered, 5 evicted): a ghost whose parent was gathered was counted
    with the others, and no ghost says whose it was (an eviction does not keep it)."""
    records = chain(3)  # k0 <- k1 <- k2, stored by request 2 (mine)
    records.append(dataclasses.replace(record(3, "cached", stored_by=7), key=b"o0", parent_key=None))  # theirs
    ghosts = [
        PageEvicted(1, 1, 0.0, page=9, key=b"g1", parent_key=b"k2", token_ids=(5,)),  # after a page of my run
        PageEvicted(2, 1, 0.0, page=8, key=b"g2", parent_key=b"o0", token_ids=(5,)),  # after a gathered page
        PageEvicted(3, 1, 0.0, page=7, key=b"g3", parent_key=None, token_ids=(5,)),
    ]
    shape = tree.prefix_tree(records, ghosts, OWNERS, ME, decode, focus={2})
    assert shape.pages == shape.focused + shape.others == 4 and (shape.focused, shape.others) == (3, 1)
    drawn = {n.id: n for n in shape.nodes}
    assert [drawn[g.key.hex()].label for g in ghosts] == ["evicted"] * 3
    assert [drawn[g.key.hex()].parent for g in ghosts] == [b"k2".hex(), tree.OTHERS, tree.ROOT]
    title = charts.prefix_tree(shape, lambda i: f"panel {i + 1}").layout.title.text
    assert title == (
        "Prefix tree: 4 pages (0 in use, 4 cached); 3 of them your last run's, 1 gathered as others; "
        "3 more just evicted (red)"
    )


def test_a_large_pool_s_page_map_keeps_cells_large_enough_to_see():
    """Issue 43: the default pool's 2,048 pages were laid out 79 to a row, 5-px cells: step 1's x-marked pages were
    specks. The columns are capped; only the rows up to the last busy page are drawn."""
    pages = page_rules.page_views([record(p, "free") for p in range(2048)], OWNERS, ME, set(), decode)
    grid = charts.page_grid(pages, lambda i: f"panel {i + 1}")
    assert grid.cols == charts.MAX_COLS and grid.rows == charts.MIN_ROWS
    assert grid.shown == f"pages 0–{charts.MAX_COLS * charts.MIN_ROWS - 1} of 2048; the rest are free"


def tier(**changes) -> TierStats:
    base = dict(
        medium="file", write_policy="on_evict", capacity_pages=64, pages=12, hit_tokens=48, written_pages=20,
        loaded_pages=3, evictions=1, bytes_written=2_000_000, bytes_loaded=300_000, write_seconds=0.01,
        load_seconds=0.0004, enabled=True,
    )  # fmt: skip
    return TierStats(**(base | changes))  # type: ignore[arg-type]


def test_the_stats_line_shows_the_second_tier_from_its_stats_when_the_engine_has_one():
    line = views.stats_line(stats(hit_tokens=64, query_tokens=80, hit_rate=0.8, second_tier=tier()))
    assert line.endswith(
        "**Second tier** (file, written on eviction from the pool): **12** of 64 pages held · **48** of the reused "
        "prompt tokens loaded from it · 3 pages loaded (0.3 MB) in 0.4 ms · 20 written (2.0 MB) · 1 evicted from it"
    )
    assert "Second tier" not in views.stats_line(stats()), "an engine without one says nothing of it"
    off = views.stats_line(stats(second_tier=tier(enabled=False, error="disk full")))
    assert off.endswith("**Second tier** (file): switched off after an error: disk full")


def test_occupancy_draws_the_second_tiers_pages_on_an_axis_of_its_own_when_the_engine_has_one():
    history = [sample(1, 100.0, tier_pages=0), sample(2, 100.5, tier_pages=5), sample(3, 101.0, tier_pages=9)]
    data = chart_series.series(history, stats(second_tier=tier(pages=12)), now=102.0)
    assert data.tier == [0, 5, 9, 12], "each step's pages held, then now's"
    drawn = [t for t in charts.occupancy_chart(data).data if t.name == charts.TIER_LINE]
    assert len(drawn) == 1 and list(drawn[0].y) == [0, 5, 9, 12] and drawn[0].yaxis == "y2"
    without = chart_series.series(history, stats(), now=102.0)
    assert without.tier is None and all(t.name != charts.TIER_LINE for t in charts.occupancy_chart(without).data)


def test_plotlys_classes_are_imported_before_serving():
    """A fresh process: after ``import_plotly_classes`` (build_demo calls it), a figure with a titled layout, axes,
    bars and an icicle imports no more plotly module, so no visitor's thread races another to import one (CI: one
    of 30 students got ``No module named 'plotly.graph_objs.layout._title'``)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from astrai.playground.views import charts\n"
        "import plotly.graph_objects as go\n"
        "charts.import_plotly_classes()\n"
        "before = {m for m in sys.modules if m.startswith('plotly')}\n"
        "go.Figure([go.Bar(x=[1], y=[2], marker=dict(color='red')), go.Scatter(x=[1], y=[1], line=dict(width=1))],\n"
        "          layout=dict(title=dict(text='t'), xaxis=dict(title=dict(text='x')), legend=dict(x=0),\n"
        "                      margin=dict(l=0), annotations=[dict(text='a')], shapes=[dict(type='line')]))\n"
        "go.Figure(go.Icicle(labels=['a'], parents=[''], marker=dict(colors=['red'])))\n"
        "go.Figure(go.Heatmap(z=[[1]], colorscale='Blues'))\n"
        "print(sorted({m for m in sys.modules if m.startswith('plotly')} - before))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
