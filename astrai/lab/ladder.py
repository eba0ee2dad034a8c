"""The hit-rate ladder: from every prompt token down to the hits delivered, each gap between two rungs attributed.

For a sequence of requests at page size B (the trace's ``block_size``) and a capacity C (cached pages), each rung
counts prompt tokens, and each is at most the one above it (but ``delivered`` and a fleet's policy, see below):

* ``prompt_tokens``: every prompt token.
* ``reachable``: what any prefix cache of page size B could serve: the full pages before each prompt's last token.
* ``ceiling``: the hits of a cache that never evicts, requests one at a time in order (the replay, capacity None).
* ``belady``: the hits of Belady's MIN at C (the replay's offline optimum).
* ``single_pool`` (fleets only): the policy with one pool of the fleet's whole capacity, every request through it.
* the policy's name, e.g. ``lru``: the hits of that policy at C, replayed (a fleet: each replica's own requests
  through its own pool of C, summed).
* ``delivered`` (when given): what the engine or server reported, ``cached_tokens`` summed.

With a second tier (``tier2`` blocks written ``write``, one engine only), C is tier 1's pages (C1) and tier 2 holds
C2 blocks; ``belady`` gives way to its bound at both tiers' pages, and the tier gets a rung above the policy:

* ``belady (C1 + C2)``: Belady's MIN on one pool of C1 + C2 pages, the tier's reference. Belady at C1 alone is no
  rung here: a tier can serve more than the optimum of its pool alone (``tests/test_ladder.py`` has a case), so it
  has no place in the order; the ladder without a tier shows it.
* ``<policy> + tier 2``, e.g. ``lru + tier 2``: the tiered replay's hits (``tiered.py``'s ``run_tiered``, through
  the engine's ``SecondTier``), tier 1's and tier 2's together, with the policy at C1.

The rungs are the replay's (``replay.py``, ``belady.py``, ``tiered.py``): this module does not replay anything
itself. Each gap is split into causes, in tokens, that sum exactly to it:

* ``page_floor`` (prompt_tokens - reachable): ``partial_page``, the tokens after a prompt's last full page, and
  ``last_token``, a whole full page withheld because it holds the prompt's last token (a prompt that ends on a page
  boundary: the last token is computed for the first output's logits, so that page is never a hit).
* ``never_seen`` (reachable - ceiling): per request, the reusable pages past its ceiling hit. ``other_namespace``:
  pages whose tokens an earlier request of another namespace computed (a cause only where ``namespaces`` are given:
  a trace does not say, and a count of 0 would claim it knew); then the first page whose tokens no earlier request
  computed after the same prefix is ``diverged`` where an earlier request went on from that prefix with another
  page (the prompts branch there), and everything else is ``new`` (an extension of what was seen, or a prompt with
  nothing in common). These follow ``astrai.explain``'s causes of the same names, judged on block ids instead of
  tokens (ids name whole prefixes, so a first page can only be new).
* ``capacity`` (ceiling - belady): ``evicted``, hits lost to evictions even the optimum makes at C.
* ``policy`` (belady - the policy, or belady - single_pool): ``evicted_by_policy``, the hits the optimum keeps and
  the policy does not (net over the trace).
* ``routing`` (single_pool - the policy, fleets): ``other_replica``, hits one pool would serve that the request's
  replica did not have; signed (partitioned pools can do better than one under LRU).
* with a tier, ``capacity`` (ceiling - belady (C1 + C2)): ``evicted``, as above at C1 + C2 pages; ``policy``
  (belady (C1 + C2) - the policy + tier 2): ``evicted_by_policy``, belady - the policy, both on one pool of C1 + C2
  pages, and ``split_into_tiers``, signed: the policy on that one pool - the two tiers (under ``through`` tier 2
  spends its blocks on copies of tier 1's; the two tiers can also serve more); ``tier`` (the policy + tier 2 - the
  policy at C1): ``loaded_from_tier2``, the tier-2 hits, and ``pool_hits_changed``, signed: tier 1's own hits with
  the tier - the policy's hits without it (pool pages reached past a page loaded from tier 2, and a pool the loads
  left otherwise; 0 under LRU, whose pool holds no page past a missing parent and ends each request in the same
  order whether its pages were loaded or computed).
* ``scheduling`` (the policy - delivered): ``scheduling``, signed: requests admitted together (a same-step hit can
  deliver more than the one-at-a-time replay), pages pinned by running requests, preemptions, Clear cache,
  cancelled requests. A trace cannot tell these apart, so the cause is one number.

The never-seen causes come from one pass over the requests' chains; that pass also counts the ceiling's hits, and
the two must agree with the replay's ceiling (a ``LadderError`` otherwise: a replay whose no-eviction rules changed
under this module).

Invariants, checked on random traces (``tests/test_ladder.py``): the rungs never rise from ``prompt_tokens`` down to the
policy, but for a fleet's signed ``routing``; with a tier, under both semantics, every policy and both write policies,
ceiling >= belady (C1 + C2) >= the policy + tier 2 >= the policy at C1 (a tier only adds hits), and
``pool_hits_changed`` is 0 under LRU (and was never negative there under any policy, though that is not asserted). These
orders are the replays' and are not proven (Belady's optimality here is ``belady.py``'s argument; for the tier, no
counterexample turned up in 24,000 random tiered ladders, ids chained or repeated, searched while writing this):
``_assemble`` checks only that each gap is the sum of its causes. A fleet or a ``delivered`` with a tier is refused
(``LadderError``): the replay puts a tier behind one pool, and the scheduling gap would set an engine that delivered
with a tier against the policy's rung, which has none.

``Ladder`` is a plain frozen dataclass with ``to_dict`` (JSON) and ``csv_rows``, so a view renders it without
knowing how it was made.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from astrai.eviction import POLICIES
from astrai.lab.belady import Belady
from astrai.lab.replay import SEMANTICS, Replay, ReplayResult, Semantics, curve
from astrai.lab.tiered import run_tiered
from astrai.lab.trace import Trace, TraceRequest
from astrai.tier import WRITE_POLICIES, WritePolicy

PAGE_FLOOR, NEVER_SEEN, CAPACITY, POLICY, ROUTING, TIER, SCHEDULING = (
    "page_floor",
    "never_seen",
    "capacity",
    "policy",
    "routing",
    "tier",
    "scheduling",
)
PARTIAL_PAGE, LAST_TOKEN, NEW, DIVERGED, OTHER_NAMESPACE = (
    "partial_page",
    "last_token",
    "new",
    "diverged",
    "other_namespace",
)
PROMPT_TOKENS, REACHABLE, CEILING, SINGLE_POOL, DELIVERED = (
    "prompt_tokens",
    "reachable",
    "ceiling",
    "single_pool",
    "delivered",
)
EVICTED_BY_POLICY, SPLIT_INTO_TIERS, LOADED_FROM_TIER2, POOL_HITS_CHANGED = (
    "evicted_by_policy",
    "split_into_tiers",
    "loaded_from_tier2",
    "pool_hits_changed",
)
BELADY_BOTH_TIERS = f"{Belady.name} (C1 + C2)"  # Belady on one pool of both tiers' pages: a tier's reference
CSV_HEADER = ("kind", "name", "cause", "tokens", "share")


def tier_rung(policy: str) -> str:
    """The name of the rung of ``policy`` at C1 with a second tier: ``lru + tier 2``."""
    return f"{policy} + tier 2"


class LadderError(ValueError):
    """The ladder cannot be computed for these inputs (the message says which and why)."""


@dataclass(frozen=True)
class Rung:
    name: str  # a JSON name: prompt_tokens, reachable, ceiling, belady (or BELADY_BOTH_TIERS), single_pool,
    # tier_rung(policy), the policy's, delivered
    tokens: int
    share: float  # of prompt_tokens


@dataclass(frozen=True)
class Gap:
    """The drop from rung ``above`` to rung ``below``: ``tokens`` = above - below = the sum of ``causes``."""

    name: str  # page_floor, never_seen, capacity, policy, routing, tier, scheduling
    above: str
    below: str
    tokens: int  # negative only for routing and scheduling (the lower rung served more)
    share: float  # of prompt_tokens
    causes: tuple[tuple[str, int], ...]  # (cause, tokens), in a fixed order per gap


@dataclass(frozen=True)
class Ladder:
    trace: str
    requests: int
    replicas: int  # 1: one engine; more: a fleet (``single_pool`` is then a rung)
    block_size: int
    capacity: int  # cached pages per replica (tier 1's, with a second tier)
    policy: str
    semantics: Semantics  # the replay's rules (``replay.SEMANTICS``)
    rungs: tuple[Rung, ...]  # top to bottom
    gaps: tuple[Gap, ...]  # one between each two neighbouring rungs, top to bottom
    tier2: int | None = None  # tier 2's blocks (LRU); None: no second tier
    write: WritePolicy | None = None  # tier 2's write policy, with a tier

    @property
    def setting(self) -> str:
        """What was replayed, in words: ``lru at 1,000 cached pages, tier 2 of 20,000 blocks written on_evict``."""
        each = " per replica" if self.replicas > 1 else ""
        tier = "" if self.tier2 is None else f", tier 2 of {self.tier2:,} blocks written {self.write}"
        return f"{self.policy} at {self.capacity:,} cached pages{each}{tier}"

    def rung(self, name: str) -> Rung:
        return next(r for r in self.rungs if r.name == name)

    def gap(self, name: str) -> Gap:
        return next(g for g in self.gaps if g.name == name)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``rungs`` keyed by name (top to bottom) with ``tokens`` and ``share``; ``gaps`` in order, each
        with its rungs, ``tokens``, ``share`` and ``causes`` ({cause: tokens}, summing to ``tokens``)."""
        return {
            "trace": self.trace,
            "requests": self.requests,
            "replicas": self.replicas,
            "block_size": self.block_size,
            "capacity": self.capacity,
            "policy": self.policy,
            "semantics": self.semantics,
            "tier2": self.tier2,
            "write": self.write,
            "rungs": {r.name: {"tokens": r.tokens, "share": r.share} for r in self.rungs},
            "gaps": [
                {
                    "name": g.name,
                    "from": g.above,
                    "to": g.below,
                    "tokens": g.tokens,
                    "share": g.share,
                    "causes": dict(g.causes),
                }
                for g in self.gaps
            ],
        }

    def csv_rows(self) -> list[tuple[str, str, str, int, float]]:
        """Rows under ``CSV_HEADER``: each rung, then each gap and its causes (a cause's share is of prompt_tokens)."""
        prompt = self.rungs[0].tokens
        rows: list[tuple[str, str, str, int, float]] = [("rung", r.name, "", r.tokens, r.share) for r in self.rungs]
        for g in self.gaps:
            rows.append(("gap", g.name, "", g.tokens, g.share))
            rows.extend(("cause", g.name, cause, tokens, tokens / prompt) for cause, tokens in g.causes)
        return rows


def ladder(
    trace: Trace,
    capacity: int,
    policy: str = "lru",
    *,
    delivered: Sequence[int] | None = None,
    namespaces: Sequence[Hashable] | None = None,
    semantics: Semantics = SEMANTICS[0],
    processes: int | None = 1,
    tier2: int | None = None,
    write: str | None = None,
) -> Ladder:
    """The ladder of one engine's requests (``trace``, in the order they ran) at ``capacity`` cached pages.

    ``delivered``: each request's reported ``cached_tokens``, in the trace's order (adds the ``delivered`` rung).
    ``namespaces``: each request's namespace (its cache salt, or tenant): requests of two namespaces never share
    pages, and the trace's ids are then read as the prompts' contents, so a page computed under another namespace
    is told apart from a new one. ``semantics``: the replay's rules (what a capacity is: ``replay.py``).
    ``processes``: replays in parallel, forked (``replay.curve``'s; None: the CPUs). The default, 1, forks nothing:
    keep it in a process with threads (a server: a fork copies one thread and whatever locks the others held).
    ``tier2``: a second tier of that many blocks behind the pool (``capacity`` is then tier 1's), written ``write``
    (``through``, the default, or ``on_evict``: ``tiered.py``); it adds the tier's rung (module docstring)."""
    return fleet_ladder(
        [trace],
        capacity,
        policy,
        delivered=None if delivered is None else [delivered],
        namespaces=None if namespaces is None else [namespaces],
        semantics=semantics,
        processes=processes,
        tier2=tier2,
        write=write,
    )


def fleet_ladder(
    replicas: Sequence[Trace],
    capacity: int,
    policy: str = "lru",
    *,
    delivered: Sequence[Sequence[int]] | None = None,
    namespaces: Sequence[Sequence[Hashable]] | None = None,
    semantics: Semantics = SEMANTICS[0],
    processes: int | None = 1,
    tier2: int | None = None,
    write: str | None = None,
) -> Ladder:
    """The ladder of a fleet: each replica's requests in the order it ran them, ``capacity`` cached pages each.

    The fleet's requests in one sequence (by timestamp; a tie keeps replica order, then each replica's own) give
    ``reachable``, ``ceiling``, ``belady`` and, with more than one replica, ``single_pool`` (capacity times the
    replicas); the policy's rung is each replica's own replay, summed. ``delivered`` and ``namespaces``: per
    replica, as in ``ladder``. ``tier2`` and ``write``: as in ``ladder``, for one replica only."""
    _check_inputs(replicas, capacity, policy, delivered, namespaces)
    tier = _check_tier(replicas, delivered, tier2, write)
    block_size = replicas[0].block_size
    order = sorted(
        ((request.timestamp, r, i) for r, trace in enumerate(replicas) for i, request in enumerate(trace.requests))
    )
    merged = [replicas[r].requests[i] for _, r, i in order]
    chains = _Chains(merged, None if namespaces is None else [namespaces[r][i] for _, r, i in order])
    own = chains.namespaced()
    fleet = Trace(tuple(own), block_size, replicas[0].name if len(replicas) == 1 else "fleet")
    pool = capacity * len(replicas)
    replays = _Replays(semantics, processes)
    prepared = replays.prepare(fleet)
    # the policy with and without eviction in parallel, then Belady (its future is built after the fork, once);
    # with a tier, Belady and the policy on one pool of both tiers' pages too
    both = [] if tier is None else [pool + tier[0]]
    ceiling, single, *one_pool = replays.run(prepared, policy, [None, pool, *both])
    (belady,) = replays.run(prepared, Belady.name, both or [pool])

    floor = _page_floor(merged, block_size)
    seen = chains.never_seen(block_size)
    if seen.ceiling_tokens != ceiling.hit_tokens:
        raise LadderError(
            f"the replay's ceiling serves {ceiling.hit_tokens} tokens, but a cache that never evicts serves "
            f"{seen.ceiling_tokens}: the replay's rules without eviction are not this module's"
        )
    prompt = sum(r.input_length for r in merged)
    steps: list[tuple[str, int, str, tuple[tuple[str, int], ...]]] = [
        (PROMPT_TOKENS, prompt, "", ()),
        (REACHABLE, prompt - sum(floor.values()), PAGE_FLOOR, tuple(floor.items())),
        (CEILING, ceiling.hit_tokens, NEVER_SEEN, seen.causes),
    ]
    capacity_lost = ceiling.hit_tokens - belady.hit_tokens
    served = single.hit_tokens
    if tier is not None:
        blocks, written = tier
        tiered = run_tiered(prepared, policy, capacity, blocks, written, semantics)
        lost = belady.hit_tokens - one_pool[0].hit_tokens
        steps += [
            (BELADY_BOTH_TIERS, belady.hit_tokens, CAPACITY, (("evicted", capacity_lost),)),
            (
                tier_rung(policy),
                tiered.hit_tokens,
                POLICY,
                ((EVICTED_BY_POLICY, lost), (SPLIT_INTO_TIERS, one_pool[0].hit_tokens - tiered.hit_tokens)),
            ),
            (
                policy,
                served,
                TIER,
                ((LOADED_FROM_TIER2, tiered.tier2_hit_tokens), (POOL_HITS_CHANGED, tiered.tier1_hit_tokens - served)),
            ),
        ]
        return _assemble(steps, replicas, capacity, policy, semantics, block_size, tier)
    steps.append((Belady.name, belady.hit_tokens, CAPACITY, (("evicted", capacity_lost),)))
    if len(replicas) == 1:
        steps.append((policy, served, POLICY, ((EVICTED_BY_POLICY, belady.hit_tokens - served),)))
    else:
        steps.append(
            (SINGLE_POOL, single.hit_tokens, POLICY, ((EVICTED_BY_POLICY, belady.hit_tokens - single.hit_tokens),))
        )
        served = sum(_replicas_hits(replicas, own, order, capacity, policy, replays))
        steps.append((policy, served, ROUTING, (("other_replica", single.hit_tokens - served),)))
    if delivered is not None:
        reported = sum(sum(d) for d in delivered)
        steps.append((DELIVERED, reported, SCHEDULING, ((SCHEDULING, served - reported),)))
    return _assemble(steps, replicas, capacity, policy, semantics, block_size)


def _assemble(
    steps: list[tuple[str, int, str, tuple[tuple[str, int], ...]]],
    replicas: Sequence[Trace],
    capacity: int,
    policy: str,
    semantics: Semantics,
    block_size: int,
    tier: tuple[int, WritePolicy] | None = None,
) -> Ladder:
    prompt = steps[0][1]
    rungs = tuple(Rung(name, tokens, tokens / prompt) for name, tokens, _, _ in steps)
    gaps = []
    for (above, above_tokens, _, _), (below, below_tokens, gap, causes) in pairwise(steps):
        tokens = above_tokens - below_tokens
        if sum(t for _, t in causes) != tokens:
            raise AssertionError(f"the causes of {gap} sum to {sum(t for _, t in causes)}, not to its {tokens}")
        gaps.append(Gap(gap, above, below, tokens, tokens / prompt, causes))
    return Ladder(
        trace=replicas[0].name if len(replicas) == 1 else f"fleet of {len(replicas)}",
        requests=sum(len(t.requests) for t in replicas),
        replicas=len(replicas),
        block_size=block_size,
        capacity=capacity,
        policy=policy,
        semantics=semantics,
        rungs=rungs,
        gaps=tuple(gaps),
        tier2=None if tier is None else tier[0],
        write=None if tier is None else tier[1],
    )


def _check_inputs(
    replicas: Sequence[Trace],
    capacity: int,
    policy: str,
    delivered: Sequence[Sequence[int]] | None,
    namespaces: Sequence[Sequence[Hashable]] | None,
) -> None:
    if not replicas or not any(t.requests for t in replicas):
        raise LadderError("no requests: a ladder needs at least one")
    if len({t.block_size for t in replicas}) > 1:
        raise LadderError(f"the replicas' page sizes differ: {sorted({t.block_size for t in replicas})}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise LadderError(f"capacity must be an integer >= 0 (cached pages), got {capacity!r}")
    if policy not in POLICIES:
        raise LadderError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    for what, given in (("delivered", delivered), ("namespaces", namespaces)):
        if given is not None and [len(g) for g in given] != [len(t.requests) for t in replicas]:
            raise LadderError(f"{what} must give one value per request")
    for trace, counts in zip(replicas, delivered, strict=True) if delivered is not None else ():
        for i, (request, count) in enumerate(zip(trace.requests, counts, strict=True)):
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < request.input_length:
                raise LadderError(
                    f"{trace.name}: request {i} reports {count!r} cached tokens of {request.input_length}: a hit "
                    "is an integer from 0 to the prompt's length - 1"
                )


def _check_tier(
    replicas: Sequence[Trace], delivered: object, tier2: int | None, write: str | None
) -> tuple[int, WritePolicy] | None:
    """The second tier asked for, as (blocks, write policy), or None; a ``LadderError`` for one that cannot be."""
    if tier2 is None:
        if write is not None:
            raise LadderError(f"write={write!r} is a second tier's write policy: give tier2, its blocks")
        return None
    if isinstance(tier2, bool) or not isinstance(tier2, int) or tier2 < 0:
        raise LadderError(f"tier2 must be an integer >= 0 (tier 2's blocks), got {tier2!r}")
    policy = next((w for w in WRITE_POLICIES if w == (write or "through")), None)
    if policy is None:
        raise LadderError(f"write must be one of {list(WRITE_POLICIES)}, got {write!r}")
    if len(replicas) > 1:
        raise LadderError("a second tier is replayed behind one engine's pool: a fleet's ladder takes no tier2")
    if delivered is not None:
        raise LadderError(
            "delivered with a second tier is not supported: the scheduling gap sets what an engine delivered "
            "against the policy's rung, which has no tier"
        )
    return tier2, policy


class _Replays:
    """The replay under one set of rules (``semantics``), each policy's capacities in parallel (``curve``)."""

    def __init__(self, semantics: Semantics, processes: int | None) -> None:
        self.semantics, self.processes = semantics, processes

    def prepare(self, trace: Trace) -> Replay:
        return Replay(trace)

    def run(self, prepared: Replay, policy: str, capacities: Sequence[int | None]) -> list[ReplayResult]:
        return curve(prepared, [policy], capacities, self.processes, self.semantics)


def _replicas_hits(
    replicas: Sequence[Trace],
    own: list[TraceRequest],
    order: list[tuple[int, int, int]],
    capacity: int,
    policy: str,
    replays: _Replays,
) -> list[int]:
    """Each replica's hits under ``policy`` at ``capacity``, its requests with the fleet's namespaced ids."""
    per_replica: list[list[TraceRequest]] = [[] for _ in replicas]
    for request, (_, r, _) in zip(own, order, strict=True):
        per_replica[r].append(request)
    hits = []
    for trace, requests in zip(replicas, per_replica, strict=True):
        if not requests:
            hits.append(0)
            continue
        (result,) = replays.run(
            replays.prepare(Trace(tuple(requests), trace.block_size, trace.name)), policy, [capacity]
        )
        hits.append(result.hit_tokens)
    return hits


def _page_floor(requests: Sequence[TraceRequest], block_size: int) -> dict[str, int]:
    """Tokens no prefix cache of this page size can serve, by cause (module docstring)."""
    partial = last = 0
    for request in requests:
        full = request.input_length // block_size
        reusable = (request.input_length - 1) // block_size
        partial += request.input_length - full * block_size
        last += (full - reusable) * block_size
    return {PARTIAL_PAGE: partial, LAST_TOKEN: last}


@dataclass(frozen=True)
class _NeverSeen:
    ceiling_tokens: int
    causes: tuple[tuple[str, int], ...]


class _Chains:
    """The requests' pages as nodes of one prefix tree: a node per (parent, id), so equal nodes are equal prefixes
    (as the replay's chain keys are), both with the namespaces (what the engine shares) and without (what the
    prompts have in common)."""

    def __init__(self, requests: Sequence[TraceRequest], namespaces: Sequence[Hashable] | None) -> None:
        self.requests = requests
        nodes: dict[tuple[Hashable, int], int] = {}
        self.content = [self._walk(nodes, None, r.hash_ids) for r in requests]
        self.own = self.content  # one namespace: the engine shares what the prompts have in common
        if namespaces is not None:
            roots = [("namespace", ns) for ns in namespaces]
            self.own = [self._walk(nodes, root, r.hash_ids) for r, root in zip(requests, roots, strict=True)]

    @staticmethod
    def _walk(nodes: dict[tuple[Hashable, int], int], root: Hashable, ids: Sequence[int]) -> list[int]:
        path = []
        parent = root
        for block in ids:
            parent = nodes.setdefault((parent, block), len(nodes))
            path.append(parent)
        return path

    def namespaced(self) -> list[TraceRequest]:
        """The requests as the engine sees them: ids of (namespace, prefix) where namespaces are given, else as
        they are (so the rungs are exactly what ``python -m astrai.lab`` replays)."""
        if self.own is self.content:
            return list(self.requests)
        return [
            TraceRequest(r.timestamp, r.input_length, r.output_length, tuple(ids))
            for r, ids in zip(self.requests, self.own, strict=True)
        ]

    def never_seen(self, block_size: int) -> _NeverSeen:
        """One pass in order: each request's ceiling hit (its leading reusable pages some earlier request stored in
        its namespace), and its misses by cause (module docstring); then its full pages are stored."""
        stored: set[int] = set()  # namespaced nodes of every full page stored so far
        computed: set[int] = set()  # content nodes of the same
        continued: set[int] = set()  # content nodes some stored full page follows
        hits = new = diverged = other = 0
        for request, own, content in zip(self.requests, self.own, self.content, strict=True):
            reusable = (request.input_length - 1) // block_size
            hit = _leading(own, stored, reusable)
            shared = _leading(content, computed, reusable)
            hits += hit
            other += shared - hit
            if shared < reusable:
                branched = shared > 0 and content[shared - 1] in continued
                diverged += branched
                new += reusable - shared - branched
            full = request.input_length // block_size
            stored.update(own[:full])
            computed.update(content[:full])
            continued.update(content[: max(full - 1, 0)])
        causes: tuple[tuple[str, int], ...] = ((NEW, new * block_size), (DIVERGED, diverged * block_size))
        if self.own is not self.content:  # without namespaces nothing tells another namespace's page from a new one
            causes += ((OTHER_NAMESPACE, other * block_size),)
        return _NeverSeen(hits * block_size, causes)


def _leading(path: Sequence[int], present: set[int], limit: int) -> int:
    """How many of the first ``limit`` nodes of ``path`` are present, counting from the first until one is not."""
    count = 0
    while count < limit and path[count] in present:
        count += 1
    return count
