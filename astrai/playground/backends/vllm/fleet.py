"""A fleet's replicas seen as one cache (``Replicas``): their counters summed, their pages numbered apart.

Each replica keeps its own pages, numbered from 0 (``pages.BlockPages``). Seen as one pool, page ``p`` of replica
``r`` of ``n`` is page ``p * n + r``: unique, and stable while the page stays (a replica's slots never move). The
replicas' samplers draw steps and event numbers from one ``Clock``, so their samples and events merge into one
order. What the views need per replica (its page map, occupancy, hit rate) they read from the replica itself.

Counting rule: a sum is only as reported as its parts. A field that any reachable replica does not report is
``None`` for the fleet (summing the others would undercount); an unreachable replica is left out, and the
backend's caveat names it.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, PageEvicted, PageRecord, PageStored, StepSample
from astrai.playground.backends.protocol import BackendUnavailable, Served, fleet_page
from astrai.playground.backends.vllm.replica import Replica

SUMMED = (
    "n_pages",
    "free_pages",
    "used_pages",
    "cached_pages",
    "query_tokens",
    "hit_tokens",
    "evictions",
    "stored_pages",
    "preemptions",
    "running",
    "waiting",
)


def merge_stats(stats: Sequence[CacheStats]) -> CacheStats:
    """The replicas' stats as one cache's (``stats`` non-empty). Outcomes and generated tokens are this app's and
    equal in every replica's stats (they share the backend's counts): taken once. A replica's offloading tier is
    its own (each replica's stats show it): the fleet's has none."""
    first = stats[0]
    summed: dict[str, Any] = {}  # CacheStats' int | None fields, by name
    for name in SUMMED:
        values = [getattr(s, name) for s in stats]
        summed[name] = None if any(v is None for v in values) else sum(values)
    hits, queries = summed["hit_tokens"], summed["query_tokens"]
    hit_rate = None if hits is None or queries is None else hits / queries if queries else 0.0
    sizes = {s.page_size for s in stats}
    return dataclasses.replace(
        first,
        **summed,
        page_size=sizes.pop() if len(sizes) == 1 else None,
        readmitted_query_tokens=None,
        readmitted_hit_tokens=None,
        hit_rate=hit_rate,
        recent_hit_rate=_recent(stats, hit_rate),
        steps=max(s.steps for s in stats),
        prefix_caching=all(s.prefix_caching for s in stats),
        second_tier=None,
    )


def _recent(stats: Sequence[CacheStats], overall: float | None) -> float | None:
    """The replicas' recent hit rates weighted by their queries (a fleet-wide recent window is not kept)."""
    pairs = [(s.recent_hit_rate, s.query_tokens) for s in stats]
    known = [(rate, queries) for rate, queries in pairs if rate is not None and queries is not None]
    if len(known) < len(pairs):
        return overall
    weight = sum(q for _, q in known)
    return sum(r * q for r, q in known) / weight if weight else overall


def _renumber(record: PageRecord, replica: int, replicas: int) -> PageRecord:
    return dataclasses.replace(record, page=fleet_page(record.page, replica, replicas))


def merge_snapshots(snapshots: Sequence[CacheSnapshot]) -> CacheSnapshot:
    """Every replica's pages in one pool (replica ``r``'s page ``p`` as ``p * n + r``), sorted by page."""
    n = len(snapshots)
    pages = [_renumber(p, r, n) for r, snap in enumerate(snapshots) for p in snap.pages]
    pages.sort(key=lambda p: p.page)
    return CacheSnapshot(max((s.step for s in snapshots), default=0), tuple(pages))


PAGE_EVENTS = (PageStored, PageEvicted)  # the events that name a page


def merge_events(per_replica: Sequence[list[EngineEvent]]) -> list[EngineEvent]:
    """The replicas' events in their shared ``seq`` order, pages renumbered."""
    n = len(per_replica)
    tagged = [[(e.seq, r, e) for e in events] for r, events in enumerate(per_replica)]
    merged = []
    for _, replica, event in heapq.merge(*tagged, key=lambda t: t[0]):
        if isinstance(event, PAGE_EVENTS):
            event = dataclasses.replace(event, page=fleet_page(event.page, replica, n))
        merged.append(event)
    return merged


def merge_history(per_replica: Sequence[list[StepSample]]) -> list[StepSample]:
    """The replicas' samples in their shared ``step`` order, the pages they changed renumbered.

    A sample's counts (hits, queries, evictions, preemptions in that step) add up across the fleet; its occupancy
    (its tier's included) was its own replica's alone, so it is None here (the per-replica charts read each
    replica's history). The requests' tokens and admissions come from the backend's one table of requests, which
    every replica's sampler reads: they are kept from the first replica's samples only, else a fleet of n replays
    each token n times."""
    n = len(per_replica)
    tagged = [[(s.step, r, s) for s in samples] for r, samples in enumerate(per_replica)]
    return [
        dataclasses.replace(
            s,
            free_pages=None,
            used_pages=None,
            cached_pages=None,
            tier_pages=None,
            page_changes=tuple(_renumber(p, r, n) for p in s.page_changes),
            sampled=s.sampled if r == 0 else (),
            admitted=s.admitted if r == 0 else (),
        )
        for _, r, s in heapq.merge(*tagged, key=lambda t: t[0])
    ]


class Replicas:
    """The observation side of the ``Backend`` protocol over one or more replicas: one replica is read as it is,
    several as one cache (the functions above). Thread-safe as the replicas are."""

    def __init__(self, replicas: Sequence[Replica]):
        self.all = tuple(replicas)

    @property
    def generation(self) -> int:
        """Grows when any replica's cache is replaced (a restart); 1 to start with."""
        return sum(r.generation for r in self.all) - len(self.all) + 1

    @property
    def steps(self) -> int:
        """The newest step of any replica (as ``merge_stats`` counts them)."""
        return max(r.steps for r in self.all)

    @property
    def unreachable(self) -> str | None:
        """Why no replica can be reached now; None while one answers."""
        reasons = [r.unreachable for r in self.all]
        if not all(reasons):
            return None
        if len(self.all) == 1:
            return reasons[0]
        return "; ".join(f"{r.name}: {why}" for r, why in zip(self.all, reasons, strict=True))

    @property
    def caveat(self) -> str | None:
        """What the page map cannot vouch for now: a replica's resync or missed events, a replica away."""
        if len(self.all) == 1:
            return self.all[0].caveat
        notes = []
        for replica in self.all:
            why = replica.unreachable and "unreachable: its pages and counters are left out"
            if why or (why := replica.caveat):
                notes.append(f"{replica.name}: {why}")
        return "; ".join(notes) or None

    def stats(self) -> CacheStats:
        if len(self.all) == 1:
            return self.all[0].stats()  # raises, saying why, while the server does not answer
        stats = []
        for replica in self.all:
            try:
                stats.append(replica.stats())
            except BackendUnavailable:
                continue  # left out, as the caveat says
        if not stats:
            raise BackendUnavailable(self.unreachable or "no replica answers")
        return merge_stats(stats)

    def snapshot(self) -> CacheSnapshot:
        if len(self.all) == 1:
            return self.all[0].snapshot()
        return merge_snapshots([r.snapshot() for r in self.all])

    def events(self, after: int) -> list[EngineEvent]:
        if len(self.all) == 1:
            return self.all[0].events(after)
        return merge_events([r.events(after) for r in self.all])

    def history(self, after_step: int) -> list[StepSample]:
        if len(self.all) == 1:
            return self.all[0].history(after_step)
        return merge_history([r.history(after_step) for r in self.all])

    def served_by(self, sessions: Iterable[str]) -> dict[str, Served]:
        """Session (vLLM request) id -> the replica whose KV events named it; {} for one server."""
        if len(self.all) < 2:
            return {}
        sessions = list(sessions)
        return {s: Served(r.label, "its KV events") for r in self.all for s in r.served(sessions)}


__all__ = [
    "Replicas",
    "merge_events",
    "merge_history",
    "merge_snapshots",
    "merge_stats",
]
