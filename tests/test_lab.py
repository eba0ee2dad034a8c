"""The cache-sizing lab: hit rates worked out by hand for every policy, Belady as an upper bound, the trace format,
the command line, the shipped curves, and a trace recorded from the engine that replays to the engine's own hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai import InferenceEngine
from astrai.eviction import POLICIES
from astrai.lab.__main__ import log_capacities, main
from astrai.lab.record import from_engine
from astrai.lab.replay import REPLAY_POLICIES, Replay
from astrai.lab.trace import Trace, TraceRequest, read_trace, write_trace

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


def hit_blocks(trace: Trace, capacity: int | None) -> dict[str, int]:
    prepared = Replay(trace)
    return {policy: prepared.run(policy, capacity).hit_tokens // trace.block_size for policy in REPLAY_POLICIES}


def test_chains_by_hand():
    """Capacity 2 blocks; A, AB, C, AB, C, AB (B always after A). Hits in blocks, request by request:

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
    assert hit_blocks(trace, 2) == {"lru": 3, "fifo": 3, "lfu": 3, "arc": 4, "belady": 5}
    assert Replay(trace).run("lru", None).hit_rate == 6 * 2 / 24


def test_single_blocks_by_hand():
    """Capacity 2 blocks; one-block requests A A B A C A B C A B.

    * LRU: hits at requests 1, 3, 5 (A each time); C at 4 evicts B, B at 6 evicts C, C at 7 evicts A: 3.
    * FIFO: hits at 1, 3; C at 4 evicts A (registered first), and so on around: 2.
    * LFU: A's hits keep it: hits at 1, 3, 5, 8 (C at 7 evicts B, with no hits): 4.
    * ARC: C at 4 evicts B to a ghost; B at 6 comes back to T2 and p = 1 keeps C in T1, so A goes; C at 7 hits;
      A at 8 was a B2 ghost (p back to 0), B goes: hits at 1, 3, 5, 7: 4.
    * Belady: C at 4 is bypassed, hits at 1, 3, 5, 6, 8, 9 (C at 7, never used again, is bypassed): 6.
    * No eviction: every request but the first of each block: 7.
    """
    trace = blocks_trace(list("AABACABCAB"))
    assert hit_blocks(trace, 2) == {"lru": 3, "fifo": 2, "lfu": 4, "arc": 4, "belady": 6}
    assert hit_blocks(trace, None) == dict.fromkeys(REPLAY_POLICIES, 7)
    assert hit_blocks(trace, 0) == dict.fromkeys(REPLAY_POLICIES, 0)


def test_orphans_are_cached_blocks_whose_parent_is_gone():
    """A, AB, C at capacity 2: FIFO evicts A and keeps B, which cannot hit until A is computed again."""
    prepared = Replay(blocks_trace(["A", "AB", "C"]))
    assert {p: prepared.run(p, 2).orphans for p in REPLAY_POLICIES} == {
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


@settings(max_examples=150, deadline=None)
@given(trace=prefix_traces(), capacity=st.integers(0, 8))
def test_belady_and_the_ceiling_bound_every_online_policy(trace, capacity):
    """Belady's hits >= every online policy's at every capacity, and no eviction >= everything. Belady never strands
    a block (a parent's next reuse is never after its child's), which is why it stays an upper bound with chains."""
    prepared = Replay(trace)
    belady = prepared.run("belady", capacity)
    ceiling = prepared.run("lru", None).hit_tokens
    assert belady.orphans == 0
    assert ceiling >= belady.hit_tokens
    for policy in POLICIES:
        assert belady.hit_tokens >= prepared.run(policy, capacity).hit_tokens, policy


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
    assert main([str(path), "--capacity", "2,0", "--policy", "lru,belady", "--json", "--processes", "1"]) == 0
    (report,) = json.loads(capsys.readouterr().out)["traces"]
    assert report["ceiling"]["hit_rate"] == 14 / 30 and report["block_size"] == 2
    assert [(r["policy"], r["capacity"], r["hit_rate"]) for r in report["rows"]] == [
        ("lru", 2, 6 / 30),
        ("lru", 0, 0.0),
        ("belady", 2, 12 / 30),
        ("belady", 0, 0.0),
    ]
    assert main([str(path), "--capacity", "2", "--processes", "1"]) == 0
    out = capsys.readouterr().out
    assert "ceiling (no eviction) 46.67%" in out and "belady" in out and "40.00%" in out


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
