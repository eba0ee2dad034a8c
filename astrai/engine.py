"""InferenceEngine: the public API, and the background loop that schedules, runs and streams every step."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from astrai.detokenizer import IncrementalDetokenizer
from astrai.kv_cache_manager import KVCacheManager
from astrai.model_runner import SUPPORTED_DTYPES, ModelRunner, check_supported, kv_bytes_per_token
from astrai.page_pool import PagePool
from astrai.request import Request, Status
from astrai.sampling import MAX_SEED, SamplingParams, sample
from astrai.scheduler import Scheduler
from astrai.streams import GenerationStream

log = logging.getLogger("astrai")

KEEP_FINISHED = 512  # finished requests kept for request_info()


class EngineClosedError(RuntimeError):
    """The engine was shut down (or its loop died) before the request could finish."""


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded: missing, unsupported, pickle-only, or asking for remote code."""


class RequestFailedError(RuntimeError):
    """A step that computed this request raised; the message names the cause."""


class InferenceEngine:
    """A paged-KV, prefix-caching, continuously batching engine over a transformers causal LM."""

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
        prefix_caching: bool = True,
        dtype: str = "float32",
        packed_weights: bool = True,
        event_log_size: int = 4096,
        on_event: Callable[[dict], None] | None = None,
    ):
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
        for name, value in (
            ("page_size", page_size),
            ("max_batch_size", max_batch_size),
            ("max_batched_tokens", max_batched_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, flag in (("prefix_caching", prefix_caching), ("packed_weights", packed_weights)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        torch_dtype = SUPPORTED_DTYPES[dtype]
        if n_pages is None:
            budget = (memory_budget_mb or 256) * 2**20
            n_pages = int(budget // (page_size * kv_bytes_per_token(model.config, torch_dtype)))
        if not isinstance(n_pages, int) or n_pages < 1:
            raise ValueError(f"n_pages must be an integer >= 1, got {n_pages!r}")
        model_limit = getattr(model.config, "max_position_embeddings", None) or n_pages * page_size
        self.max_seq_len = min(max_seq_len or model_limit, model_limit)
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)

        self._events: deque[dict] = deque(maxlen=event_log_size)
        self._event_seq = 0
        self._on_event = on_event
        self.pool = PagePool(n_pages, page_size, on_event=self._emit)
        self.cache = KVCacheManager(self.pool, prefix_caching)
        self.scheduler = Scheduler(self.cache, max_batch_size, max_batched_tokens, self._emit)
        self.runner = ModelRunner(model, n_pages, page_size, torch_dtype, packed_weights)

        self._lock = threading.Condition(threading.RLock())
        self._cancelled: set[int] = set()
        self._outputs: dict[int, tuple[queue.SimpleQueue, int, IncrementalDetokenizer]] = {}
        self._requests: OrderedDict[int, Request] = OrderedDict()
        self._closed = False
        self._loop_error: BaseException | None = None
        self.steps = 0
        # (tokens computed, requests, seconds) of recent steps: forward plus sampling, for benchmarks and the UI
        self.step_log: deque[tuple[int, int, float]] = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._loop, name="astrai-engine", daemon=True)
        self._thread.start()

    # ----- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", **options: Any) -> InferenceEngine:
        """Load a safetensors checkpoint with transformers (never pickle, never remote code)."""
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(SUPPORTED_DTYPES)}, got {dtype!r}")
        try:
            config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
            check_supported(config)
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path,
                config=config,
                use_safetensors=True,
                trust_remote_code=False,
                dtype=SUPPORTED_DTYPES[dtype],
            )
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"cannot load {name_or_path!r}: {exc}") from exc
        return cls(model, tokenizer, dtype=dtype, **options)

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
        cache_salt: str | None = None,
    ) -> str | list[str] | GenerationStream:
        """Generate continuations. A single prompt gives a str (or a stream of str deltas); a list gives a list
        (or a stream of ``(index, delta)``). Requests are registered now, not when the stream is first read."""
        texts = self._validate_prompts(prompts)
        token_ids = [list(self.tokenizer(text)["input_ids"]) for text in texts]
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return self._submit(token_ids, params, cache_salt, stream, single=isinstance(prompts, str))

    def generate_ids(
        self, token_ids: list[list[int]], *, stream: bool = False, cache_salt: str | None = None, **sampling: Any
    ) -> list[str] | GenerationStream:
        """Like ``generate`` for already tokenized prompts (used as given: no BOS is added)."""
        if not isinstance(token_ids, list) or not token_ids:
            raise ValueError("token_ids must be a non-empty list of token id lists")
        vocab = len(self.tokenizer)
        for i, ids in enumerate(token_ids):
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt {i} must be a non-empty list of token ids in [0, {vocab})")
        return self._submit([list(ids) for ids in token_ids], SamplingParams(**sampling), cache_salt, stream)

    def _submit(
        self, token_ids: list[list[int]], params: SamplingParams, salt: str | None, stream: bool, single: bool = False
    ) -> str | list[str] | GenerationStream:
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(salt).__name__}")
        requests = [self._make_request(i, ids, params, salt) for i, ids in enumerate(token_ids)]
        items: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._check_alive()
            for index, req in enumerate(requests):
                self._outputs[req.id] = (items, index, IncrementalDetokenizer(self.tokenizer))
                self._remember(req)
                self.scheduler.add(req)
            self._lock.notify_all()
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
            self._lock.notify_all()

    def clear(self) -> int:
        """Empty the prefix cache (cached pages become free). Safe while requests run. Returns pages freed."""
        with self._lock:
            freed = self.cache.clear()
            self._emit("cache_cleared", {"pages": freed})
            return freed

    def cache_stats(self) -> dict[str, Any]:
        with self._lock:
            pool, cache = self.pool, self.cache
            hit_rate, recent = cache.hit_rates()
            return dict(
                n_pages=pool.n_pages,
                page_size=pool.page_size,
                free_pages=pool.free_pages,
                used_pages=pool.used_pages,
                cached_pages=pool.cached_pages,
                query_tokens=cache.query_tokens,
                hit_tokens=cache.hit_tokens,
                hit_rate=hit_rate,
                recent_hit_rate=recent,
                evictions=pool.stats.evictions,
                stored_pages=pool.stats.stored,
                preemptions=self.scheduler.preemptions,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                steps=self.steps,
                prefix_caching=cache.prefix_caching,
            )

    def cache_snapshot(self) -> list[dict[str, Any]]:
        """One record per page: state, ref count, LRU rank, owning requests, chain position and token ids."""
        with self._lock:
            pool, size = self.pool, self.pool.page_size
            ranks = pool.lru_rank()
            owners: dict[int, list[int]] = {}
            seen: dict[int, tuple[Request, int]] = {}
            for req in self.scheduler.running:
                for i, page in enumerate(req.pages):
                    owners.setdefault(page, []).append(req.id)
                    seen.setdefault(page, (req, i))
            records = []
            for page in range(pool.n_pages):
                tokens, pos = pool.tokens[page], pool.chain_pos[page]
                if tokens is None and page in seen:
                    req, pos = seen[page]
                    tokens = tuple(req.token_ids[pos * size : min((pos + 1) * size, req.num_computed)])
                records.append(
                    dict(
                        page=page,
                        state=pool.state(page).value,
                        ref_count=pool.ref_count[page],
                        lru_rank=ranks.get(page),
                        requests=owners.get(page, []),
                        chain_pos=pos,
                        tokens=list(tokens or ()),
                        indexed=pool.key[page] is not None,
                    )
                )
            return records

    def events(self, after: int = 0) -> list[dict]:
        """Events with a sequence number above ``after`` (page_stored, page_evicted, request_admitted, ...)."""
        with self._lock:
            return [e for e in self._events if e["seq"] > after]

    def request_info(self, request_ids: list[int]) -> list[dict[str, Any]]:
        """Per-request progress for dashboards: status, prompt/cached/generated tokens, TTFT and tokens/s."""
        with self._lock:
            return [_info(self._requests[i]) for i in request_ids if i in self._requests]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop, which hands the model back as it came; unfinished requests get an EngineClosedError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._thread.join(timeout)
        with self._lock:
            self._fail(
                list(self.scheduler.running) + list(self.scheduler.waiting),
                EngineClosedError("the engine was shut down before this request finished"),
            )

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- submission helpers ---------------------------------------------------------------------------
    def _validate_prompts(self, prompts: object) -> list[str]:
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

    def _make_request(self, index: int, ids: list[int], params: SamplingParams, salt: str | None) -> Request:
        total = len(ids) + params.max_tokens
        capacity = self.pool.n_pages * self.pool.page_size
        if total > self.max_seq_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; with max_tokens={params.max_tokens} that is "
                f"{total}, over max_seq_len={self.max_seq_len}"
            )
        if total > capacity:
            raise ValueError(f"prompt {index} needs {total} tokens of KV but the whole pool holds {capacity}")
        generator = None
        if not params.greedy:
            seed = random.getrandbits(63) if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
            generator = torch.Generator().manual_seed(seed)
        return Request(prompt_ids=ids, params=params, cache_salt=salt, generator=generator)

    def _remember(self, req: Request) -> None:
        self._requests[req.id] = req
        while len(self._requests) > KEEP_FINISHED and next(iter(self._requests.values())).done:
            self._requests.popitem(last=False)

    def _check_alive(self) -> None:
        if self._loop_error is not None:
            raise EngineClosedError(f"the engine loop died: {self._loop_error!r}")
        if self._closed:
            raise EngineClosedError("the engine is shut down")

    # ----- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._cancelled and not self.scheduler.has_work():
                        self._lock.wait()
                    if self._closed:
                        return
                    self._apply_cancels()
                self._step()
        except BaseException as exc:  # a bug in the loop itself: make every waiter see it
            log.exception("astrai engine loop died")
            self._loop_error = exc
            with self._lock:
                self._fail(
                    list(self.scheduler.running) + list(self.scheduler.waiting),
                    EngineClosedError(f"the engine loop died: {exc!r}"),
                )
        finally:  # here, not in shutdown(): a step still running must never see its model change under it
            self.runner.restore()

    def _step(self) -> None:
        """Schedule, run the model, sample, and stream. A failure fails only this step's requests."""
        work: list[tuple[Request, int]] = []
        try:
            with self._lock:
                work = self.scheduler.schedule()
            if not work:
                with self._lock:
                    self._lock.wait(0.01)
                return
            started = time.perf_counter()
            logits = self.runner.step(work)
            sampled = [req for req, count in work if req.num_computed + count == len(req.token_ids)]
            tokens = sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
            with self._lock:
                self.steps += 1
                self.step_log.append((sum(c for _, c in work), len(work), time.perf_counter() - started))
                self._finish_step(work, dict(zip(sampled, tokens, strict=True)))
        except Exception as exc:
            log.exception("astrai step failed")
            with self._lock:
                self.cache.end_step()
                # a scheduling failure leaves no trustworthy bookkeeping: fail everything it was juggling
                victims = [req for req, _ in work] or [*self.scheduler.running, *self.scheduler.waiting]
                self._fail(victims, RequestFailedError(f"the step computing this request failed: {exc!r}"))

    def _finish_step(self, work: list[tuple[Request, int]], tokens: dict[Request, int]) -> None:
        now = time.monotonic()
        for req, count in work:
            req.num_computed += count
            self.cache.commit(req)
        self.cache.end_step()
        for req, token in tokens.items():
            if req.done:
                continue
            req.token_ids.append(token)
            req.first_token_at = req.first_token_at or now
            items, index, detok = self._outputs[req.id]
            delta = detok.push(token)
            if delta:
                items.put((index, "delta", delta))
            if token in self.eos_ids or len(req.output_ids) >= req.params.max_tokens:
                tail = detok.flush()
                if tail:
                    items.put((index, "delta", tail))
                self._end(req, Status.FINISHED)
                items.put((index, "done", None))

    def _apply_cancels(self) -> None:
        for rid in self._cancelled:
            req = self._requests.get(rid)
            if req is not None and not req.done:
                self._end(req, Status.CANCELLED)
        self._cancelled.clear()

    def _end(self, req: Request, status: Status) -> None:
        self.scheduler.remove(req)
        req.status = status
        req.finished_at = time.monotonic()
        self._outputs.pop(req.id, None)
        self._emit(f"request_{status.value}", {"request": req.id})

    def _fail(self, requests: list[Request], error: Exception) -> None:
        for req in requests:
            if req.done:
                continue
            output = self._outputs.get(req.id)
            req.error = error
            self._end(req, Status.FAILED)
            if output is not None:
                items, index, _ = output
                items.put((index, "error", error))

    def _emit(self, kind: str, data: dict) -> None:
        self._event_seq += 1
        event = {"seq": self._event_seq, "time": time.time(), "kind": kind, **data}
        self._events.append(event)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("astrai on_event hook raised; ignored")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _info(req: Request) -> dict[str, Any]:
    end = req.finished_at or time.monotonic()
    generated = len(req.output_ids)
    decode_time = end - req.first_token_at if req.first_token_at else 0.0
    return dict(
        id=req.id,
        status=req.status.value,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.cached_tokens,
        generated_tokens=generated,
        preemptions=req.preemptions,
        prompt_ids=list(req.prompt_ids),
        output_ids=req.output_ids,
        ttft=(req.first_token_at - req.submitted_at) if req.first_token_at else None,
        tokens_per_s=(generated - 1) / decode_time if generated > 1 and decode_time > 0 else None,
        error=str(req.error) if req.error else None,
    )
