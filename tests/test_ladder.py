"""The hit-rate ladder: ladders worked out by hand (one engine, namespaces, a fleet, what was delivered, a second
tier), its order and its causes on random traces (with a tier too), and its three outputs (JSON, CSV, a
self-contained HTML report)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.eviction import POLICIES
from astrai.lab.ladder import Ladder, LadderError, fleet_ladder, ladder
from astrai.lab.replay import SEMANTICS, Replay
from astrai.lab.report import ladder_csv, ladder_html
from astrai.lab.tiered import run_tiered
from astrai.lab.trace import Trace, TraceRequest

# Hand-made ladders with evictions are worked out under today's replay rules, which the replay will keep as
# semantics="trace" once it takes a semantics (its new default, an engine's pool, evicts at other moments).
TODAY = "trace"


def chains(prompts: list[str], partial: bool | list[bool] = True, start: int = 0) -> tuple[TraceRequest, ...]:
    """One request per string, one full block of 2 tokens per letter (ids name their prefix, as Mooncake's do),
    plus, where ``partial``, one token in a partial block of its own."""
    ids: dict[str, int] = {}
    partials = [partial] * len(prompts) if isinstance(partial, bool) else partial
    requests = []
    for i, (letters, extra) in enumerate(zip(prompts, partials, strict=True)):
        full = [ids.setdefault(letters[: j + 1], ord(letters[j]) * 1000 + j) for j in range(len(letters))]
        blocks = (*full, 10_000 + start + i) if extra else tuple(full)
        requests.append(TraceRequest(start + i, 2 * len(letters) + extra, 1, blocks))
    return tuple(requests)


def tokens(result: Ladder) -> dict[str, int]:
    return {r.name: r.tokens for r in result.rungs}


def causes(result: Ladder) -> dict[str, dict[str, int]]:
    return {g.name: dict(g.causes) for g in result.gaps}


def test_a_ladder_by_hand_with_evictions_and_what_was_delivered():
    """Capacity 2 blocks; A, AB, C, AB, C, AB, each with a partial block of one token (tokens 3 5 3 5 3 5 = 24).

    * reachable: every full block (9 blocks, 18 tokens); page floor 6 = the 6 partial tokens, no last-token page.
    * ceiling: A new; AB hits A, B new (A was never continued: an extension); C new; AB 2; C 1; AB 2: 6 blocks
      (12 tokens); never seen 18 - 12 = 6 = A, B, C new (3 blocks), nothing diverged.
    * belady 5 blocks, lru 3 (worked out in test_lab's test_chains_by_hand): capacity 12 - 10 = 2, policy 10 - 6 = 4.
    * delivered 0 + 2 + 0 + 2 + 0 + 4 = 8 > lru's 6: scheduling is -2 (same-step sharing delivers more).
    """
    trace = Trace(chains(["A", "AB", "C", "AB", "C", "AB"]), 2, "hand")
    result = ladder(trace, 2, "lru", delivered=[0, 2, 0, 2, 0, 4], semantics=TODAY)
    assert tokens(result) == {
        "prompt_tokens": 24,
        "reachable": 18,
        "ceiling": 12,
        "belady": 10,
        "lru": 6,
        "delivered": 8,
    }
    assert causes(result) == {
        "page_floor": {"partial_page": 6, "last_token": 0},
        "never_seen": {"new": 6, "diverged": 0},
        "capacity": {"evicted": 2},
        "policy": {"evicted_by_policy": 4},
        "scheduling": {"scheduling": -2},
    }
    assert result.rung("lru").share == 6 / 24
    assert result.gap("scheduling").tokens == -2


def test_the_page_floor_and_never_seen_by_hand():
    """Blocks of 2 tokens, no eviction (100 pages hold everything, whatever the replay's rules):

    | request | tokens | full, reusable | page floor | ceiling hit | never seen |
    |---|---|---|---|---|---|
    | AB + 1 | 5 | 2, 2 | 1 partial | 0 | A, B new |
    | AB     | 4 | 2, 1 | 2 last token (the page B) | A | - |
    | AC + 1 | 5 | 2, 2 | 1 partial | A | C diverged (A went on with B before) |
    | D + 1  | 3 | 1, 1 | 1 partial | 0 | D new (a first page can only be new) |
    | ABE + 1| 7 | 3, 3 | 1 partial | A, B | E new (AB was never continued: an extension) |

    prompt 24; page floor 4 partial + 2 last token, reachable 18; ceiling 4 blocks = 8 tokens; never seen 10 =
    new 4 blocks (8) + diverged 1 block (2). Nothing evicted: belady = lru = ceiling."""
    requests = chains(["AB", "AB", "AC", "D", "ABE"], partial=[True, False, True, True, True])
    result = ladder(Trace(requests, 2, "hand"), 100, "lru")
    assert tokens(result) == {"prompt_tokens": 24, "reachable": 18, "ceiling": 8, "belady": 8, "lru": 8}
    assert causes(result) == {
        "page_floor": {"partial_page": 4, "last_token": 2},
        "never_seen": {"new": 8, "diverged": 2},
        "capacity": {"evicted": 0},
        "policy": {"evicted_by_policy": 0},
    }


def test_another_namespace_by_hand():
    """AB + 1 in namespace x, AB + 1 in y, AC + 1 in y; blocks of 2, no eviction.

    * AB (x): A, B new. AB (y): both computed under x only: other_namespace 2 blocks, no hit.
    * AC (y): A hits (y stored it); C: A went on with B: diverged.
    prompt 15, partial 3, reachable 12; ceiling 1 block (2); never seen 10 = new 4 + other_namespace 4 + diverged 2.
    Without the namespaces the same trace shares everything: ceiling 2 + 1 blocks."""
    trace = Trace(chains(["AB", "AB", "AC"]), 2, "hand")
    result = ladder(trace, 100, "lru", namespaces=["x", "y", "y"])
    assert tokens(result)["ceiling"] == 2
    assert causes(result)["never_seen"] == {"new": 4, "diverged": 2, "other_namespace": 4}
    assert tokens(ladder(trace, 100, "lru"))["ceiling"] == 6


def test_a_fleet_by_hand():
    """Two replicas of 1 cached page each; A + 1 and B + 1 (3 tokens each) alternate, A B A B A B at t = 0..5, to
    replicas 0 1 1 0 0 1 (replica 0: A B A; replica 1: B A B).

    * In one sequence: A and B new, then 4 hits: ceiling 8 tokens. Belady at the fleet's 2 pages keeps both: 8
      (at 1 page it would serve only 2 hits). LRU on one pool of 2 pages: 8.
    * Each replica alone, 1 page: the page is always the other block when a request comes: 0 hits. Routing
      8 - 0 = 8 tokens, cached on the other replica.
    prompt 18, partial 6, reachable 12, never seen 4 (A and B new)."""
    a, b, *_ = chains(["A", "B"])
    at = lambda request, t: TraceRequest(t, request.input_length, 1, request.hash_ids)  # noqa: E731
    one = Trace((at(a, 0), at(b, 3), at(a, 4)), 2, "r0")
    two = Trace((at(b, 1), at(a, 2), at(b, 5)), 2, "r1")
    result = fleet_ladder([one, two], 1, "lru", semantics=TODAY)
    assert tokens(result) == {
        "prompt_tokens": 18,
        "reachable": 12,
        "ceiling": 8,
        "belady": 8,
        "single_pool": 8,
        "lru": 0,
    }
    assert causes(result)["routing"] == {"other_replica": 8}
    assert causes(result)["never_seen"] == {"new": 4, "diverged": 0}
    assert result.replicas == 2 and result.capacity == 1


def test_a_second_tier_by_hand():
    """An engine's pool of 2 pages (C1), blocks of 2 tokens; A + 1, B + 1, A + 1 (3 tokens each: 9; a request takes
    2 pages, its block and its partial one).

    * prompt 9, partial 3, reachable 6; ceiling: A, B new (4 tokens), then A hits: 2.
    * The pool alone (LRU, and Belady too): B's 2 pages take the free page and A's: A is evicted, the last A
      computes: 0. So Belady at C1 serves 0, and a tier serves more than the pool's own optimum.
    * Belady on one pool of C1 + C2 = 3 pages: B takes the free ones, A stays: 2 (capacity 0).
    * on_evict, C2 = 1: B's allocation evicts A into tier 2; the last A loads it: 2 tokens from tier 2. Tier gap
      2 - 0 = 2, all loaded_from_tier2; policy gap 2 - 2 = 0.
    * through, C2 = 1: A is written to tier 2 when stored, then B (stored) takes its one block: the last A finds
      neither: 0. LRU on one pool of 3 pages serves 2, so the policy gap 2 - 0 = 2 is all split_into_tiers: a
      through tier of one block only copies what the pool holds. With C2 = 2 it keeps A: 2 tokens loaded.
    """
    trace = Trace(chains(["A", "B", "A"]), 2, "hand")
    assert Replay(trace).run("belady", 2).hit_tokens == 0
    top = {"prompt_tokens": 9, "reachable": 6, "ceiling": 2, "belady (C1 + C2)": 2}
    top_causes = {
        "page_floor": {"partial_page": 3, "last_token": 0},
        "never_seen": {"new": 4, "diverged": 0},
        "capacity": {"evicted": 0},
    }
    on_evict = ladder(trace, 2, "lru", tier2=1, write="on_evict")
    assert tokens(on_evict) == {**top, "lru + tier 2": 2, "lru": 0}
    assert causes(on_evict) == {
        **top_causes,
        "policy": {"evicted_by_policy": 0, "split_into_tiers": 0},
        "tier": {"loaded_from_tier2": 2, "pool_hits_changed": 0},
    }
    assert on_evict.gap("tier").above == "lru + tier 2" and on_evict.gap("tier").below == "lru"
    through = ladder(trace, 2, "lru", tier2=1, write="through")
    assert tokens(through) == {**top, "lru + tier 2": 0, "lru": 0}
    assert causes(through)["policy"] == {"evicted_by_policy": 0, "split_into_tiers": 2}
    assert causes(through)["tier"] == {"loaded_from_tier2": 0, "pool_hits_changed": 0}
    assert causes(ladder(trace, 2, "lru", tier2=2))["tier"] == {"loaded_from_tier2": 2, "pool_hits_changed": 0}
    assert (through.tier2, through.write, on_evict.capacity) == (1, "through", 2)


@st.composite
def prefix_traces(draw: st.DrawFn) -> tuple[Trace, list[str]]:
    """Random requests that extend a prefix of an earlier one (or start afresh) with new blocks; ids chain, prompts
    end anywhere in their last block (on a page boundary too), each in one of two namespaces."""
    paths: list[list[int]] = []
    fresh = 0
    requests = []
    for i in range(draw(st.integers(1, 14))):
        ids: list[int] = []
        if paths and draw(st.booleans()):
            path = draw(st.sampled_from(paths))
            ids = path[: draw(st.integers(0, len(path)))]
        for _ in range(draw(st.integers(0 if ids else 1, 3))):
            ids.append(fresh)
            fresh += 1
        paths.append(ids)
        requests.append(TraceRequest(i, 2 * len(ids) - draw(st.integers(0, 1)), 1, tuple(ids)))
    namespaces = draw(st.lists(st.sampled_from("xy"), min_size=len(requests), max_size=len(requests)))
    return Trace(tuple(requests), 2), namespaces


@settings(max_examples=60, deadline=None)
@given(case=prefix_traces(), capacity=st.integers(0, 8), namespaced=st.booleans())
def test_the_rungs_fall_and_every_gap_is_its_causes(case, capacity, namespaced):
    """reachable >= ceiling >= belady >= every online policy, and each gap's causes sum to it (the JSON's too); the
    same requests split between two replicas keep the fleet's rungs in order down to one pool."""
    trace, namespaces = case
    ladders = {
        policy: ladder(trace, capacity, policy, namespaces=namespaces if namespaced else None, processes=1)
        for policy in POLICIES
    }
    for policy, result in ladders.items():
        rungs = tokens(result)
        assert rungs["prompt_tokens"] >= rungs["reachable"] >= rungs["ceiling"] >= rungs["belady"] >= rungs[policy]
        assert all(cause >= 0 for gap in result.gaps for _, cause in gap.causes)
        assert_gaps_are_their_causes(result)
    halves = [Trace(trace.requests[parity::2], 2, f"r{parity}") for parity in (0, 1)]
    if all(half.requests for half in halves):  # a fleet of two (its own pools may beat one: routing is signed)
        fleet = fleet_ladder(halves, capacity, "lru")
        rungs = tokens(fleet)
        assert rungs["reachable"] >= rungs["ceiling"] >= rungs["belady"] >= rungs["single_pool"]
        assert rungs["reachable"] == tokens(ladders["lru"])["reachable"]  # the same requests, in the same order
        assert_gaps_are_their_causes(fleet)


@settings(max_examples=40, deadline=None)
@given(
    case=prefix_traces(),
    capacity=st.integers(0, 8),
    tier2=st.integers(0, 8),
    semantics=st.sampled_from(SEMANTICS),
    namespaced=st.booleans(),
)
def test_a_tier_rung_sits_between_both_tiers_optimum_and_the_policy(case, capacity, tier2, semantics, namespaced):
    """With a second tier, for every policy and write policy: ceiling >= belady (C1 + C2) >= the policy + tier 2 >=
    the policy at C1 (a tier only adds hits), each gap is its causes; the tier's rung and its tier-2 hits are the
    tiered replay's own; evicted_by_policy >= 0 and, under LRU, the pool's own hits are those without the tier."""
    trace, namespaces = case
    for policy in POLICIES:
        for write in ("through", "on_evict"):
            result = ladder(
                trace,
                capacity,
                policy,
                namespaces=namespaces if namespaced else None,
                semantics=semantics,
                tier2=tier2,
                write=write,
            )
            rungs = tokens(result)
            tiered = rungs[f"{policy} + tier 2"]
            assert rungs["reachable"] >= rungs["ceiling"] >= rungs["belady (C1 + C2)"] >= tiered >= rungs[policy]
            assert_gaps_are_their_causes(result)
            assert causes(result)["policy"]["evicted_by_policy"] >= 0
            if not namespaced:  # the trace as given is what the tiered replay reads
                replayed = run_tiered(Replay(trace), policy, capacity, tier2, write, semantics)
                assert (tiered, causes(result)["tier"]["loaded_from_tier2"]) == (
                    replayed.hit_tokens,
                    replayed.tier2_hit_tokens,
                )
            if policy == "lru":
                assert causes(result)["tier"]["pool_hits_changed"] == 0


def assert_gaps_are_their_causes(result: Ladder) -> None:
    data = result.to_dict()
    for gap in data["gaps"]:
        assert sum(gap["causes"].values()) == gap["tokens"]
        assert gap["tokens"] == data["rungs"][gap["from"]]["tokens"] - data["rungs"][gap["to"]]["tokens"]


def test_bad_inputs_are_refused_with_reasons():
    trace = Trace(chains(["A", "AB"]), 2, "t")
    with pytest.raises(LadderError, match="capacity must be an integer >= 0"):
        ladder(trace, True, "lru")
    with pytest.raises(LadderError, match="policy must be one of"):
        ladder(trace, 2, "belady")
    with pytest.raises(LadderError, match="one value per request"):
        ladder(trace, 2, "lru", delivered=[0])
    with pytest.raises(LadderError, match="request 1 reports 5 cached tokens of 5"):
        ladder(trace, 2, "lru", delivered=[0, 5])
    with pytest.raises(LadderError, match="no requests"):
        ladder(Trace((), 2), 2, "lru")
    with pytest.raises(LadderError, match=r"tier2 must be an integer >= 0 \(tier 2's blocks\), got -1"):
        ladder(trace, 2, "lru", tier2=-1)
    with pytest.raises(LadderError, match="tier2 must be an integer >= 0"):
        ladder(trace, 2, "lru", tier2=True)
    with pytest.raises(LadderError, match=r"write must be one of \['through', 'on_evict'\], got 'back'"):
        ladder(trace, 2, "lru", tier2=4, write="back")
    with pytest.raises(LadderError, match="write='on_evict' is a second tier's write policy: give tier2"):
        ladder(trace, 2, "lru", write="on_evict")
    with pytest.raises(LadderError, match="delivered with a second tier is not supported"):
        ladder(trace, 2, "lru", delivered=[0, 2], tier2=4)
    with pytest.raises(LadderError, match="a fleet's ladder takes no tier2"):
        fleet_ladder([trace, trace], 2, "lru", tier2=4)


def test_the_exports_carry_every_rung_and_cause():
    """JSON rungs by name with tokens and share; CSV rows of rungs, gaps and causes; HTML with its chart inline and
    nothing fetched (no script, no link, no remote address), each gap's causes in its hover title."""
    result = ladder(Trace(chains(["A", "AB", "C", "AB", "C", "AB"]), 2, "hand"), 2, "lru", semantics=TODAY)
    data = json.loads(json.dumps(result.to_dict()))
    assert list(data["rungs"]) == ["prompt_tokens", "reachable", "ceiling", "belady", "lru"]
    assert data["rungs"]["belady"] == {"tokens": 10, "share": 10 / 24}
    assert data["gaps"][3] == {
        "name": "policy",
        "from": "belady",
        "to": "lru",
        "tokens": 4,
        "share": 4 / 24,
        "causes": {"evicted_by_policy": 4},
    }
    csv = ladder_csv(result).splitlines()
    assert csv[0] == "kind,name,cause,tokens,share"
    assert "rung,lru,,6,0.25" in csv and "cause,page_floor,partial_page,6,0.25" in csv
    page = ladder_html(result)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert "https://" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<title>policy: 4 tokens (16.67%): evicted_by_policy 4</title>" in page
    assert (data["tier2"], data["write"]) == (None, None)


def test_the_exports_carry_the_tier_rung():
    """With a tier: its settings in the JSON, its rung and causes in the CSV, the tier in the HTML's setting and the
    tier gap's causes in its hover."""
    result = ladder(Trace(chains(["A", "B", "A"]), 2, "hand"), 2, "lru", tier2=1, write="on_evict")
    data = json.loads(json.dumps(result.to_dict()))
    assert list(data["rungs"]) == ["prompt_tokens", "reachable", "ceiling", "belady (C1 + C2)", "lru + tier 2", "lru"]
    assert (data["capacity"], data["tier2"], data["write"]) == (2, 1, "on_evict")
    assert data["gaps"][-1] == {
        "name": "tier",
        "from": "lru + tier 2",
        "to": "lru",
        "tokens": 2,
        "share": 2 / 9,
        "causes": {"loaded_from_tier2": 2, "pool_hits_changed": 0},
    }
    csv = ladder_csv(result).splitlines()
    assert (
        "rung,lru + tier 2,,2,0.2222222222222222" in csv and "cause,tier,loaded_from_tier2,2,0.2222222222222222" in csv
    )
    page = ladder_html(result)
    assert "lru at 2 cached pages, tier 2 of 1 blocks written on_evict" in page
    assert "<title>tier: 2 tokens (22.22%): loaded_from_tier2 2, pool_hits_changed 0</title>" in page


def test_each_semantics_rungs_are_the_replays_under_it():
    """The policy's and Belady's rungs are the replay's own under the rules asked for; on this trace the two rules
    serve differently (under ``trace`` a request's own new blocks may be trimmed; an engine's pool evicts at
    allocation, its own pages pinned)."""
    trace = Trace(chains(["AB", "CD", "AB", "EF", "CD", "AB"]), 2, "t")
    served = {}
    for semantics in ("engine", "trace"):
        result = ladder(trace, 4, "lru", semantics=semantics)
        assert result.semantics == semantics and result.to_dict()["semantics"] == semantics
        for rung in ("lru", "belady"):
            assert result.rung(rung).tokens == Replay(trace).run(rung, 4, semantics).hit_tokens, (semantics, rung)
        served[semantics] = result.rung("lru").tokens
    assert served["engine"] != served["trace"], served
    with pytest.raises(ValueError, match="semantics"):
        ladder(trace, 4, "lru", semantics="cached")  # type: ignore[arg-type]
