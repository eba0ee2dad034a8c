"""Per-step samples turned into the time series the charts draw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from astrai.observation import CacheStats, StepSample

MAX_POINTS = 300  # per time series drawn


@dataclass(frozen=True)
class Series:
    """The time series the charts draw, one point per engine step (live: plus one for "now")."""

    x_title: str
    ages: list[float]  # x of each point: seconds before now (live), or since the run started (replay)
    used: list[int | None]  # None: not reported by the backend
    cached: list[int | None]  # None: not reported by the backend
    free: list[int | None]
    evictions: list[int | None]  # cumulative from the left edge; None: not reported
    hit_rate: list[float | None]  # cumulative hit rate (0..1) after each step
    step_hit_ages: list[float]  # steps that admitted requests ...
    step_hit_rate: list[float]  # ... and the hit share of the prompt tokens they admitted
    marker: float | None = None  # replay: the x of the step shown
    prefix_caching: bool = True  # off: nothing is looked up, so there is no hit rate to draw (not 0%)
    hit_rate_scope: str = "since the engine started"  # whose prompts the hit-rate line counts
    eviction: str | None = None  # the pool's eviction policy (None: not reported): what the LRU chart is called
    tier: list[int | None] | None = None  # pages the second tier holds, per point; None: the engine has none


def series(history: Sequence[StepSample], stats: CacheStats, now: float, window_s: float = 120.0) -> Series:
    """Turn per-step samples into chart series over the last ``window_s`` seconds.

    The cumulative hit rate after step k is recovered exactly from the current totals minus the hits and queries
    of the steps after k, so it agrees with ``stats`` at the right edge whatever the history ring still holds.
    """
    samples = [s for s in history if s.time >= now - window_s]
    hits_after, queries_after = 0, 0
    hit_rate: list[float | None] = []
    for s in reversed(samples):
        if stats.hit_tokens is None or stats.query_tokens is None:  # not reported: no line, not 0%
            hit_rate.append(None)
            continue
        hits, queries = stats.hit_tokens - hits_after, stats.query_tokens - queries_after
        hit_rate.append(hits / queries if queries else None)
        hits_after += s.hit_tokens
        queries_after += s.query_tokens
    hit_rate.reverse()
    evictions: list[int | None] = []
    total: int | None = 0
    for s in samples:
        total = None if total is None or s.evictions is None else total + s.evictions
        evictions.append(total)
    if stats.evictions is None:
        total = None
    admitted = [s for s in samples if s.query_tokens]
    x = [round(s.time - now, 3) for s in samples] + [0.0]
    used = [s.used_pages for s in samples] + [stats.used_pages]
    cached = [s.cached_pages for s in samples] + [stats.cached_pages]
    free = [s.free_pages for s in samples] + [stats.free_pages]
    evictions.append(total)
    hit_rate.append(stats.hit_rate if stats.query_tokens else None)
    tier = None if stats.second_tier is None else [s.tier_pages for s in samples] + [stats.second_tier.pages]
    keep = _points_to_draw(x, list(zip(used, cached, free, evictions, hit_rate, tier or [None] * len(x), strict=True)))
    return Series(
        x_title="seconds ago",
        ages=[x[i] for i in keep],
        used=[used[i] for i in keep],
        cached=[cached[i] for i in keep],
        free=[free[i] for i in keep],
        evictions=[evictions[i] for i in keep],
        hit_rate=[hit_rate[i] for i in keep],
        step_hit_ages=[round(s.time - now, 3) for s in admitted],
        step_hit_rate=[s.hit_tokens / s.query_tokens for s in admitted],
        prefix_caching=stats.prefix_caching,
        eviction=stats.eviction,
        tier=None if tier is None else [tier[i] for i in keep],
    )


def _points_to_draw(x: list[float], values: list[tuple], max_points: int = MAX_POINTS) -> list[int]:
    """Indices of the points a step-shaped chart needs: the first, the last, and each one whose values differ from
    the point before (a repeat adds nothing to an "hv" line). Past ``max_points``, the last point of each equal
    slice of the x range is kept: a browser redraws thousands of points every second otherwise."""
    keep = [i for i in range(len(x)) if i in (0, len(x) - 1) or values[i] != values[i - 1]]
    if len(keep) <= max_points:
        return keep
    width = (x[-1] - x[0]) / max_points or 1.0
    buckets: dict[int, int] = {}
    for i in keep:
        buckets[int((x[i] - x[0]) / width)] = i  # the bucket's last point wins
    return sorted({keep[0], *buckets.values(), keep[-1]})
