"""InferenceEngine: the public API, and the background loop that schedules, runs and streams every step."""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, Literal, cast, overload

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from astrai.checkpoints import load_checkpoint
from astrai.detokenizer import IncrementalDetokenizer
from astrai.device import resolve_device, uses_openmp
from astrai.explain import Explanation, LiveHistory
from astrai.kv_cache_manager import KVCacheManager
from astrai.model_runner import SUPPORTED_DTYPES, BackgroundCompile, ModelRunner, Preparation, kv_bytes_per_token
from astrai.observation import (
    CacheCleared,
    CacheSnapshot,
    CacheStats,
    EngineEvent,
    PageRecord,
    RequestFinished,
    RequestInfo,
    StepSample,
    TierStats,
)
from astrai.openmp import release_pool
from astrai.page_pool import PagePool
from astrai.request import Request, Status
from astrai.sampling import MAX_SEED, SamplingParams, sample
from astrai.scheduler import Scheduler
from astrai.streams import GenerationStream
from astrai.tier import WRITE_POLICIES, SecondTier, TierStore, open_store

log = logging.getLogger("astrai")

_running_engines: weakref.WeakSet[InferenceEngine] = weakref.WeakSet()  # not shut down yet


@atexit.register
def _shut_down_at_exit() -> None:
    """Stop every engine's loop before the interpreter finalizes.

    Why: the loop is a daemon thread (a script need not shut an engine down to exit), and once the interpreter is
    finalizing, a daemon thread that takes the GIL back is ended on the spot by a forced unwind. A loop ended so in
    the middle of a step is inside torch's C++ code, and the unwind aborts the whole process ("terminate called
    without an active exception", exit status 134): a script that stopped reading a stream early and returned
    crashed at exit. ``atexit`` runs before that point, so each loop finishes its step and ends as ``shutdown``
    ends it.
    """
    for engine in list(_running_engines):
        engine.shutdown()


class EngineClosedError(RuntimeError):
    """The engine was shut down (or its loop died) before the request could finish."""


class RequestFailedError(RuntimeError):
    """A step that computed this request raised; the message names the cause."""


class TenantReserveFull(RuntimeError):
    """``add_tenant`` asked for more pages than the engine's tenant reserve has free in one range."""


Delivery = tuple[queue.SimpleQueue, tuple[int, str, Any]]
Counters = tuple[int, int, int, int]  # evictions, preemptions, hit tokens, query tokens: a step records their deltas


def _check_tier_options(
    offload_pages: int,
    offload_to: str | os.PathLike[str],
    offload_policy: str,
    prefix_caching: bool,
    device: torch.device,
) -> None:
    """Raise ``ValueError`` where a second tier's options (``InferenceEngine``'s, ``add_tenant``'s) cannot work."""
    if isinstance(offload_pages, bool) or not isinstance(offload_pages, int) or offload_pages < 0:
        raise ValueError(f"offload_pages must be an integer >= 0 (0: no second tier), got {offload_pages!r}")
    if not offload_pages:
        return
    if offload_policy not in WRITE_POLICIES:
        raise ValueError(f"offload_policy must be one of {list(WRITE_POLICIES)}, got {offload_policy!r}")
    if not prefix_caching:
        raise ValueError("a second tier (offload_pages) needs prefix_caching: with it off nothing is looked up")
    if offload_to != "memory" and device.type != "cpu":
        raise ValueError('a file tier reads into host memory: with the KV on a GPU, use offload_to="memory"')


class Tenant:
    """One pool served by an engine: its page quota, prefix index, eviction order, scheduler and observation.

    Its pages are numbered 0..n_pages-1, as its page map, events and snapshot show them; they are the KV pages
    ``page_offset``.. of the engine's tensors (each request carries the offset, the runner adds it). Everything a
    reader sees is the tenant's own: events, stats, snapshot, history (with step numbers of its own: a sample per
    step it took part in, so a replay of it holds no other tenant's step), request info and explanations. Its
    requests are computed in the engine's shared forwards. ``InferenceEngine`` is its default tenant; more come
    from ``InferenceEngine.add_tenant`` and end with ``close()``.

    Every method takes the engine's ``_lock`` (never this tenant's ``_observed_lock`` first): see the engine's
    docstring for who owns what.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        n_pages: int,
        page_size: int,
        page_offset: int,
        max_batch_size: int,
        prefix_caching: bool,
        eviction: str,
        event_log_size: int,
        history_size: int,
        keep_finished: int,
        explain_keys: int,
    ):
        self._engine = engine
        # one lock for every tenant of the engine: its loop schedules them all at once
        self._lock: threading.RLock = engine._lock
        self.tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        self.page_offset = page_offset
        self._observed_lock = threading.Lock()  # the event log and the step history only
        self._events: deque[EngineEvent] = deque(maxlen=event_log_size)
        self._event_seq = 0
        self._history: deque[StepSample] = deque(maxlen=history_size)
        self.steps = 0  # steps this tenant took part in; events of the step in progress carry steps + 1
        self._generated_tokens = 0

        self._explainer = LiveHistory(  # fed each event by ``_emit``; read by ``explain`` under a lock of its own
            max_keys=explain_keys,
            max_requests=max(keep_finished, 4096),
            pages=n_pages,
            page_size=page_size,
            prefix_caching=prefix_caching,
        )
        self.pool = PagePool(n_pages, page_size, emit=self._emit, eviction=eviction)
        self.cache = KVCacheManager(self.pool, prefix_caching)
        self.scheduler = Scheduler(self.cache, max_batch_size, engine.max_batched_tokens, self._emit)

        self._cancelled: set[int] = set()
        self._outputs: dict[int, tuple[queue.SimpleQueue, int, IncrementalDetokenizer]] = {}
        self._live: dict[int, Request] = {}  # waiting or running: bounded by the queues themselves
        self._ended: OrderedDict[int, Request] = OrderedDict()  # the last ``keep_finished`` ended requests
        self._keep_finished = keep_finished
        self._ended_counts: Counter[str] = Counter()
        self._end_unrecorded = False  # a request ended since the last step was recorded
        self._closed = False  # ``close()``d: a tenant's own end, not the engine's

    # ----- the public API -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[str],
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stream: bool = False,
        cache_salt: str | list[str] | None = None,
    ) -> str | list[str] | GenerationStream:
        """Generate continuations. A single prompt gives a str (or a stream of str deltas); a list gives a list
        (or a stream of ``(index, delta)``). Requests are registered now, not when the stream is first read.

        ``cache_salt`` puts the requests in their own prefix-cache namespace; a list gives each prompt its own
        (distinct salts make a batch that shares nothing, not even within itself)."""
        texts = _validate_prompts(prompts)
        token_ids = [list(self.tokenizer(text)["input_ids"]) for text in texts]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._submit(token_ids, params, cache_salt, stream, single=isinstance(prompts, str))

    def generate_ids(
        self,
        token_ids: list[list[int]],
        *,
        stream: bool = False,
        cache_salt: str | list[str] | None = None,
        **sampling: Any,
    ) -> list[str] | GenerationStream:
        """Like ``generate`` for already tokenized prompts (used as given: no BOS is added)."""
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("token_ids must be a non-empty list of token id lists")
        vocab = len(self.tokenizer)
        for i, ids in enumerate(token_ids):
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} must be a non-empty list of token ids in [0, {vocab})")
        return self._submit([list(ids) for ids in token_ids], SamplingParams(**sampling), cache_salt, stream)

    @overload
    def _submit(
        self,
        token_ids: list[list[int]],
        params: SamplingParams,
        salt: str | list[str] | None,
        stream: bool,
        single: Literal[False] = False,
    ) -> list[str] | GenerationStream: ...
    @overload
    def _submit(
        self,
        token_ids: list[list[int]],
        params: SamplingParams,
        salt: str | list[str] | None,
        stream: bool,
        single: bool,
    ) -> str | list[str] | GenerationStream: ...
    def _submit(
        self,
        token_ids: list[list[int]],
        params: SamplingParams,
        salt: str | list[str] | None,
        stream: bool,
        single: bool = False,
    ) -> str | list[str] | GenerationStream:
        """Register the requests; return their stream, or (``stream`` false) their texts once done: a str where
        ``single``, else a list."""
        salts = salt if isinstance(salt, list) else [salt] * len(token_ids)
        if len(salts) != len(token_ids) or not all(s is None or isinstance(s, str) for s in salts):
            raise TypeError(f"cache_salt must be a str, None, or a list of one str per prompt, got {salt!r}")
        requests = [
            self._make_request(i, ids, params, s) for i, (ids, s) in enumerate(zip(token_ids, salts, strict=True))
        ]
        items: queue.SimpleQueue = queue.SimpleQueue()
        self._engine._release_pool()  # the caller waits on the engine: its idle OpenMP workers would slow the loop's
        with self._lock:
            self._check_alive()
            for index, req in enumerate(requests):
                self._outputs[req.id] = (items, index, IncrementalDetokenizer(self.tokenizer))
                self._live[req.id] = req
                self.scheduler.add(req)
            self._engine._work_arrived.notify_all()
        out = GenerationStream([r.id for r in requests], items, self.cancel, self._check_alive, indexed=not single)
        if stream:
            return out
        results = [""] * len(requests)
        for index, delta in ((0, d) for d in out) if single else out:
            results[index] += delta
        return results[0] if single else results

    def cancel(self, request_ids: list[int]) -> None:
        """Cancel requests; the loop releases their pages at the start of its next step."""
        with self._lock:
            self._cancelled.update(request_ids)
            self._engine._work_arrived.notify_all()

    def clear(self) -> int:
        """Empty the prefix cache (cached pages become free). Safe while requests run. Returns pages freed."""
        with self._lock:
            freed = self.cache.clear()
            self._emit(CacheCleared, pages=freed)
            self._engine._work_arrived.notify_all()  # an idle loop records the change as a step of its own
            return freed

    def close(self) -> None:
        """End this tenant: its unfinished requests fail with ``EngineClosedError`` (their streams end at once), and
        its pages go back to the engine's reserve for another tenant. Idempotent. The engine's own pool ends with
        ``shutdown()``, not here.

        Safe while a step runs: the tenant is no longer scheduled from now on, and where the running step computes
        some of its requests, this waits for that step to end (one forward) before it takes their pages."""
        engine = self._engine
        if self is engine:
            raise TypeError("the engine's own pool ends with shutdown(), not close()")
        with engine._lock:
            if self._closed:
                return
            self._closed = True
            while self in engine._in_flight and engine._thread.is_alive():
                engine._work_arrived.wait(0.05)
            closing = EngineClosedError("this tenant was closed before the request finished")
            outbox = self._fail([*self.scheduler.running, *self.scheduler.waiting], closing)
            engine._tenants.remove(self)
            engine._reserve.release(self.page_offset, self.pool.n_pages)
            if self.cache.tier is not None:
                self.cache.tier.close()  # no step touches it from now on; its file, if any, is deleted
            engine._work_arrived.notify_all()
        _deliver(outbox)

    def _attach_tier(self, store: TierStore, write_policy: str) -> None:
        """Give this pool a second tier over ``store``, bound to the pool's own rows of the engine's KV (its pages
        ``page_offset``..: row slices of each plane, contiguous, so a tier's page ``p`` is the pool's page ``p``)."""
        first, end = self.page_offset, self.page_offset + self.pool.n_pages
        planes = [plane[first:end] for plane in self._engine.runner.kv_planes()]
        self.cache.attach_tier(SecondTier(store, planes, write_policy, emit=self._emit))

    # ----- the observation API ----------------------------------------------------------------------------
    def cache_stats(self) -> CacheStats:
        with self._lock:
            pool, cache = self.pool, self.cache
            hit_rate, recent = cache.hit_rates()
            return CacheStats(
                n_pages=pool.n_pages,
                page_size=pool.page_size,
                free_pages=pool.free_pages,
                used_pages=pool.used_pages,
                cached_pages=pool.cached_pages,
                query_tokens=cache.query_tokens,
                hit_tokens=cache.hit_tokens,
                readmitted_query_tokens=cache.readmitted_query_tokens,
                readmitted_hit_tokens=cache.readmitted_hit_tokens,
                hit_rate=hit_rate,
                recent_hit_rate=recent,
                evictions=pool.stats.evictions,
                stored_pages=pool.stats.stored,
                preemptions=self.scheduler.preemptions,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                finished=self._ended_counts[Status.FINISHED],
                cancelled=self._ended_counts[Status.CANCELLED],
                failed=self._ended_counts[Status.FAILED],
                generated_tokens=self._generated_tokens,
                steps=self.steps,
                prefix_caching=cache.prefix_caching,
                eviction=pool.policy.name,
                forward=self._engine.runner.forward_kind,
                second_tier=self._tier_stats(),
            )

    def _tier_stats(self) -> TierStats | None:
        tier = self.cache.tier
        if tier is None:
            return None
        counters = tier.counters
        return TierStats(
            medium=tier.store.medium,
            write_policy=tier.write_policy,
            capacity_pages=tier.n_pages,
            pages=tier.held_pages,
            hit_tokens=self.cache.tier_hit_tokens,
            written_pages=counters.written_pages,
            loaded_pages=counters.loaded_pages,
            evictions=counters.evictions,
            bytes_written=counters.bytes_written,
            bytes_loaded=counters.bytes_loaded,
            write_seconds=counters.write_seconds,
            load_seconds=counters.load_seconds,
            enabled=tier.enabled,
            error=tier.error,
        )

    def cache_snapshot(self) -> CacheSnapshot:
        """Every page after ``step`` completed steps: state, ref count, LRU rank, running owners, keys and tokens."""
        with self._lock:
            return CacheSnapshot(step=self.steps, pages=tuple(self._page_records(range(self.pool.n_pages))))

    def _page_records(self, pages: Iterable[int]) -> list[PageRecord]:
        """Records of these pages. A page still being filled is not indexed yet: its tokens come from its owner."""
        pool, size = self.pool, self.pool.page_size
        pages = list(pages)
        wanted = set(pages)  # the per-step history asks for a few pages: owners only for those
        ranks = pool.lru_rank() if any(page in pool.lru for page in pages) else {}
        owners: dict[int, list[int]] = {}
        first_owner: dict[int, Request] = {}
        for req in self.scheduler.running:
            # the set scans the page table in C: a decode step asks for ~1 page of each request's ~20
            for page in wanted.intersection(req.pages):
                owners.setdefault(page, []).append(req.id)
                first_owner.setdefault(page, req)
        records = []
        for page in pages:
            tokens, pos = pool.tokens[page], pool.chain_pos[page]
            if tokens is None and page in first_owner:
                req = first_owner[page]
                pos = req.pages.index(page)  # a page table holds a page once (each position has its own chain key)
                tokens = tuple(req.token_ids[pos * size : min((pos + 1) * size, req.num_computed)])
            records.append(
                PageRecord(
                    page=page,
                    state=pool.state(page).value,
                    ref_count=pool.ref_count[page],
                    lru_rank=ranks.get(page),
                    requests=tuple(owners.get(page, ())),
                    chain_pos=pos,
                    key=pool.key[page],
                    parent_key=pool.parent_key[page],
                    stored_by=pool.stored_by[page],
                    hits=pool.hits[page],
                    token_ids=tuple(tokens or ()),
                )
            )
        return records

    def events(self, after: int = 0) -> list[EngineEvent]:
        """Events with ``seq`` above ``after``, oldest first. Never waits for the loop: see the class docstring.

        The log is a ring of ``event_log_size``: a reader that fell further behind sees a gap in ``seq``.
        """
        with self._observed_lock:
            return [e for e in self._events if e.seq > after]

    def history(self, after_step: int = 0) -> list[StepSample]:
        """Per-step samples with ``step`` above ``after_step`` (a ring of ``history_size``), oldest first."""
        with self._observed_lock:
            return [s for s in self._history if s.step > after_step]

    def request_info(self, request_ids: list[int]) -> list[RequestInfo]:
        """Progress of the requests still known (running, waiting, or among the last ``keep_finished`` ended)."""
        with self._lock:
            known = (self._live.get(i) or self._ended.get(i) for i in request_ids)
            return [_info(req) for req in known if req is not None]

    def explain(
        self, request_ids: list[int], viewer_owns: Callable[[int | None], bool] | None = None
    ) -> list[Explanation]:
        """Why each prompt token of these requests was, or was not, served from the prefix cache at their first
        admission: one ``Explanation`` per request still known (as ``request_info``), every token with one cause
        (``astrai.explain``), the cached ones exactly the request's ``cached_tokens``. ``viewer_owns``: which storing
        requests the reader may see the tokens of (None: all; a page of someone else's is then never "diverged"
        nor "another namespace" to them, only "new").

        Built on the caller's thread from this tenant's own observation only: every event feeds its key history as
        it is emitted (``astrai.explain.LiveHistory``: none is lost, whatever the ring of ``event_log_size`` drops;
        at most ``explain_keys`` keys plus the pool's pages), read under a lock of its own, never ``_lock``. A
        request admitted in the step still running reads ``IN_PROGRESS`` until that step ends.
        """
        infos = self.request_info(request_ids)  # first: every admission these show was pushed before ...
        return self._explainer.explain(infos, self.steps, viewer_owns)  # ... the steps completed, read after them

    # ----- submission helpers ---------------------------------------------------------------------------
    def _make_request(self, index: int, ids: list[int], params: SamplingParams, salt: str | None) -> Request:
        total = len(ids) + params.max_tokens
        capacity = self.pool.n_pages * self.pool.page_size
        if total > self._engine.max_seq_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} that is "
                f"{total}, over max_seq_len={self._engine.max_seq_len}"
            )
        if total > capacity:
            raise ValueError(f"prompt {index} needs {total} tokens of KV but the whole pool holds {capacity}")
        generator = None
        if not params.greedy:
            seed = random.getrandbits(63) if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
            generator = torch.Generator(device=self._engine.device).manual_seed(seed)  # noise is drawn where logits are
        return Request(
            prompt_ids=ids, params=params, cache_salt=salt, generator=generator, page_offset=self.page_offset
        )

    def _check_alive(self) -> None:
        self._engine._check_engine()
        if self._closed:
            raise EngineClosedError("this tenant is closed")

    # ----- one step of this tenant, run by the engine loop --------------------------------------------
    def _finish_step(
        self, work: list[tuple[Request, int]], tokens: dict[Request, int]
    ) -> tuple[list[Delivery], list[tuple[int, int]]]:
        """Advance the computed KV, register full pages, append the sampled tokens; returns the stream items to
        deliver and the (request, token) pairs appended."""
        now = time.monotonic()
        outbox: list[Delivery] = []
        appended: list[tuple[int, int]] = []
        size = self.pool.page_size
        for req, count in work:
            for i in range(req.num_computed // size, (req.num_computed + count - 1) // size + 1):
                self.pool.touch(req.pages[i])  # its KV grew: the step history records its new tokens
            req.advance(count)
            self.cache.commit(req)
        self.cache.end_step()
        for req, token in tokens.items():
            if req.done:
                continue
            req.token_ids.append(token)
            appended.append((req.id, token))
            self._generated_tokens += 1
            req.first_token_at = req.first_token_at or now
            items, index, detok = self._outputs[req.id]
            delta = detok.push(token)
            if delta:
                outbox.append((items, (index, "delta", delta)))
            if token in self._engine.eos_ids or len(req.token_ids) - req.prompt_len >= req.params.max_tokens:
                tail = detok.flush()
                if tail:
                    outbox.append((items, (index, "delta", tail)))
                self._end(req, Status.FINISHED)
                outbox.append((items, (index, "done", None)))
        return outbox, appended

    def _counters(self) -> Counters:
        return self.pool.stats.evictions, self.scheduler.preemptions, self.cache.hit_tokens, self.cache.query_tokens

    def _record_step(
        self,
        work: list[tuple[Request, int]],
        decode: int,
        before: Counters,
        started: float,
        appended: list[tuple[int, int]],
    ) -> None:
        """Close the step: count it, and record what changed (deltas of the counters, tokens, changed pages).

        ``decode``: how many of the step's tokens were decodes, counted before the step ended any request (an ended
        request's progress is reset, so its last token looked like a prefill). Changes made between steps (a
        cancel, a ``clear()``) are recorded with the next step.
        """
        self.steps += 1
        self._end_unrecorded = False
        evictions, preemptions, hits, queries = (now - then for now, then in zip(self._counters(), before, strict=True))
        sample_ = StepSample(
            step=self.steps,
            time=time.time(),
            duration_s=time.perf_counter() - started,
            free_pages=self.pool.free_pages,
            used_pages=self.pool.used_pages,
            cached_pages=self.pool.cached_pages,
            prefill_tokens=sum(count for _, count in work) - decode,
            decode_tokens=decode,
            hit_tokens=hits,
            query_tokens=queries,
            evictions=evictions,
            preemptions=preemptions,
            requests=tuple(req.id for req, _ in work),
            admitted=tuple(self.scheduler.take_admitted()),
            sampled=tuple(appended),
            page_changes=tuple(self._page_records(self.pool.take_touched())),
            tier_pages=None if self.cache.tier is None else self.cache.tier.held_pages,
        )
        with self._observed_lock:
            self._history.append(sample_)

    def _apply_cancels(self) -> list[Delivery]:
        """End the cancelled requests; a stream still being read (cancelled by another thread) ends for them."""
        outbox: list[Delivery] = []
        for rid in self._cancelled:
            req, output = self._live.get(rid), self._outputs.get(rid)
            if req is not None:
                self._end(req, Status.CANCELLED)
            if output is not None:
                items, index, _ = output
                outbox.append((items, (index, "done", None)))
        self._cancelled.clear()
        return outbox

    def _end(self, req: Request, status: Status) -> None:
        self.scheduler.remove(req)
        req.status = status
        req.finished_at = time.monotonic()
        req.ended_step = self.steps + 1  # the step in progress (or, between steps, the next): its sample records it
        self._end_unrecorded = True
        self._outputs.pop(req.id, None)
        self._live.pop(req.id, None)
        self._ended[req.id] = req
        while len(self._ended) > self._keep_finished:
            self._ended.popitem(last=False)
        self._ended_counts[status] += 1
        self._emit(RequestFinished, request=req.id, status=status.value)

    def _fail(self, requests: list[Request], error: Exception) -> list[Delivery]:
        outbox: list[Delivery] = []
        for req in requests:
            if req.done:
                continue
            output = self._outputs.get(req.id)
            req.error = error
            self._end(req, Status.FAILED)
            if output is not None:
                items, index, _ = output
                outbox.append((items, (index, "error", error)))
        return outbox

    def _emit(self, event: type[EngineEvent], **fields: Any) -> None:
        """Stamp and log one event, and feed it to the explainer (called under ``_lock`` by the loop, the pool and
        the scheduler: one at a time, in ``seq`` order)."""
        with self._observed_lock:
            self._event_seq += 1
            stamped = event(seq=self._event_seq, step=self.steps + 1, time=time.time(), **fields)
            self._events.append(stamped)
        self._explainer.push(stamped)

    def _fail_step(self, requests: list[Request], exc: Exception, before: Counters) -> list[Delivery]:
        """Fail ``requests`` for a step that raised, and record the step."""
        self.cache.end_step()
        outbox = self._fail(requests, RequestFailedError(f"the step computing this request failed: {exc!r}"))
        self._record_step([], 0, before, time.perf_counter(), [])
        return outbox

    def _has_business(self) -> bool:
        """Something for the loop to do: a request to run, a cancel to apply, or a change to record."""
        return bool(self._cancelled or self.scheduler.has_work() or self.pool.touched)


class InferenceEngine(Tenant):
    """A paged-KV, prefix-caching, continuously batching engine over a transformers causal LM.

    It runs on one device (``device``: CUDA where available, else the CPU; ``astrai/device.py``): the model's weights,
    the KV tensors, each step's metadata and the sampling live there, and the sampled tokens come back to the host
    once per step. The CPU-only speed-ups (``packed_weights``, ``attention_kernel``, OpenMP pool releases) are on by
    default on the CPU and off elsewhere; so is ``compile`` (below), which a CUDA engine takes only when asked.

    A model already serving another engine is shared, not loaded or prepared again: each engine has its own pool,
    scheduler and KV tensors, and they take turns at the model's forward; the options that prepare the model
    (``dtype``, ``device``, ``packed_weights``, ``attention_kernel``, ``compile``) must then equal the first engine's,
    or the constructor raises ``ValueError``. The last engine on the model to shut down hands it back as it came.

    ``eviction`` picks which cached page a full pool gives up first: a name of ``astrai.eviction.POLICIES`` ("lru",
    the default, "fifo", "lfu" or "arc"); another raises ``ValueError``.

    **A second KV tier** (``offload_pages`` > 0; ``astrai.tier``): full pages live on in ``offload_pages`` slots of a
    larger, slower store, ``offload_to``: ``"memory"`` (host memory; pinned on CUDA) or, with the KV on the CPU, a
    folder on local disk (one preallocated file, read and written in runs of pages straight to and from the pool's
    KV: a load is real I/O). ``offload_policy``: ``"through"`` writes every page the pool stores, ``"on_evict"``
    writes a page as the pool evicts it and drops it once loaded back; the tier evicts its own pages least recently
    used first. A lookup continues its chain into the tier where the pool's hits end; those pages are loaded into
    pool pages before the forward that reads them, and count as hits (``CacheStats.second_tier``). Only with
    prefix caching; a tenant gets a tier of its own from ``add_tenant``'s options of the same names. A store that
    cannot be made (a folder that is not one, or cannot be written, a disk too small for it; a folder for a GPU's KV)
    raises ``ValueError`` here; a store that fails later switches the tier off with a warning, and no request fails.

    ``compile`` (the default on the CPU) serves the model compiled by ``torch.compile``, loaded from the on-disk
    cache when this machine compiled that model before (seconds), else compiled now (a minute or so on 2 cores) and
    cached (``compiled_forward.py``); where it cannot be compiled (no C++ compiler), the engine logs a warning and
    serves eager. ``progress``, if given, is called with a line of text as a slow start goes (a cold compile), on the
    constructor's thread. ``background_compile`` (the CPU only; e.g. ``precompile.in_child``) makes the start fast
    instead: the engine serves eager at once while a thread builds the compiled forward with it, then switches to it
    between two steps (``CacheStats.forward`` says which serves; ``model_runner.PreparedModel.compile``).

    **Tenants.** The engine's own pool is its default tenant (this object *is* a ``Tenant``); ``add_tenant`` adds
    more, each with a page quota carved out of ``tenant_pages`` (the KV tensors hold ``n_pages + tenant_pages``
    pages), its own prefix index, eviction order, batch limit, preemptions and observation. Every step concatenates
    every tenant's scheduled tokens into one forward; ``max_batched_tokens`` is shared, the tenant that schedules
    first rotating each step. ``forwards`` counts those shared steps; ``steps`` (each tenant's own) counts the steps
    a tenant took part in.

    Threads and locks (who owns what):

    * The **loop thread** (``astrai-engine``) is the only writer of every tenant's scheduler, cache manager and page
      pool, the requests' progress and the model runner (with this engine's KV tensors). It mutates them under ``_lock``
      and runs the forward *outside* it, reading only what no other thread writes (the scheduled requests' tokens
      and page tables).
    * The **model** is prepared once per model object and shared by every engine on it (``PreparedModel`` in
      ``model_runner.py``): read-only while served, its forwards serialised by its ``SharedForwards`` lock, held
      for one model call, never together with ``_lock``. While several engines on it are busy, their forwards run on
      its one model thread (one OpenMP pool, ``model_thread.py``); otherwise an engine forwards on its loop thread.
      Engines on one model wait for each other there only.
    * **Caller threads** (``generate``, ``cancel``, ``clear``, the readers) take ``_lock`` (one for every tenant) for
      a short critical section: submit appends to the waiting queue, ``cancel`` records ids that the loop applies
      at its next step, ``clear`` unindexes cached pages. ``_work_arrived`` (a Condition on ``_lock``) wakes the
      idle loop.
    * **Observations** (events and the per-step history) sit behind each tenant's own ``_observed_lock``, taken after
      ``_lock`` (never the other way round) and held only to append or copy. ``events()`` and ``history()`` never
      wait for a schedule or a forward.
    * The **explainer's key history** (``astrai.explain.LiveHistory``, one per tenant) gets each event from
      ``_emit`` as it is stamped (``push`` only tries its lock, never waits) and is read by ``explain`` under that
      lock, taken with no engine lock held.
    * No user code runs under either lock: text deltas and errors are put on the consumers' queues after
      ``_lock`` is released, and only by the loop thread, so each stream sees its items in order.
    * ``shutdown()`` only flags the loop and waits; the loop itself fails what is left, drops its KV tensors and
      releases its share of the model (the last engine on it hands the model back), so a forward that is still
      running never sees its pages freed or its model changed.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        page_size: int = 16,
        n_pages: int | None = None,
        memory_budget_mb: float | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        max_batched_tokens: int = 512,
        tenant_pages: int = 0,
        prefix_caching: bool = True,
        eviction: str = "lru",
        dtype: str = "float32",
        device: str | torch.device | None = None,
        packed_weights: bool | None = None,
        attention_kernel: bool | None = None,
        compile: bool | None = None,
        progress: Callable[[str], None] | None = None,
        background_compile: BackgroundCompile | None = None,
        event_log_size: int = 4096,
        history_size: int = 4096,
        keep_finished: int = 512,
        explain_keys: int = 16384,
        offload_pages: int = 0,
        offload_to: str | os.PathLike[str] = "memory",
        offload_policy: str = "through",
    ):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
        for name, value in (
            ("page_size", page_size),
            ("max_batch_size", max_batch_size),
            ("max_batched_tokens", max_batched_tokens),
            ("event_log_size", event_log_size),
            ("history_size", history_size),
            ("keep_finished", keep_finished),
            ("explain_keys", explain_keys),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        if compile is not None and not isinstance(compile, bool):
            raise ValueError(f"compile must be True, False or None (where it applies), got {compile!r}")
        torch_dtype = SUPPORTED_DTYPES[dtype]
        self.device = resolve_device(device)
        preparation = Preparation.resolve(torch_dtype, self.device, packed_weights, attention_kernel, compile)
        if n_pages is None:
            budget = (memory_budget_mb or 256) * 2**20
            n_pages = int(budget // (page_size * kv_bytes_per_token(model.config, torch_dtype)))
        if not isinstance(n_pages, int) or n_pages < 1:
            raise ValueError(f"n_pages must be an integer >= 1, got {n_pages!r}")
        if isinstance(tenant_pages, bool) or not isinstance(tenant_pages, int) or tenant_pages < 0:
            raise ValueError(f"tenant_pages must be an integer >= 0, got {tenant_pages!r}")
        _check_tier_options(offload_pages, offload_to, offload_policy, prefix_caching, self.device)
        model_limit = getattr(model.config, "max_position_embeddings", None) or n_pages * page_size
        self.max_seq_len = min(max_seq_len or model_limit, model_limit)
        self.tokenizer: PreTrainedTokenizerBase = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)

        # every tenant's state: schedulers, caches, pools, requests, outputs
        self._lock: threading.RLock = threading.RLock()
        self._work_arrived = threading.Condition(self._lock)  # notified on submit, cancel, clear, close and shutdown
        self._shutting_down = False
        self._loop_error: BaseException | None = None
        self.max_batched_tokens: int = max_batched_tokens  # per step, shared by every tenant
        self._observation_sizes = (event_log_size, history_size, keep_finished, explain_keys)
        self._reserve = PageRanges(n_pages, tenant_pages)  # the KV pages tenants' quotas are carved from
        self._tenants: list[Tenant] = [self]  # the default first; the one that schedules first rotates
        self._turn = 0
        self.forwards = 0  # shared steps: one model forward each, every tenant's tokens in it
        self._in_flight: set[Tenant] = set()  # tenants with work in the step now running (see ``Tenant.close``)

        super().__init__(
            self, n_pages, page_size, 0, max_batch_size, prefix_caching, eviction, *self._observation_sizes
        )
        self._page_bytes = page_size * kv_bytes_per_token(model.config, torch_dtype)  # a second tier's page
        store: TierStore | None = None
        if offload_pages:  # before the model is touched: a store that cannot be made leaves it as it was
            store = self._open_tier_store(offload_to, offload_pages, n_pages)
        try:
            self.runner = ModelRunner(
                model, n_pages + tenant_pages, page_size, preparation, progress, background_compile
            )
        except BaseException:
            if store is not None:
                store.close()
            raise
        if store is not None:
            self._attach_tier(store, offload_policy)
        self._release_pool()  # this thread prepared the model; its idle OpenMP workers would slow the loop's
        self._thread = threading.Thread(target=self._loop, name="astrai-engine", daemon=True)
        self._thread.start()
        _running_engines.add(self)

    # ----- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, name_or_path: str, dtype: str = "float32", device: str | torch.device | None = None, **options: Any
    ) -> InferenceEngine:
        """Load a safetensors checkpoint with transformers (never pickle, never remote code).

        The device is checked before anything loads; the fresh model is then moved there whole, so no host copy of
        its weights outlives the load (an engine keeps the originals of a model it had to move, to hand it back).
        """
        target = resolve_device(device)
        model, tokenizer = load_checkpoint(name_or_path, dtype)
        # transformers decorates ``to`` with ``functools.wraps(nn.Module.to)``, which the stubs type as the unbound
        # function (the model as its first argument): it is a method, moving the model in place and returning it
        move = cast(Callable[[torch.device], PreTrainedModel], model.to)
        return cls(move(target), tokenizer, dtype=dtype, device=target, **options)

    def _release_pool(self) -> None:
        """Free the calling thread's idle OpenMP workers (``openmp.py``), where the engine computes on them."""
        if uses_openmp(self.device):
            release_pool()

    # ----- tenants --------------------------------------------------------------------------------------
    def add_tenant(
        self,
        n_pages: int,
        *,
        max_batch_size: int = 8,
        prefix_caching: bool = True,
        eviction: str = "lru",
        event_log_size: int | None = None,
        history_size: int | None = None,
        keep_finished: int | None = None,
        explain_keys: int | None = None,
        offload_pages: int = 0,
        offload_to: str | os.PathLike[str] = "memory",
        offload_policy: str = "through",
    ) -> Tenant:
        """A pool of ``n_pages`` of its own, carved out of the ``tenant_pages`` reserve, served in this engine's
        forwards; see ``Tenant``. The observation bounds (``event_log_size``, ``history_size``, ``keep_finished``,
        ``explain_keys``) are the engine's unless given: a host of many small pools gives each bounds its size (their
        records, not their KV, are what a tenant's memory is). ``offload_pages``, ``offload_to`` and
        ``offload_policy`` give it a second tier of its own, as the engine's own (see the class docstring): a store
        of its own, bound to the tenant's pages of the KV, closed (its file deleted) with the tenant. Raises
        ``TenantReserveFull`` when no free range of the reserve is that large, ``ValueError`` on bad settings (a
        store that cannot be made included)."""
        for name, value in (("n_pages", n_pages), ("max_batch_size", max_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        _check_tier_options(offload_pages, offload_to, offload_policy, prefix_caching, self.device)
        given = {
            "event_log_size": event_log_size,
            "history_size": history_size,
            "keep_finished": keep_finished,
            "explain_keys": explain_keys,
        }
        sizes = list(self._observation_sizes)
        for i, (name, size) in enumerate(given.items()):
            if size is None:
                continue
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
            sizes[i] = size
        events, history, keep, keys = sizes
        # the store before the lock: a file's preallocation is I/O
        store = self._open_tier_store(offload_to, offload_pages, n_pages) if offload_pages else None
        try:
            with self._lock:
                self._check_engine()
                offset = self._reserve.take(n_pages)
                try:
                    tenant = Tenant(
                        self, n_pages, self.pool.page_size, offset, max_batch_size, prefix_caching, eviction,
                        events, history, keep, keys,
                    )  # fmt: skip
                    if store is not None:
                        tenant._attach_tier(store, offload_policy)
                except BaseException:
                    self._reserve.release(offset, n_pages)
                    raise
                self._tenants.append(tenant)
                return tenant
        except BaseException:
            if store is not None:
                store.close()
            raise

    def _open_tier_store(self, where: str | os.PathLike[str], slots: int, pool_pages: int) -> TierStore:
        """A second tier's store of ``slots`` pages of this engine's KV (pinned host memory for a CUDA engine's), for
        a pool of ``pool_pages``. A warning where it holds fewer pages than the longest request can fill."""
        store = open_store(where, slots, self._page_bytes, pinned=self.device.type == "cuda")
        longest = min(-(-self.max_seq_len // self.pool.page_size), pool_pages)
        if slots < longest:
            log.warning(
                "astrai: a second tier holds %d pages, fewer than the longest request its pool can hold fills (%d): "
                "a long prompt's first pages are evicted from it by its last",
                slots, longest,
            )  # fmt: skip
        return store

    @property
    def tenants(self) -> list[Tenant]:
        """The tenants added and not closed yet (the engine's own pool is not among them)."""
        with self._lock:
            return self._tenants[1:]

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the loop; unfinished requests get an ``EngineClosedError``.

        The loop, not this call, fails the requests and releases the model once any running forward has returned;
        the last engine sharing the model hands it back as it came. Returns True when that is done within
        ``timeout``; False when a forward is still running (consumers are told at once anyway: their streams see
        the engine closed within ``POLL_SECONDS``).
        """
        with self._lock:
            self._shutting_down = True
            self._work_arrived.notify_all()
        _running_engines.discard(self)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("astrai shutdown: a step is still running; the loop will clean up when it returns")
            return False
        return True

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _check_engine(self) -> None:
        if self._loop_error is not None:
            raise EngineClosedError(f"the engine loop died: {self._loop_error!r}")
        if self._shutting_down:
            raise EngineClosedError("the engine is shut down")

    # ----- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        closing: Exception = EngineClosedError("the engine was shut down before this request finished")
        try:
            while True:
                with self._lock:
                    while not (self._shutting_down or any(t._has_business() for t in self._tenants)):
                        self._release_pool()  # idle: free the OpenMP workers, which would slow other engines' steps
                        self._work_arrived.wait()
                    if self._shutting_down:
                        return
                    outbox = [item for tenant in self._tenants for item in tenant._apply_cancels()]
                _deliver(outbox)
                self._step()
        except BaseException as exc:  # a bug in the loop itself: make every waiter see it
            log.exception("astrai engine loop died")
            self._loop_error = exc
            closing = EngineClosedError(f"the engine loop died: {exc!r}")
        finally:  # the loop, not shutdown(): no forward is running now, so pages and the model are safe to touch
            with self._lock:
                outbox = [
                    item
                    for t in self._tenants
                    for item in t._fail([*t.scheduler.running, *t.scheduler.waiting], closing)
                ]
                for tenant in self._tenants:  # under the lock: a tenant's ``close`` closes its tier too
                    if tenant.cache.tier is not None:
                        tenant.cache.tier.close()  # its file, if any, is deleted
            _deliver(outbox)
            self.runner.release()  # the last engine on the model restores it

    def _step(self) -> None:
        """Schedule every tenant, run one forward over all their tokens, sample, and stream each tenant's part.

        A scheduling failure fails only that tenant's requests; a failed forward fails only this step's requests.
        A tenant takes part in a step (it records a sample, with a step number of its own) when it computed tokens,
        or a cancel, a ``clear()`` or an end changed its pool or its requests since its last step. The tenants with
        work are ``_in_flight`` until the step is recorded: ``close()`` waits for that before it frees their pages.
        """
        started = time.perf_counter()
        plans: list[tuple[Tenant, list[tuple[Request, int]], Counters]] = []
        outbox: list[Delivery] = []
        with self._lock:
            budget = self.max_batched_tokens
            for tenant in self._rotation():
                before = tenant._counters()
                try:
                    work = tenant.scheduler.schedule(budget)
                except Exception as exc:  # no trustworthy bookkeeping is left: fail everything it was juggling
                    log.exception("astrai scheduling failed")
                    outbox += tenant._fail_step([*tenant.scheduler.running, *tenant.scheduler.waiting], exc, before)
                    continue
                budget -= sum(count for _, count in work)
                plans.append((tenant, work, before))
            self._in_flight = {tenant for tenant, part, _ in plans if part}
        work = [item for _, part, _ in plans for item in part]
        try:
            if work:
                outbox += self._forward(plans, work, started)
            else:
                with self._lock:
                    recorded = bool(outbox)
                    for tenant, _, before in plans:
                        if tenant.pool.touched or tenant._end_unrecorded:  # a cancel, clear() or end between steps
                            tenant._record_step([], 0, before, started, [])
                            recorded = True
                    if not recorded:
                        self._work_arrived.wait(0.01)
        finally:
            with self._lock:
                self._in_flight = set()
                self._work_arrived.notify_all()  # a close() waiting for this step
        _deliver(outbox)

    def _forward(
        self,
        plans: list[tuple[Tenant, list[tuple[Request, int]], Counters]],
        work: list[tuple[Request, int]],
        started: float,
    ) -> list[Delivery]:
        """The shared forward over every tenant's ``work``, then each tenant's part of the step; the stream items."""
        outbox: list[Delivery] = []
        try:
            # before the step ends any request (an ended request's progress is reset)
            decodes = [sum(req.decoded(count) for req, count in part) for _, part, _ in plans]
            sampled = [req for req, count in work if req.num_computed + count == len(req.token_ids)]
            logits = self.runner.step(work)
            tokens = sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
            by_request = dict(zip(sampled, tokens, strict=True))
            with self._lock:
                self.forwards += 1
                for (tenant, part, before), decode in zip(plans, decodes, strict=True):
                    if part or tenant.pool.touched or tenant._end_unrecorded:
                        delivered, appended = tenant._finish_step(
                            part, {r: by_request[r] for r, _ in part if r in by_request}
                        )
                        tenant._record_step(part, decode, before, started, appended)
                        outbox += delivered
        except Exception as exc:
            log.exception("astrai step failed")
            with self._lock:
                for tenant, part, before in plans:
                    if part or tenant.pool.touched or tenant._end_unrecorded:
                        outbox += tenant._fail_step([req for req, _ in part], exc, before)
        return outbox

    def _rotation(self) -> list[Tenant]:
        """The tenants in this step's scheduling order (a closed one, waiting for its last step to end, is left out):
        who goes first (and so meets the shared token budget whole) moves one place each step."""
        self._turn = (self._turn + 1) % len(self._tenants)
        return [t for t in self._tenants[self._turn :] + self._tenants[: self._turn] if not t._closed]


class PageRanges:
    """The tenant reserve: KV pages ``start``..``start + size - 1`` of the engine's tensors, handed out as ranges.

    First fit over the free ranges, kept sorted and merged with their neighbours on release, so a closed tenant's
    pages are whole again for a larger tenant once its neighbours are gone too.
    """

    def __init__(self, start: int, size: int):
        self._free: list[tuple[int, int]] = [(start, size)] if size else []  # (first page, pages), by first page
        self.size = size

    @property
    def free_pages(self) -> int:
        return sum(n for _, n in self._free)

    def take(self, n: int) -> int:
        """The first page of a free range of ``n`` pages, now taken; ``TenantReserveFull`` where none is left."""
        for i, (first, size) in enumerate(self._free):
            if size >= n:
                self._free[i : i + 1] = [(first + n, size - n)] if size > n else []
                return first
        raise TenantReserveFull(
            f"no {n} free pages in the engine's tenant reserve ({self.free_pages} of {self.size} free, the largest "
            f"range {max((s for _, s in self._free), default=0)}): close a tenant, or give the engine more "
            "tenant_pages"
        )

    def release(self, first: int, n: int) -> None:
        """Give back the range ``take`` returned."""
        bisect.insort(self._free, (first, n))
        merged: list[tuple[int, int]] = []
        for start, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged


def _validate_prompts(prompts: object) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str or a list of str, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is an empty list; give at least one prompt")
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise TypeError(f"prompt {i} must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"prompt {i} is empty or only whitespace")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt {i} is not valid UTF-8 text ({exc.reason} at {exc.start})") from None
    return list(prompts)


def _deliver(outbox: list[Delivery]) -> None:
    """Put stream items on their consumers' queues; called with no lock held."""
    for items, item in outbox:
        items.put(item)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _info(req: Request) -> RequestInfo:
    end = req.finished_at or time.monotonic()
    generated = len(req.output_ids)
    decode_time = end - req.first_token_at if req.first_token_at else 0.0
    return RequestInfo(
        id=req.id,
        status=req.status.value,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.cached_tokens,
        generated_tokens=generated,
        preemptions=req.preemptions,
        recomputed_tokens=req.recomputed_tokens,
        ended_step=req.ended_step,
        prompt_ids=tuple(req.prompt_ids),
        output_ids=tuple(req.output_ids),
        ttft=(req.first_token_at - req.submitted_at) if req.first_token_at else None,
        tokens_per_s=(generated - 1) / decode_time if generated > 1 and decode_time > 0 else None,
        error=str(req.error) if req.error else None,
    )
