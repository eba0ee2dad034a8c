"""Tiered replay (``astrai/lab/tiered.py``): the engine's ``SecondTier`` driven by the replay agrees with a small
simulator written here from issue 45's rules, on random traces under both write policies; a case by hand; the
command line and its TTFT saved."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.lab.__main__ import main
from astrai.lab.replay import Replay
from astrai.lab.tiered import run_tiered, ttft_saved_seconds
from astrai.lab.trace import Trace, TraceRequest, write_trace

Key = tuple[int, ...]


class TwoTiers:
    """Issue 45's rules, for an engine's pool of ``c1`` pages under LRU (tier 1) and ``c2`` blocks under LRU (tier 2).

    Requests run one at a time. Tier 1's pages are free, cached (``t1``, least recent first) or the running
    request's; a block is keyed by its chain (its ids so far). Tier 2 is ``t2`` (evictable, least recent first) plus
    the blocks the running request is loading (``reserved``: held, not evictable)."""

    def __init__(self, c1: int, c2: int, write: str, block_size: int) -> None:
        self.c1, self.c2, self.write, self.b = c1, c2, write, block_size
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.reserved: set[Key] = set()
        self.in_use = 0
        self.hits = self.tier2_hits = self.written = self.loaded = 0

    def page(self) -> None:
        """Take a tier-1 page: a free one, else evict tier 1's least recent (into tier 2 under on_evict)."""
        if self.in_use + len(self.t1) == self.c1:
            victim, _ = self.t1.popitem(last=False)
            if self.write == "on_evict":
                self.to_tier2([victim])
        self.in_use += 1

    def to_tier2(self, blocks: list[Key]) -> None:
        """Write blocks (in chain order) to tier 2: one held is touched; the rest take room, evicting the least
        recent unreserved block, as long as there is one; the blocks kept become most recent, head last."""
        if not self.c2:
            return
        fresh = []
        for block in blocks:
            if block in self.t2:
                self.t2.move_to_end(block)
            elif block not in self.reserved:
                fresh.append(block)
        kept = []
        for block in fresh:
            if len(self.t2) + len(self.reserved) + len(kept) == self.c2:
                if not self.t2:
                    break
                self.t2.popitem(last=False)
            kept.append(block)
        for block in reversed(kept):
            self.t2[block] = None
        self.written += len(kept)

    def request(self, r: TraceRequest) -> None:
        ids, b = r.hash_ids, self.b
        if r.input_length + 1 > self.c1 * b:  # the engine refuses it: nothing changes
            return
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        run: list[tuple[Key, int]] = []  # (block, tier)
        for key in keys[: (r.input_length - 1) // b]:
            tier = 1 if key in self.t1 else 2 if key in self.t2 else 0
            if not tier:
                break
            run.append((key, tier))
        for key, tier in run:  # tier-1 hits are in use now
            if tier == 1:
                del self.t1[key]
                self.in_use += 1
        from_t2 = [key for key, tier in run if tier == 2]
        for key in from_t2:
            del self.t2[key]
            self.reserved.add(key)
        for _ in from_t2:  # their pages, before they leave the reservation
            self.page()
        self.reserved.clear()
        if self.write == "through":
            for key in reversed(from_t2):
                self.t2[key] = None
        for _ in range(len(ids) - len(run)):
            self.page()
        stored = [key for key in keys[len(run) : r.input_length // b] if key not in self.t1]
        if self.write == "through":
            self.to_tier2(stored)
        indexed = [key for key, _ in run] + stored
        self.in_use = 0
        for key in reversed(indexed):
            self.t1[key] = None
        self.hits += len(run) * b
        self.tier2_hits += len(from_t2) * b
        self.loaded += len(from_t2)


def simulate(trace: Trace, c1: int, c2: int, write: str) -> tuple[int, int, int, int]:
    sim = TwoTiers(c1, c2, write, trace.block_size)
    for r in trace.requests:
        sim.request(r)
    return sim.hits, sim.tier2_hits, sim.written, sim.loaded


def replayed(trace: Trace, c1: int, c2: int, write: str) -> tuple[int, int, int, int]:
    r = run_tiered(Replay(trace), "lru", c1, c2, write)
    return r.hit_tokens, r.tier2_hit_tokens, r.blocks_written, r.blocks_loaded


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Requests that extend a prefix of an earlier one (or start afresh), or repeat a few ids in any order (an id
    after different parents); prompts end anywhere in their last block of 2 tokens."""
    chains: list[list[int]] = []
    fresh = 100
    requests = []
    for i in range(draw(st.integers(1, 24))):
        if draw(st.booleans()):
            ids = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
        else:
            ids = []
            if chains and draw(st.booleans()):
                chain = draw(st.sampled_from(chains))
                ids = chain[: draw(st.integers(0, len(chain)))]
            for _ in range(draw(st.integers(0 if ids else 1, 4))):
                ids.append(fresh)
                fresh += 1
        chains.append(ids)
        requests.append(TraceRequest(i, 2 * len(ids) - draw(st.integers(0, 1)), 1, tuple(ids)))
    return Trace(tuple(requests), 2)


@settings(max_examples=400, deadline=None)
@given(
    trace=traces(),
    c1=st.integers(0, 10),
    c2=st.integers(0, 8),
    write=st.sampled_from(["through", "on_evict"]),
)
def test_the_engine_s_tier_follows_the_issue_s_rules(trace, c1, c2, write):
    assert replayed(trace, c1, c2, write) == simulate(trace, c1, c2, write)


def test_two_tiers_by_hand():
    """A pool of 3 pages, a tier 2 of 2 blocks; A, AB, C, AB, each request with a partial page of its own (one block
    of 2 tokens a letter, then one token).

    * Without tier 2 (LRU): AB hits A; C evicts B; AB hits A, computes B: 2 blocks.
    * ``through``: A, then B, go to tier 2 as stored; C is written there too and evicts A (tier 2 holds B, C); the
      last AB hits A in tier 1 and B in tier 2, loaded: 3 blocks, 1 from tier 2; 3 written, 1 loaded.
    * ``on_evict``: B, evicted by C, enters tier 2; the last AB loads it from there (it leaves), and its partial page
      evicts C into tier 2: 3 blocks, 1 from tier 2; 2 written, 1 loaded.
    """
    letters = {"A": 0, "AB": 1, "C": 2}
    requests = [
        TraceRequest(i, 2 * len(p) + 1, 1, (*[letters[p[: j + 1]] for j in range(len(p))], 1000 + i))
        for i, p in enumerate(["A", "AB", "C", "AB"])
    ]
    trace = Trace(tuple(requests), 2)
    assert replayed(trace, 3, 0, "through") == (4, 0, 0, 0)
    assert replayed(trace, 3, 2, "through") == (6, 2, 3, 1)
    assert replayed(trace, 3, 2, "on_evict") == (6, 2, 2, 1)


def test_the_command_line_gives_each_tier_s_hits_and_the_ttft_saved(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    # two prefixes of 3 blocks take turns in a pool of 5 pages: each evicts the other's tail into tier 2
    requests = [TraceRequest(i, 7, 1, (*((0, 1, 2) if i % 2 else (5, 6, 7)), 10 + i)) for i in range(6)]
    write_trace(path, requests, 2)
    argv = [str(path), "--capacity", "5", "--tier2", "0,4", "--write", "through,on_evict", "--load-ms", "1"]
    assert main([*argv, "--prefill-ms", "9", "--page-tokens", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["traces"][0]["rows"]
    assert [(r["tier2"], r["write"]) for r in rows] == [
        (0, "through"),
        (0, "on_evict"),
        (4, "through"),
        (4, "on_evict"),
    ]
    assert all(row["blocks_loaded"] > 0 for row in rows[2:])
    for row in rows:
        assert row["hit_tokens"] == row["tier1_hit_tokens"] + row["tier2_hit_tokens"]
        assert row["tier2_hit_tokens"] == row["blocks_loaded"] * 2
        assert row["ttft_saved_s"] == pytest.approx(row["blocks_loaded"] * (9 - 1) / 1000)
    assert main([*argv]) == 0
    text = capsys.readouterr().out
    assert "tier 2" in text and "TTFT saved" in text
    with pytest.raises(SystemExit) as refused:  # a tiered option without --tier2 would be silently ignored
        main([str(path), "--write", "on_evict"])
    assert refused.value.code == 2 and "give --tier2" in capsys.readouterr().err


def test_ttft_saved_counts_each_tier_2_page_s_recompute_less_its_load():
    result = run_tiered(Replay(Trace((TraceRequest(0, 5, 1, (0, 1, 2)),), 2)), "lru", 4, 2, "through")
    assert ttft_saved_seconds(result, 1.0, 9.0, 2) == 0.0  # nothing was loaded
    loaded = type(result)(**{**result.__dict__, "tier2_hit_tokens": 32})
    assert ttft_saved_seconds(loaded, 1.0, 9.0, 16) == pytest.approx(2 * 8 / 1000)
    assert ttft_saved_seconds(loaded, 10.0, 9.0, 16) < 0  # a load slower than recomputing costs TTFT


def test_a_load_under_through_leaves_the_chain_s_head_most_recent_in_tier_2():
    """The shortest trace a search of random ones found (shrunk) where the order of a load's blocks in tier 2
    matters: blocks A1-A3 and B1-B3 take turns in a pool of 5 pages with a tier 2 of 6 blocks, ``through``. Loaded
    blocks are touched tail first, as a request releases its pages, so the head is the most recent; touched head
    first, tier 2 would evict a head before its tail and the last request would load one block less."""
    a, b = (100, 101, 102), (103, 104, 105)
    prompts = [(a, 6), (b, 6), ((*a, 106), 8), ((*b, 108, 109), 9), ((*a, 106), 8), (b, 6)]
    trace = Trace(tuple(TraceRequest(i, n, 1, ids) for i, (ids, n) in enumerate(prompts)), 2)
    assert simulate(trace, 5, 6, "through") == (16, 8, 11, 4)
    assert replayed(trace, 5, 6, "through") == (16, 8, 11, 4)
