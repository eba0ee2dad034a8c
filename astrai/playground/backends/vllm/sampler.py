"""What the playground sees of a vLLM server's cache: ``/metrics`` and the KV-event tracker, sampled on a thread.

vLLM has no engine steps a client can see, so a "step" here is a sample in which something changed: about four
times a second the sampler reads ``/metrics`` (``metrics.parse_metrics``) and the tracker's snapshot, turns them
into page events and stable pages (``pages.BlockPages``), and records a ``StepSample`` when anything moved. Its
``page_changes`` come from the tracker; ``prefill_tokens`` / ``decode_tokens`` are ``None`` (not reported per step).
Cached-but-unused blocks are *derived* (blocks held by the events − blocks in use by ``kv_cache_usage_perc``).
A server with an offloading tier (KV events with a medium other than the pool's, ``tracker``) gets it as the
stats' ``second_tier`` and the samples' ``tier_pages``: the blocks it holds, writes and evictions, by the events;
the rest of ``TierStats`` is None (not reported). A server with several tiers shows its nearest (CPU before STORAGE).

Invariants:

- One lock, the backend's: it also guards the requests the stream threads write, so a sample attributes pages to
  requests as they stand between two chunks, never inside one.
- ``step`` and event ``seq`` only grow; ``generation`` grows when the cache behind them is another one, on evidence
  only: ``/metrics`` shows another ``process_start_time_seconds`` (or, without it, counters going back; the event
  subscriber is then told to resync), or the tracker saw its publisher's seq start over. A scrape that fails or
  is slow is no evidence: the stats say "unreachable" meanwhile, and pages, owners and generation stay. Counters
  going back give a sample of zero deltas, never negative ones.
- ``stats()`` raises ``BackendUnavailable`` while ``/metrics`` cannot be read, or its last answer is older than
  ``STALE_AFTER_S``: the UI says "backend unreachable" rather than show old numbers as current.
- The page map is only as whole as the tracker's view: ``caveat()`` says so in words while it is not (a resync
  replaying, or events missed beyond the server's replay buffer), and the stats line shows it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

import httpx

from astrai.observation import CacheSnapshot, CacheStats, EngineEvent, StepSample, TierStats
from astrai.playground.backends.protocol import BackendUnavailable
from astrai.playground.backends.vllm.metrics import MetricsParseError, VllmMetrics, parse_metrics
from astrai.playground.backends.vllm.pages import BlockPages
from astrai.playground.backends.vllm.run import _Request
from astrai.playground.backends.vllm.tracker import TrackerSnapshot

METRICS_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
SAMPLE_EVERY_S = 0.25
STALE_AFTER_S = 3.0  # stats() older than this: the sampler could not reach the server
HIT_WINDOW_S = 60.0
KEEP_EVENTS = 8192
KEEP_SAMPLES = 4096
MATCH_RECENT = 256  # the newest requests whose tokens attribute blocks to panels


def _occupancy(metrics: VllmMetrics, snap: TrackerSnapshot | None) -> tuple[int | None, ...]:
    """``(blocks, in use, cached, free)``, None where not reported: the pool and its used share are ``/metrics``'
    (absent series stay absent, never 0), cached and free are derived from the events and need both."""
    n, usage = metrics.num_blocks, metrics.kv_cache_usage
    used = round(usage * n) if n is not None and usage is not None else None
    cached = max(0, snap.cached_copies - used) if snap is not None and used is not None else None
    return n, used, cached, max(0, n - used - cached) if cached is not None else None  # type: ignore[operator]


NEAREST_FIRST = ("CPU", "STORAGE")  # vLLM's offloading media, nearest the pool first (vllm.v1.kv_offload.base.Medium)


def _second_tier(snap: TrackerSnapshot | None) -> TierStats | None:
    """The server's nearest offloading tier as its KV events show it; None until the events named one. The events
    tell its medium, the blocks it holds, its writes and evictions: every other field is None (not reported)."""
    if snap is None or not snap.tiers:
        return None
    tier = min(snap.tiers, key=lambda t: NEAREST_FIRST.index(t.medium) if t.medium in NEAREST_FIRST else 99)
    return TierStats(
        medium=tier.medium,
        write_policy=None,
        capacity_pages=None,
        pages=len(tier.blocks),
        hit_tokens=None,
        written_pages=tier.written_blocks,
        loaded_pages=None,
        evictions=tier.evicted_blocks,
        bytes_written=None,
        bytes_loaded=None,
        write_seconds=None,
        load_seconds=None,
        enabled=True,
    )


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


class Clock:
    """Step and event numbers, shared by the samplers of one backend (a fleet's replicas), so that their samples
    and events merge into one order. Advanced only under the backend's lock."""

    def __init__(self) -> None:
        self.step = 0
        self.seq = 0


class Sampler:
    """Samples the server into ``StepSample``s, events and pages; answers the backend's observation methods.

    ``requests`` and ``outcomes`` are the backend's, read under ``lock``; ``subscriber`` (or None) gives tracker
    snapshots, and is told to ``resync`` when the server restarted. :meth:`stop` joins the thread.
    """

    def __init__(
        self,
        http: httpx.Client,
        url: str,
        model: str,
        lock: threading.Lock,
        requests: OrderedDict[int, _Request],
        outcomes: dict[str, int],
        subscriber: Any,
        every_s: float,
        clock: Clock | None = None,
    ):
        """``clock``: the step and event numbers to draw from (a fleet's replicas share one); by default its own."""
        self._http, self._url, self._model = http, url, model
        self._lock, self._requests, self._outcomes = lock, requests, outcomes
        self._subscriber = subscriber
        self._every_s = every_s
        self._generation = 1
        self._metrics: VllmMetrics | None = None
        self._metrics_at = 0.0
        self._unreachable: str | None = None
        self._clock = clock or Clock()
        self._step = 0  # the step of this sampler's newest sample
        self._samples: deque[StepSample] = deque(maxlen=KEEP_SAMPLES)
        self._events: deque[EngineEvent] = deque(maxlen=KEEP_EVENTS)
        self._pages = BlockPages()
        self._last_counts: dict[str, float] = {}
        self._cursor: dict[int, int] = {}  # request id -> output tokens already put in a sample
        self._admitted: set[int] = set()  # requests whose usage (prompt and cached tokens) a sample reported
        self._last_signature: tuple = ()
        # a tracker snapshot and its record, one at a time: an earlier snapshot recorded after a later one would
        # read as pages that went and came back
        self._recording = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="vllm-sampler")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=3)

    def forget(self, request_id: int) -> None:
        """Drop what the sampler keeps of a request the backend no longer keeps; the caller holds the lock."""
        self._cursor.pop(request_id, None)
        self._admitted.discard(request_id)

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def steps(self) -> int:
        with self._lock:
            return self._step

    @property
    def unreachable(self) -> str | None:
        with self._lock:
            return self._unreachable

    # ----- reads ----------------------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            metrics, at, unreachable = self._metrics, self._metrics_at, self._unreachable
            step, outcomes = self._step, dict(self._outcomes)
            samples = [s for s in self._samples if s.time >= time.time() - HIT_WINDOW_S]
        if unreachable or metrics is None or time.monotonic() - at > STALE_AFTER_S:
            raise BackendUnavailable(unreachable or f"no answer from {self._url}/metrics for {STALE_AFTER_S:.0f} s")
        snap = self._tracker()
        n, used, cached, free = _occupancy(metrics, snap)
        hits, queries = _int(metrics.prefix_cache_hits), _int(metrics.prefix_cache_queries)
        window_hits, window_queries = sum(s.hit_tokens for s in samples), sum(s.query_tokens for s in samples)
        hit_rate = None if hits is None or queries is None else hits / queries if queries else 0.0
        return CacheStats(
            n_pages=n,
            page_size=metrics.block_size or (snap.block_size if snap else None),
            free_pages=free,
            used_pages=used,
            cached_pages=cached,
            query_tokens=queries,
            hit_tokens=hits,
            readmitted_query_tokens=None,
            readmitted_hit_tokens=None,
            hit_rate=hit_rate,
            recent_hit_rate=window_hits / window_queries if window_queries and hit_rate is not None else hit_rate,
            evictions=snap.removed_blocks if snap is not None else None,
            stored_pages=snap.stored_blocks if snap is not None else None,
            preemptions=_int(metrics.preemptions),
            running=_int(metrics.running),
            waiting=_int(metrics.waiting),
            finished=outcomes["finished"],  # this app's requests (vLLM's per-reason counters are not read)
            cancelled=outcomes["cancelled"],
            failed=outcomes["failed"],
            generated_tokens=outcomes["generated"],
            steps=step,
            prefix_caching=metrics.prefix_caching is not False,
            second_tier=_second_tier(snap),
        )

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            pages = self._pages.pages
            return CacheSnapshot(self._step, tuple(pages[p] for p in sorted(pages)))

    def events(self, after: int) -> list[EngineEvent]:
        with self._lock:
            return [e for e in self._events if e.seq > after]

    def history(self, after_step: int) -> list[StepSample]:
        with self._lock:
            return [s for s in self._samples if s.step > after_step]

    def caveat(self) -> str | None:
        """What the page map cannot vouch for now, in words (None when the events gave all of the cache, or there
        are no events). The tracker's view is incomplete while a resync replays, and after events it missed that
        the server's replay buffer no longer held (or before this app joined, without a replay endpoint)."""
        snap = self._tracker()
        if snap is None:
            return None
        if snap.complete:
            if snap.tiers and not snap.tiers_complete:
                return (
                    "The second tier's count may be incomplete: some of the server's KV events were missed; a cache "
                    "reset does not clear the tier, so only a replay from the server's start makes it whole"
                )
            return None
        if (self._subscriber.status() or {}).get("resyncing"):
            return "The page map is being rebuilt from the server's KV events (resync): it may be incomplete meanwhile"
        return (
            "The page map may be incomplete: some of the server's KV events were missed (beyond its replay buffer, "
            "or from before this app joined); it is whole again once the cache is cleared"
        )

    def _tracker(self) -> TrackerSnapshot | None:
        return self._subscriber.snapshot() if self._subscriber is not None else None

    # ----- sampling -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the sampler must outlive any surprise
                with self._lock:
                    self._unreachable = f"sampler error: {type(exc).__name__}: {exc}"

    def _fetch_metrics(self) -> VllmMetrics:
        response = self._http.get("/metrics", timeout=METRICS_TIMEOUT)
        response.raise_for_status()
        return parse_metrics(response.text, model_name=self._model)

    def tick(self) -> None:
        """One sample, on the caller's thread (the sampler's thread calls it every ``every_s``)."""
        try:
            metrics = self._fetch_metrics()
        except (httpx.HTTPError, MetricsParseError) as exc:
            reason = f"cannot read {self._url}/metrics ({type(exc).__name__}: {exc})"
            with self._lock:
                self._unreachable = reason
            return
        with self._recording:
            self._record_now(metrics, scraped=True)

    def catch_up(self) -> None:
        """Record the KV events the subscriber holds now, without a scrape (the counters stay as last scraped). The
        backend calls it as it sends requests: a request is judged by the events recorded when it was sent, and the
        blocks of a run that just ended are in the subscriber at once, in a sample only at the next tick."""
        with self._recording:
            if self._metrics is not None:
                self._record_now(self._metrics, scraped=False)

    def _record_now(self, metrics: VllmMetrics, scraped: bool) -> None:
        """Record the tracker's state now with ``metrics`` (``scraped``: just read; else the last scrape's again)."""
        snap = self._tracker()
        with self._lock:
            # A restart only on evidence (a slow or failed scrape is none): the server's start time changed (or its
            # counters went back), or the tracker saw its event sequence start over.
            server_restarted = scraped and self._metrics is not None and metrics.restarted_since(self._metrics)
            events_restarted = snap is not None and snap.restarts > self._pages.epoch[1]
            if server_restarted or events_restarted:
                self._generation += 1  # the cache behind us is another one now
            if scraped:
                self._unreachable = None
                self._metrics, self._metrics_at = metrics, time.monotonic()
        if server_restarted and self._subscriber is not None:
            self._subscriber.resync()  # its events may not show it yet: start over from the new server's seq 0
        self._record(metrics, snap)

    def _record(self, metrics: VllmMetrics, snap: TrackerSnapshot | None) -> None:
        """Turn the newest metrics and tracker state into events, pages and (when anything moved) a sample."""
        now = time.time()
        with self._lock:
            recent = list(self._requests.values())[-MATCH_RECENT:]
            changes, events = self._pages.update(snap, recent, now) if snap is not None else ([], [])
            counts = {
                "hits": metrics.prefix_cache_hits or 0.0,
                "queries": metrics.prefix_cache_queries or 0.0,
                "preemptions": metrics.preemptions or 0.0,
                "removed": float(snap.removed_blocks) if snap is not None else 0.0,
            }
            last = self._last_counts or counts
            delta = {k: counts[k] - last.get(k, 0.0) for k in counts}
            if any(v < 0 for v in delta.values()):  # a counter went back: the server restarted
                delta = dict.fromkeys(counts, 0.0)
            self._last_counts = counts
            sampled = []
            running = []
            admitted = []
            for rid, request in self._requests.items():
                done = self._cursor.get(rid, 0)
                if len(request.output_ids) > done:
                    sampled += [(rid, t) for t in request.output_ids[done:]]
                    self._cursor[rid] = len(request.output_ids)
                if request.cached_tokens is not None and rid not in self._admitted:  # its usage told the hit
                    admitted.append((rid, request.prompt_tokens, request.cached_tokens))
                    self._admitted.add(rid)
                if request.status in ("waiting", "running"):
                    running.append(rid)
            _, used, cached, free = _occupancy(metrics, snap)
            tier = _second_tier(snap)
            tier_pages = tier.pages if tier is not None else None
            signature = (used, cached, tier_pages, metrics.running, metrics.waiting, tuple(running))
            moved = changes or events or sampled or admitted or any(delta.values()) or signature != self._last_signature
            self._last_signature = signature
            if not moved:
                return
            previous = self._samples[-1].time if self._samples else now - self._every_s
            clock = self._clock
            clock.step += 1
            step = self._step = clock.step
            for event in events:
                clock.seq += 1
                self._events.append(event(clock.seq, step))
            self._samples.append(
                StepSample(
                    step=step,
                    time=now,
                    duration_s=max(0.0, now - previous),
                    free_pages=free,
                    used_pages=used,
                    cached_pages=cached,
                    prefill_tokens=None,
                    decode_tokens=None,
                    hit_tokens=int(delta["hits"]),
                    query_tokens=int(delta["queries"]),
                    evictions=int(delta["removed"]) if snap is not None else None,
                    preemptions=int(delta["preemptions"]),
                    requests=tuple(running),
                    sampled=tuple(sampled),
                    page_changes=tuple(changes),
                    admitted=tuple(admitted),
                    tier_pages=tier_pages,
                )
            )


__all__ = ["SAMPLE_EVERY_S", "Clock", "Sampler"]
