"""The cache-sizing lab: hit rates worked out by hand for every policy, Belady as an upper bound, the trace format,
the command line, the shipped curves, and a trace recorded from the engine that replays to the engine's own hits."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai import InferenceEngine
from astrai.eviction import POLICIES
from astrai.lab.__main__ import log_capacities, main
from astrai.lab.record import from_engine, from_requests
from astrai.lab.replay import REPLAY_POLICIES, SEMANTICS, Replay, Semantics
from astrai.lab.trace import Trace, TraceRequest, read_trace, write_trace
from astrai.observation import RequestInfo

TRACES = Path(__file__).parents[1] / "assets" / "traces"


def blocks_trace(prompts: list[str]) -> Trace:
    """One request per string, one full block of 2 tokens per letter, plus one token in a partial block of its own:
    a request of n letters is 2n + 1 tokens, so all n full blocks are reusable and cached after it."""
    ids: dict[str, int] = {}
    requests = []
    for i, letters in enumerate(prompts):
        full = [ids.setdefault(letters[: j + 1], len(ids)) for j in range(len(letters))]  # an id names its prefix
        requests.append(TraceRequest(i, 2 * len(letters) + 1, 1, (*full, 1000 + i)))
    return Trace(tuple(requests), 2)


def hit_blocks(trace: Trace, capacity: int | None, semantics: Semantics = "engine") -> dict[str, int]:
    prepared = Replay(trace)
    return {
        policy: prepared.run(policy, capacity, semantics).hit_tokens // trace.block_size for policy in REPLAY_POLICIES
    }


def test_an_engine_s_pool_by_hand():
    """A pool of 3 pages (the default semantics); A, AB, C, AB, each request with a partial page of its own.

    * LRU: AB hits A (1), and releases B then A; C needs 2 pages and finds 1 free: B goes; AB hits A (1), B is
      computed again, and its partial page evicts C: 2. (Counting 3 *cached blocks* instead, as the ``trace``
      semantics does, A, B and C all stay, and the last AB hits both: 3.)
    * FIFO: C evicts A, registered first, stranding B; AB misses, computes A and B again (B's new page evicts the
      stranded one, the partial page evicts C): 1.
    * LFU and ARC: B has served no hit, A one: B goes, as under LRU: 2.
    * Belady: C must evict A or B, both needed next by the last AB: the deeper, B, goes: 2, the most any pool of 3
      pages can serve here.
    * A pool of 2 pages refuses AB (5 tokens and the one sampled need 3 pages): A, then C evicts it: nothing.
    """
    trace = blocks_trace(["A", "AB", "C", "AB"])
    assert hit_blocks(trace, 3) == {"lru": 2, "fifo": 1, "lfu": 2, "arc": 2, "belady": 2}
    assert hit_blocks(trace, 3, "trace")["lru"] == 3
    assert Replay(trace).request_hits("lru", 3) == [0, 2, 0, 2]
    refusing = Replay(trace).run("lru", 2)
    assert (refusing.hit_tokens, refusing.refused, refusing.evictions) == (0, 2, 1)
    assert Replay(trace).refused(2) == (1, 3) and Replay(trace).refused(2, "trace") == ()


def test_chains_by_hand():
    """Capacity 2 cached blocks (``trace`` semantics); A, AB, C, AB, C, AB (B always after A). Hits in blocks,
    request by request:

    * LRU: AB hits A; C evicts B (A was just reused); AB hits A, C goes; C misses, B goes; AB hits A: 3.
    * FIFO: AB hits A; C evicts A, the first registered, stranding B; AB misses A (B, cached past the miss, is left
      alone) and registers A again, B goes; C hits; AB hits A: 3.
    * LFU: A has hits, B and C none: the one released longest ago goes each time, like LRU: 3.
    * ARC: C evicts B from T1 (A served a hit: T2) and B becomes a ghost; AB hits A and brings B back to T2 (p
      grows to 1), then T1 = [C] is at its target so B goes; C hits; AB hits A: 4.
    * Belady: C is bypassed (its next use is the furthest), AB hits A, B; C is bypassed again, AB hits A, B: 5.
    * No eviction: A, then A B, C, A B: 6 of 24 tokens' worth.
    """
    trace = blocks_trace(["A", "AB", "C", "AB", "C", "AB"])
    assert trace.input_tokens == 24
    assert hit_blocks(trace, 2, "trace") == {"lru": 3, "fifo": 3, "lfu": 3, "arc": 4, "belady": 5}
    assert Replay(trace).run("lru", None).hit_rate == 6 * 2 / 24


def test_single_blocks_by_hand():
    """Capacity 2 cached blocks (``trace`` semantics); one-block requests A A B A C A B C A B.

    * LRU: hits at requests 1, 3, 5 (A each time); C at 4 evicts B, B at 6 evicts C, C at 7 evicts A: 3.
    * FIFO: hits at 1, 3; C at 4 evicts A (registered first), and so on around: 2.
    * LFU: A's hits keep it: hits at 1, 3, 5, 8 (C at 7 evicts B, with no hits): 4.
    * ARC: C at 4 evicts B to a ghost; B at 6 comes back to T2 and p = 1 keeps C in T1, so A goes; C at 7 hits;
      A at 8 was a B2 ghost (p back to 0), B goes: hits at 1, 3, 5, 7: 4.
    * Belady: C at 4 is bypassed, hits at 1, 3, 5, 6, 8, 9 (C at 7, never used again, is bypassed): 6.
    * No eviction: every request but the first of each block: 7.
    """
    trace = blocks_trace(list("AABACABCAB"))
    assert hit_blocks(trace, 2, "trace") == {"lru": 3, "fifo": 2, "lfu": 4, "arc": 4, "belady": 6}
    for semantics in SEMANTICS:
        assert hit_blocks(trace, None, semantics) == dict.fromkeys(REPLAY_POLICIES, 7)
        assert hit_blocks(trace, 0, semantics) == dict.fromkeys(REPLAY_POLICIES, 0)


def test_orphans_are_cached_blocks_whose_parent_is_gone():
    """A, AB, C at capacity 2 cached blocks: FIFO evicts A and keeps B, which cannot hit until A is computed
    again."""
    prepared = Replay(blocks_trace(["A", "AB", "C"]))
    assert {p: prepared.run(p, 2, "trace").orphans for p in REPLAY_POLICIES} == {
        "lru": 0,
        "fifo": 1,
        "lfu": 0,
        "arc": 0,
        "belady": 0,
    }


def test_the_last_token_is_always_computed():
    """A prompt of exactly n blocks can reuse only n - 1; all n are cached after it."""
    trace = Trace((TraceRequest(0, 4, 1, (1, 2)), TraceRequest(1, 4, 1, (1, 2)), TraceRequest(2, 5, 1, (1, 2, 3))), 2)
    result = Replay(trace).run("lru", None)
    assert result.hit_tokens == 2 + 4  # the second reuses block 1 only, the third both


@st.composite
def prefix_traces(draw: st.DrawFn) -> Trace:
    """Random requests that extend a prefix of an earlier one (or start afresh) with new blocks; ids chain, so an
    id always follows the same parent. Prompts end anywhere in their last block."""
    chains: list[list[int]] = []
    fresh = 0
    requests = []
    for i in range(draw(st.integers(1, 16))):
        ids: list[int] = []
        if chains and draw(st.booleans()):
            chain = draw(st.sampled_from(chains))
            ids = chain[: draw(st.integers(0, len(chain)))]
        for _ in range(draw(st.integers(0 if ids else 1, 3))):
            ids.append(fresh)
            fresh += 1
        chains.append(ids)
        requests.append(TraceRequest(i, 2 * len(ids) - draw(st.integers(0, 1)), 1, tuple(ids)))
    return Trace(tuple(requests), 2)


@st.composite
def unchained_traces(draw: st.DrawFn) -> Trace:
    """Random requests of ids drawn from a handful, in any order: an id follows different parents in different
    requests, as in a trace of per-block content hashes (the replay keys a block by its chain all the same)."""
    requests = []
    for i in range(draw(st.integers(1, 12))):
        ids = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        requests.append(TraceRequest(i, 2 * len(ids) - draw(st.integers(0, 1)), 1, tuple(ids)))
    return Trace(tuple(requests), 2)


@settings(max_examples=300, deadline=None)
@given(
    trace=st.one_of(prefix_traces(), unchained_traces()),
    capacity=st.integers(0, 10),
    semantics=st.sampled_from(SEMANTICS),
)
def test_belady_and_the_ceiling_bound_every_online_policy(trace, capacity, semantics):
    """Belady's hits >= every online policy's at every capacity, under both semantics, whether or not the trace's
    ids chain, and no eviction >= everything. Belady never strands a block (a parent's next reuse is never after its
    child's), which is why it stays an upper bound with chains."""
    prepared = Replay(trace)
    belady = prepared.run("belady", capacity, semantics)
    ceiling = prepared.run("lru", None, semantics).hit_tokens
    assert belady.orphans == 0
    assert ceiling >= belady.hit_tokens
    for policy in POLICIES:
        assert belady.hit_tokens >= prepared.run(policy, capacity, semantics).hit_tokens, policy


def test_belady_keys_a_block_by_its_chain_not_its_id():
    """Ids 2 0, then 0 2 twice, a block a token: the second request's 2 follows 0, another block than the first's
    (which has no parent). The optimum of one cached block keeps the third request's first block, as LRU does; it
    scored below LRU while it took the first request's 0 for the second's."""
    trace = Trace(tuple(TraceRequest(i, 2, 1, ids) for i, ids in enumerate([(2, 0), (0, 2), (0, 2)])), 1)
    hits = hit_blocks(trace, 1, "trace")
    assert hits["belady"] == 1 and all(hits["belady"] >= hits[p] for p in POLICIES)


def test_belady_knows_that_a_refused_request_reuses_nothing():
    """A pool of 3 pages, blocks of 2 tokens: A, B, then A X Y Z (7 tokens and the one sampled: more than the pool
    holds, so refused), C, B. C needs a page of A or B: A's only later reuse is the refused request, so the optimum
    evicts A and B hits, as under LRU; counting the refused request as A's next reuse, it evicted B and served
    nothing."""
    trace = Trace(
        tuple(
            TraceRequest(i, length, 1, ids)
            for i, (length, ids) in enumerate(
                [(3, (1, 10)), (3, (2, 11)), (7, (1, 3, 4, 5)), (3, (6, 12)), (3, (2, 13))]
            )
        ),
        2,
    )
    assert Replay(trace).refused(3) == (2,)
    hits = hit_blocks(trace, 3)
    assert hits["belady"] == hits["lru"] == 1


def test_the_trace_reader_checks_each_line_and_defaults_to_mooncake_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0, 1]}\n')
    assert read_trace(path).block_size == 512
    path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1: 512 tokens are 1 blocks, but 2 ids"):
        read_trace(path)
    write_trace(path, [TraceRequest(0, 5, 1, (0, 1)), TraceRequest(3, 8, 2, (0, 1))], block_size=4)
    assert read_trace(path) == Trace((TraceRequest(0, 5, 1, (0, 1)), TraceRequest(3, 8, 2, (0, 1))), 4, "t.jsonl")
    with path.open("a") as out:
        out.write('{"timestamp": 4, "input_length": 8, "output_length": 1, "hash_ids": [0, 1], "block_size": 8}\n')
    with pytest.raises(ValueError, match=":3: block_size 8, but the trace's is 4"):
        read_trace(path)


def test_the_command_line_prints_rows_the_ceiling_and_tables(tmp_path, capsys):
    path = tmp_path / "singles.jsonl"
    trace = blocks_trace(list("AABACABCAB"))
    write_trace(path, trace.requests, trace.block_size)
    common = [str(path), "--capacity", "2,0", "--policy", "lru,belady", "--json", "--processes", "1"]
    assert main([*common, "--semantics", "trace"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["traces"]
    assert report["ceiling"]["hit_rate"] == 14 / 30 and report["block_size"] == 2
    assert report["semantics"] == "trace"
    assert [(r["policy"], r["capacity"], r["hit_rate"], r["refused"]) for r in report["rows"]] == [
        ("lru", 2, 6 / 30, 0),
        ("lru", 0, 0.0, 0),
        ("belady", 2, 12 / 30, 0),
        ("belady", 0, 0.0, 0),
    ]
    # an engine's pool of 2 pages holds a request's partial page too, so one block stays cached between requests:
    # only A after A hits; a pool of none refuses all 10 requests
    assert main(common) == 0
    (report,) = json.loads(capsys.readouterr().out)["traces"]
    assert report["semantics"] == "engine"
    assert [(r["policy"], r["capacity"], r["hit_rate"], r["refused"]) for r in report["rows"]] == [
        ("lru", 2, 2 / 30, 0),
        ("lru", 0, 0.0, 10),
        ("belady", 2, 2 / 30, 0),
        ("belady", 0, 0.0, 10),
    ]
    assert main([str(path), "--capacity", "2", "--processes", "1", "--semantics", "trace"]) == 0
    out = capsys.readouterr().out
    assert "ceiling (no eviction) 46.67%" in out and "belady" in out and "40.00%" in out
    assert "capacity: blocks cached after each request" in out


def test_the_shipped_curves_are_this_code_s_numbers():
    """assets/traces/curves.json (README: how it is made) holds every policy on the log grid, and its numbers are
    what the replay gives now (checked at one point of the smaller trace)."""
    curves = json.loads((TRACES / "curves.json").read_text())
    by_name = {t["trace"]: t for t in curves["traces"]}
    assert set(by_name) == {"conversation_trace.jsonl", "synthetic_trace.jsonl"}
    for report in by_name.values():
        assert {(r["policy"], r["capacity"]) for r in report["rows"]} == {
            (p, c) for p in REPLAY_POLICIES for c in log_capacities()
        }
    synthetic = by_name["synthetic_trace.jsonl"]
    row = next(r for r in synthetic["rows"] if r["policy"] == "lru" and r["capacity"] == 1000)
    result = Replay(read_trace(TRACES / "synthetic_trace.jsonl")).run("lru", 1000)
    assert (row["hit_rate"], row["evictions"], row["orphans"]) == (result.hit_rate, result.evictions, result.orphans)
    assert all(report["semantics"] == "engine" for report in by_name.values())
    assert synthetic["requests"] == 3993 and by_name["conversation_trace.jsonl"]["requests"] == 12031


def test_a_recorded_trace_replays_to_the_engine_s_own_hits(model, tokenizer, tmp_path):
    """Prompts run one at a time, one token each (so no generated token's KV is cached), salted and not: the
    recorded trace, replayed without eviction, serves exactly the tokens the engine's prefix cache served."""
    base = list(range(1, 14))  # 3 full pages of 4 and a partial one
    runs = [
        (base, None),
        (base[:8] + [50, 51, 52, 53, 54], None),  # shares 2 pages
        (base + [60, 61, 62], None),  # 16 tokens: 4 full pages, 3 reusable, all 3 hit
        (base, "salt"),  # a namespace of its own: no hit
        (base, "salt"),  # 3 pages hit, within the salt
        ([1, 2, 3], None),  # no full page
    ]
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=128, compile=False) as engine:
        for prompt, salt in runs:
            engine.generate_ids([prompt], max_tokens=1, cache_salt=salt)
        trace = from_engine(engine, tmp_path / "recorded.jsonl")
        served = engine.cache_stats().hit_tokens
    assert served == 8 + 12 + 12
    assert read_trace(tmp_path / "recorded.jsonl") == trace
    assert trace.block_size == 4 and [r.input_length for r in trace.requests] == [len(p) for p, _ in runs]
    ids = [r.hash_ids for r in trace.requests]
    assert ids[1][:2] == ids[0][:2] and ids[1][2] != ids[0][2]
    assert ids[2][:3] == ids[0][:3] and ids[3][0] != ids[0][0] and ids[4][:3] == ids[3][:3]
    assert len({i for r in ids for i in r}) == 4 + 2 + 1 + 4 + 1 + 1  # full blocks, and a fresh id per partial one
    assert all(r.output_length == 1 for r in trace.requests)
    assert [r.timestamp for r in trace.requests] == sorted(r.timestamp for r in trace.requests)
    assert Replay(trace).run("lru", None).hit_tokens == served


def test_a_first_hit_on_a_page_stored_before_the_event_ring_takes_no_later_prompt_s_key(model, tokenizer, tmp_path):
    """P's pages are stored, then pushed out of a short event ring by requests that store nothing; P again hits
    them (its admission is in the ring, their stores are not); a long prompt evicts them, and an unrelated prompt's
    first page is stored on P's old first page. The recording must not say the unrelated prompt starts as P does."""
    prompt = list(range(10, 19))  # 2 full pages of 4 and a partial one
    with InferenceEngine(model, tokenizer, page_size=4, n_pages=12, event_log_size=24, compile=False) as engine:
        for tokens in [prompt, *([200 + k, 201, 202] for k in range(4)), prompt, list(range(100, 144)), [300] * 5]:
            engine.generate_ids([tokens], max_tokens=1)
        trace = from_engine(engine, tmp_path / "recorded.jsonl")
    again, long, unrelated = trace.requests[-3:]
    assert again.input_length == len(prompt) and long.input_length == 44 and unrelated.input_length == 5
    assert unrelated.hash_ids[0] not in again.hash_ids, "the unrelated prompt took P's first block"


def test_a_request_that_ended_with_no_prompt_is_left_out_of_a_trace_of_requests():
    """A vLLM panel that failed before its first chunk ends with no prompt ids: Replay my requests replays the rest."""

    def info(request: int, status: str, prompt: range) -> RequestInfo:
        return RequestInfo(request, status, len(prompt), None, 0, 0, tuple(prompt), (), None, None, None)

    trace = from_requests(
        [info(1, "finished", range(1, 40)), info(2, "failed", range(0)), info(3, "finished", range(1, 40))], 16
    )
    assert [r.input_length for r in trace.requests] == [39, 39]
    assert Replay(trace).run("lru", 3).hit_tokens == 32
    with pytest.raises(ValueError, match="request 1 has no prompt tokens"):
        Replay(Trace((trace.requests[0], TraceRequest(1, 0, 1, ())), 16))


def test_a_replay_s_memory_follows_the_trace_not_the_capacity():
    """Two blocks replayed at a capacity of a million: the pool holds no more pages than the trace can fill (it
    took about 100 bytes a page of the capacity: 10 GB to replay two blocks at 100,000,000)."""
    prepared = Replay(Trace((TraceRequest(0, 3, 1, (1, 2)), TraceRequest(1, 3, 1, (1, 3))), 2))
    tracemalloc.start()
    try:
        results = [prepared.run("fifo", 1_000_000, semantics) for semantics in SEMANTICS]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.hit_tokens for r in results] == [2, 2]
    assert peak < 200_000, f"{peak:,} bytes"
