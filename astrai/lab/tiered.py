"""Tiered replay: a trace through the pool (tier 1) and the engine's own ``SecondTier`` (tier 2), no model, no bytes.

The rules are the engine's, because the code is: ``Replay`` drives the real ``KVCacheManager`` with a ``SecondTier``
attached (``attach_tier``), over a store that keeps no bytes (``BytelessStore``: the tier's index, free list, LRU
order, write policy and counters run as in an engine; only the copies are left out). Stated exactly, so that an
independent simulator can check them (``tests/test_lab_tier.py`` has one):

* tier 1 is the pool of ``capacity`` pages (the replay's semantics), with its eviction policy;
* tier 2 holds ``blocks`` blocks under LRU;
* a request's hit is the longest leading run of its blocks, each in tier 1 or tier 2, capped at
  ``(input_length - 1) // block_size`` blocks; a block in both is a tier-1 hit. The run's tier-2 blocks are loaded
  into fresh tier-1 pages (whose allocations may evict from tier 1) and count as tier-2 hits;
* ``"through"``: each block the request stores (its new full blocks, registered in tier 1) is written to tier 2 as
  well, where it becomes the most recent (a request's new blocks together, its head most recent of them); a block
  already held is touched instead; a load touches its blocks as most recent too;
* ``"on_evict"``: a block tier 1 evicts enters tier 2 (touched if it is held already), and a block loaded from
  tier 2 leaves it. While a request loads, its blocks in tier 2 are not evictable there (the engine reserves them).

Under both, a write that finds tier 2 full evicts its least recent block. "Blocks written" counts blocks that
entered tier 2 (a touch writes nothing); "blocks loaded", tier-2 hits, one block each.

**TTFT saved** (``ttft_saved_seconds``): each tier-2 hit is a block the engine would otherwise recompute; it saves
the block's recompute time less its load time, at per-page costs measured by ``benchmarks/tier.py`` on the engine
(``docs/benchmarks.md``, "The second tier against recomputing"). The defaults are that table's medians for the
SmolLM2-135M-shaped model in float32 at a 2,048-token prefix, the longest measured (the traces' prompts are longer
still): 0.18 ms to load a 16-token page from a file tier, 83 ms to recompute it, on the 2-core Intel Xeon with AMX.
Requests run one at a time, so the sum is the TTFT they save together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from astrai.lab.replay import Replay, Semantics
from astrai.tier import WRITE_POLICIES, SecondTier, TierStore, WritePolicy

# docs/benchmarks.md, "The second tier against recomputing": SmolLM2-135M-shaped, float32, 2,048-token prefix
MEASURED_MODEL = "SmolLM2-135M-shaped, float32, 2,048-token prefix (docs/benchmarks.md)"
LOAD_MS_PER_PAGE = 0.18
PREFILL_MS_PER_PAGE = 83.0
PAGE_TOKENS = 16  # the engine's page when those were measured


class BytelessStore(TierStore):
    """A tier store that keeps no bytes: ``SecondTier`` does all its bookkeeping over it, and its copies do nothing.
    It binds to no KV (the replay's pool has none); one byte a slot is its nominal size (``TierStore`` needs one)."""

    medium = "none (the lab's replay: bookkeeping only)"

    def __init__(self, slots: int) -> None:
        super().__init__(slots, 1)

    def bind(self, planes: Sequence[object]) -> None:
        """Nothing to copy to or from: the replay's pool holds no KV."""

    def _bind(self, planes: Sequence[object]) -> None:
        """Unused: ``bind`` binds nothing."""

    def read(self, first_slot: int, first_page: int, count: int) -> None:
        """Nothing to copy."""

    def write(self, first_slot: int, first_page: int, count: int) -> None:
        """Nothing to copy."""


@dataclass(frozen=True)
class TieredResult:
    policy: str  # tier 1's
    capacity: int | None  # tier 1: pages of the pool (see ``Semantics``); None: unbounded
    tier2: int  # blocks tier 2 holds; 0: no tier 2
    write: WritePolicy
    block_size: int
    hit_tokens: int  # both tiers
    tier1_hit_tokens: int
    tier2_hit_tokens: int
    query_tokens: int
    blocks_written: int  # into tier 2
    blocks_loaded: int  # from tier 2 into tier 1 (= tier-2 hit blocks)
    tier2_evictions: int
    tier1_evictions: int
    refused: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def run_tiered(
    prepared: Replay,
    policy: str,
    capacity: int | None,
    tier2: int,
    write: str,
    semantics: Semantics = "engine",
) -> TieredResult:
    """Replay the trace through tier 1 (``policy`` at ``capacity``) and a tier 2 of ``tier2`` blocks written
    ``write``; see the module docstring for the rules."""
    if write not in WRITE_POLICIES:
        raise ValueError(f"write must be one of {list(WRITE_POLICIES)}, got {write!r}")
    if isinstance(tier2, bool) or not isinstance(tier2, int) or tier2 < 0:
        raise ValueError(f"tier2 must be an integer >= 0, got {tier2!r}")
    tiers: list[SecondTier] = []

    def make_tier() -> SecondTier:
        tiers.append(SecondTier(BytelessStore(tier2), [], write_policy=write))
        return tiers[-1]

    hits, pool, refused = prepared.replay_hits(policy, capacity, semantics, make_tier if tier2 else None)
    counters = tiers[0].counters if tiers else None
    loaded = counters.loaded_pages if counters else 0
    size = prepared.trace.block_size
    return TieredResult(
        policy=policy,
        capacity=capacity,
        tier2=tier2,
        write=write,
        block_size=size,
        hit_tokens=sum(hits),
        tier1_hit_tokens=sum(hits) - loaded * size,
        tier2_hit_tokens=loaded * size,
        query_tokens=prepared.trace.input_tokens,
        blocks_written=counters.written_pages if counters else 0,
        blocks_loaded=loaded,
        tier2_evictions=counters.evictions if counters else 0,
        tier1_evictions=pool.stats.evictions,
        refused=refused,
    )


def ttft_saved_seconds(
    result: TieredResult,
    load_ms_per_page: float = LOAD_MS_PER_PAGE,
    prefill_ms_per_page: float = PREFILL_MS_PER_PAGE,
    page_tokens: int = PAGE_TOKENS,
) -> float:
    """Seconds of TTFT the tier-2 hits save over recomputing them, summed over the requests (negative where a load
    costs more than a recompute); see the module docstring."""
    pages = result.tier2_hit_tokens / page_tokens
    return pages * (prefill_ms_per_page - load_ms_per_page) / 1000
