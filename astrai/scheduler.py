"""Continuous batching: which requests compute how many tokens in the next step.

Every step advances every running request that fits the token budget, whatever its position: decodes first
(one token each, so they stay smooth), then prefill chunks. Waiting requests are admitted in arrival order
while pages, batch slots and budget allow. When a running request needs a page and none can be freed or
evicted, the newest running request is preempted by recompute: its pages are released (registered ones stay
cached) and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque

from astrai.kv_cache_manager import KVCacheManager
from astrai.observation import RequestAdmitted, RequestPreempted
from astrai.page_pool import Emit, namespace_id
from astrai.request import Request, Status


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        max_batch_size: int,
        max_batched_tokens: int,
        emit: Emit,
    ):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self.preemptions = 0
        self._emit = emit
        self._admitted: list[tuple[int, int, int]] = []  # (request, prompt tokens, cached) of first admissions

    def take_admitted(self) -> list[tuple[int, int, int]]:
        """The first admissions since the last call: (request, prompt tokens, prompt tokens served by the cache)."""
        admitted, self._admitted = self._admitted, []
        return admitted

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, budget: int | None = None) -> list[tuple[Request, int]]:
        """Pick this step's work as (request, tokens to compute); pages for them are allocated on return.

        ``budget``: the tokens left in this step (an engine shares one budget among its tenants); never more than
        ``max_batched_tokens``."""
        scheduled: dict[Request, int] = {}
        budget = self.max_batched_tokens if budget is None else min(budget, self.max_batched_tokens)
        preempted = False
        decodes = [r for r in self.running if len(r.token_ids) - r.num_computed == 1]
        prefills = [r for r in self.running if len(r.token_ids) - r.num_computed > 1]
        for req in decodes + prefills:
            if req.status is not Status.RUNNING or budget <= 0:
                continue
            count = min(len(req.token_ids) - req.num_computed, budget)
            while not self.cache.allocate(req, req.num_computed + count):
                victim = self.running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled[req] = count
                budget -= count
                self.cache.mark_pending(req, req.num_computed + count)
        if not preempted:
            self._admit(scheduled, budget)
        return list(scheduled.items())

    def _admit(self, scheduled: dict[Request, int], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            count = self.cache.admit(req, budget)
            if count == 0:
                return
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled[req] = count
            budget -= count
            self.cache.mark_pending(req, req.num_computed + count)
            hit = req.num_computed  # the tokens the prefix cache served: prompt first, then any output
            cached_prompt = min(hit, req.prompt_len)
            if req.preemptions == 0 and self.cache.prefix_caching:  # what the hit counters count (kv_cache_manager)
                self._admitted.append((req.id, req.prompt_len, cached_prompt))
            self._emit(
                RequestAdmitted,
                request=req.id,
                prompt_tokens=req.prompt_len,
                cached_tokens=cached_prompt,
                cached_output_tokens=hit - cached_prompt,
                hit_pages=tuple(req.pages[: hit // self.cache.page_size]),
                readmission=req.preemptions > 0,
                namespace=namespace_id(req.cache_salt),
            )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req)
        req.status = Status.WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
        self._emit(RequestPreempted, request=req.id)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished, cancelled or failed) and release its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req)
