"""Read a vLLM server's ``/metrics`` (Prometheus text) into the few numbers the playground draws.

Parsing is ``prometheus_client``'s own parser; nothing here guesses. A series the server did not send is ``None``.
Every vLLM series carries the label ``engine`` (the data-parallel rank, ``"0"`` on a single-engine server); the
per-rank values are kept in :attr:`VllmMetrics.ranks` and the top-level fields sum them (the pool usage is the
block-weighted mean, since a fraction does not add up).

Series used (vLLM 0.32; the ``gpu_`` names are the older spellings of the same series):

- ``vllm:kv_cache_usage_perc`` (gauge, 0..1; older: ``vllm:gpu_cache_usage_perc``);
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (counters, in tokens; older:
  ``vllm:gpu_prefix_cache_queries_total`` / ``..._hits_total``);
- ``vllm:num_preemptions_total`` (counter);
- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges);
- ``vllm:cache_config_info`` (an info gauge whose labels carry ``block_size``, ``num_gpu_blocks`` and
  ``enable_prefix_caching``);
- ``process_start_time_seconds`` (the API server process's start, from ``prometheus_client``'s process collector):
  the evidence of a restart, with the counters going back where it is absent (:meth:`VllmMetrics.restarted_since`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

# Field -> sample names, first match wins per rank (current name first, then older spellings).
_SAMPLES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "preemptions": ("vllm:num_preemptions_total",),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
}
_CACHE_CONFIG = "vllm:cache_config_info"
_PROCESS_START = "process_start_time_seconds"
_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions")
_NO_RANK = ""  # a series without an `engine` label


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass(frozen=True)
class RankMetrics:
    """One data-parallel rank (one engine core), as the label ``engine`` names it."""

    engine: str
    kv_cache_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    running: float | None = None
    waiting: float | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    prefix_caching: bool | None = None

    @property
    def hit_rate(self) -> float | None:
        return _ratio(self.prefix_cache_hits, self.prefix_cache_queries)


@dataclass(frozen=True)
class VllmMetrics:
    """Totals across ranks, plus each rank. ``None`` where no rank sent the series."""

    kv_cache_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions: float | None = None
    running: float | None = None
    waiting: float | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    prefix_caching: bool | None = None  # every rank's ``enable_prefix_caching``; None when not reported
    ranks: Mapping[str, RankMetrics] = field(default_factory=lambda: MappingProxyType({}))
    model_names: frozenset[str] = frozenset()
    process_start: float | None = None  # ``process_start_time_seconds``: changes when the server restarts

    @property
    def hit_rate(self) -> float | None:
        """Cumulative prefix-cache hit rate in tokens (hits / queries), ``None`` before any query."""
        return _ratio(self.prefix_cache_hits, self.prefix_cache_queries)

    def hit_rate_since(self, earlier: VllmMetrics) -> float | None:
        """Hit rate over the window since ``earlier``; ``None`` without new queries or when a counter went back
        (the server restarted)."""
        if None in (self.prefix_cache_hits, self.prefix_cache_queries):
            return None
        if None in (earlier.prefix_cache_hits, earlier.prefix_cache_queries):
            return None
        hits = self.prefix_cache_hits - earlier.prefix_cache_hits  # type: ignore[operator]
        queries = self.prefix_cache_queries - earlier.prefix_cache_queries  # type: ignore[operator]
        if hits < 0 or queries <= 0:
            return None
        return hits / queries

    def restarted_since(self, earlier: VllmMetrics) -> bool:
        """Whether the server restarted between ``earlier`` and this scrape, on evidence only: its process start
        time changed, or (where either scrape lacks it) a counter went back. A slow or failed scrape in between is
        no evidence."""
        if self.process_start is not None and earlier.process_start is not None:
            return self.process_start != earlier.process_start
        for name in _COUNTERS:
            now, before = getattr(self, name), getattr(earlier, name)
            if now is not None and before is not None and now < before:
                return True
        return False


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    value = labels.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:  # vLLM writes "None" for unset values
        return None


def _bool_label(labels: Mapping[str, str], name: str) -> bool | None:
    value = labels.get(name)
    return {"True": True, "False": False}.get(value) if value is not None else None


def _sum(values: Iterable[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(sum(present)) if present else None


def parse_metrics(text: str, model_name: str | None = None) -> VllmMetrics:
    """Parse ``/metrics`` text. With ``model_name``, series labelled with another ``model_name`` are ignored."""
    wanted = {sample: fieldname for fieldname, names in _SAMPLES.items() for sample in names}
    priority = {sample: names.index(sample) for names in _SAMPLES.values() for sample in names}
    # rank -> field -> (priority, value)
    found: dict[str, dict[str, tuple[int, float]]] = {}
    pools: dict[str, tuple[int | None, int | None, bool | None]] = {}
    model_names: set[str] = set()
    process_start: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            if family.name == _PROCESS_START and family.samples:
                process_start = family.samples[0].value
            if not family.name.startswith("vllm:"):
                continue
            for sample in family.samples:
                labels = sample.labels
                if "model_name" in labels:
                    if model_name is not None and labels["model_name"] != model_name:
                        continue
                    model_names.add(labels["model_name"])
                rank = labels.get("engine", _NO_RANK)
                if sample.name == _CACHE_CONFIG:
                    pools[rank] = (
                        _int_label(labels, "num_gpu_blocks"),
                        _int_label(labels, "block_size"),
                        _bool_label(labels, "enable_prefix_caching"),
                    )
                    found.setdefault(rank, {})
                    continue
                fieldname = wanted.get(sample.name)
                if fieldname is None:
                    continue
                per_rank = found.setdefault(rank, {})
                rank_priority = priority[sample.name]
                if fieldname in per_rank and per_rank[fieldname][0] < rank_priority:
                    continue  # the current name was already read for this rank
                if fieldname in per_rank and per_rank[fieldname][0] == rank_priority:
                    # the same series twice for one rank (e.g. more labels than engine/model_name): add them up
                    rank_priority, previous = per_rank[fieldname]
                    per_rank[fieldname] = (rank_priority, previous + sample.value)
                else:
                    per_rank[fieldname] = (rank_priority, sample.value)
    except ValueError as error:
        raise MetricsParseError(f"not Prometheus text: {error}") from error

    ranks: dict[str, RankMetrics] = {}
    for rank in sorted(found, key=_rank_key):
        values = {name: value for name, (_, value) in found[rank].items()}
        num_blocks, block_size, caching = pools.get(rank, (None, None, None))
        ranks[rank] = RankMetrics(
            engine=rank, num_blocks=num_blocks, block_size=block_size, prefix_caching=caching, **values
        )
    return replace(_totals(ranks, frozenset(model_names)), process_start=process_start)


def _rank_key(rank: str) -> tuple[int, int | str]:
    return (0, int(rank)) if rank.isdigit() else (1, rank)


def _totals(ranks: dict[str, RankMetrics], model_names: frozenset[str]) -> VllmMetrics:
    rows = list(ranks.values())
    block_sizes = {r.block_size for r in rows if r.block_size is not None}
    caching = {r.prefix_caching for r in rows if r.prefix_caching is not None}
    return VllmMetrics(
        kv_cache_usage=_weighted_usage(rows),
        prefix_cache_queries=_sum(r.prefix_cache_queries for r in rows),
        prefix_cache_hits=_sum(r.prefix_cache_hits for r in rows),
        preemptions=_sum(r.preemptions for r in rows),
        running=_sum(r.running for r in rows),
        waiting=_sum(r.waiting for r in rows),
        num_blocks=int(total) if (total := _sum(r.num_blocks for r in rows)) is not None else None,
        block_size=block_sizes.pop() if len(block_sizes) == 1 else None,
        prefix_caching=caching.pop() if len(caching) == 1 else None,
        ranks=MappingProxyType(ranks),
        model_names=model_names,
    )


def _weighted_usage(rows: list[RankMetrics]) -> float | None:
    """The pool-wide used fraction: weighted by each rank's block count where every rank reports one."""
    usage = [(r.kv_cache_usage, r.num_blocks) for r in rows if r.kv_cache_usage is not None]
    if not usage:
        return None
    weighted = [(used, blocks) for used, blocks in usage if blocks]
    if len(weighted) == len(usage):
        return sum(used * blocks for used, blocks in weighted) / sum(blocks for _, blocks in weighted)
    return sum(used for used, _ in usage) / len(usage)


__all__ = ["MetricsParseError", "RankMetrics", "VllmMetrics", "parse_metrics"]
