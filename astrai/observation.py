"""The observation API: what the engine tells the outside world about its cache, typed and immutable.

Everything a dashboard, a benchmark or the playground reads goes through these records. They are frozen, so a
reader can keep one as long as it likes while the engine moves on. vLLM v1 is the model: its ``SchedulerStats`` /
``PrefixCacheStats`` for the counters, and its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events.

Counting rules (the charts' captions say exactly this):

* ``query_tokens`` / ``hit_tokens`` count each request once, at its *first* admission: the prompt's tokens, and
  those served from the prefix cache. A request preempted and re-admitted is counted apart, in
  ``readmitted_query_tokens`` / ``readmitted_hit_tokens``, so ``hit_tokens <= query_tokens`` always holds. A
  re-admission looks up the prompt and the tokens generated before the preemption (what it must recompute), so the
  re-admission counters are over those, and ``readmitted_hit_tokens <= readmitted_query_tokens`` holds too.
* A hit is capped at ``len(prompt) - 1``: the last prompt token is always recomputed for its logits.
* With prefix caching off (``CacheStats.prefix_caching`` False) nothing is looked up, so none of these counts
  anything: they stay 0, as vLLM records no query then, and the hit rate is "off", not 0%.

``None`` means "this backend cannot know": the in-process engine fills every field, but a vLLM server
(``astrai.playground.backends.vllm``) publishes only Prometheus counters and KV-cache events. It does not report a
block's ref count, the LRU order, how many hits a block served, re-admissions counted apart, or per-step prefill
and decode token counts, and without KV events it says nothing about cached-but-unused blocks, evictions or stored
blocks. Those fields are ``None`` there (typed ``int | None`` below), and the views say "n/a" rather than invent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Which forward serves the engine's steps (``CacheStats.forward``):
# * "eager": the model's own forward, as asked (``compile=False``, or compiling is off on this device);
# * "compiling": eager while the compiled forward is built in the background; it switches between two steps;
# * "compiled": the compiled forward (``compiled_forward.py``);
# * "failed": eager, because the compiled forward could not be built (no C++ compiler, say: the log says why) or
#   no longer fits the process.
Forward = Literal["eager", "compiling", "compiled", "failed"]


@dataclass(frozen=True, slots=True)
class TierStats:
    """The second KV tier (``astrai.tier``) at one moment. Its counters only grow; ``pages`` is its occupancy.

    ``hit_tokens`` is the part of ``CacheStats.hit_tokens`` the tier served (first admissions, counted as the pool's
    are), so the pool's own hits are ``CacheStats.hit_tokens - hit_tokens``. Bytes and seconds count every page
    moved, re-admissions' loads included; ``load_seconds`` is reading the store into the pool's pages.

    None: not reported. The engine fills every field; a vLLM server's tier is seen only through its KV events, which
    tell its medium, the blocks it holds, writes and evictions, and nothing else.
    """

    medium: str  # where its pages live: "memory", "pinned host memory" or "file" (vLLM: the events' "CPU", ...)
    write_policy: str | None  # "through" or "on_evict"
    capacity_pages: int | None
    pages: int  # pages held now
    hit_tokens: int | None
    written_pages: int
    loaded_pages: int | None
    evictions: int  # pages the tier's own policy gave up for others
    bytes_written: int | None
    bytes_loaded: int | None
    write_seconds: float | None
    load_seconds: float | None
    enabled: bool  # False once a store error switched it off (``error`` says why); it then serves nothing
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The cache and scheduler counters at one moment."""

    # None where not reported: the engine fills every field; a vLLM server's /metrics may lack a series, and its
    # cached and free pages need its KV events.
    n_pages: int | None
    page_size: int | None
    free_pages: int | None  # None: not reported (vLLM without KV events)
    used_pages: int | None  # ref count >= 1
    cached_pages: int | None  # ref count 0, indexed, in the LRU (evictable); None: not reported
    query_tokens: int | None  # prompt tokens looked up, once per request (first admission)
    hit_tokens: int | None  # of those, tokens served from the prefix cache
    # Looked up again when a preempted request came back: its prompt plus the tokens it had generated, as vLLM's
    # ``preempted_queries`` counts them (vLLM's Prometheus metrics do not publish these: None).
    readmitted_query_tokens: int | None
    readmitted_hit_tokens: int | None
    hit_rate: float | None  # hit_tokens / query_tokens, in [0, 1]
    recent_hit_rate: float | None  # the same over the last ``HIT_WINDOW`` first admissions
    evictions: int | None  # None: not reported (vLLM without KV events)
    stored_pages: int | None  # pages ever registered in the prefix index; None: not reported
    preemptions: int | None
    running: int | None
    waiting: int | None
    finished: int  # requests that ended by EOS or max_tokens
    cancelled: int
    failed: int
    generated_tokens: int  # tokens sampled and appended, over all requests
    steps: int
    prefix_caching: bool
    eviction: str | None = None  # the pool's eviction policy (astrai.eviction.POLICIES); None: not reported (vLLM)
    forward: Forward | None = None  # which forward serves (``Forward``); None: not reported (a vLLM server has none)
    second_tier: TierStats | None = None  # None: no second tier (or not reported)


@dataclass(frozen=True, slots=True)
class PageRecord:
    """One page as the engine sees it. ``token_ids`` are the KV it holds (empty when free)."""

    page: int
    state: str  # "free" | "in_use" | "cached"
    ref_count: int | None  # None: unknown (vLLM does not publish ref counts)
    lru_rank: int | None  # 0 = evicted next; None unless cached, or unknown (vLLM does not publish its LRU order)
    requests: tuple[int, ...]  # running requests whose page table holds it
    chain_pos: int  # the page's index in its chain (-1 when it has none)
    key: bytes | None  # its chained hash, once registered in the prefix index
    parent_key: bytes | None  # the previous page's key (None for a chain's first page)
    stored_by: int | None  # the request whose forward wrote the registered KV
    hits: int | None  # prefix hits this page has served since it was registered; None: unknown (vLLM)
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Every page, as it was after ``step`` engine steps (taken under the engine lock, so it is consistent)."""

    step: int
    pages: tuple[PageRecord, ...]


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """Base of every event: ``seq`` grows by one per event; ``step`` is the engine step it happened in."""

    seq: int
    step: int
    time: float


@dataclass(frozen=True, slots=True)
class PageStored(EngineEvent):
    """A full page was registered in the prefix index after the forward that wrote it."""

    page: int
    key: bytes
    parent_key: bytes | None
    chain_pos: int
    request: int | None
    token_ids: tuple[int, ...]
    # the prefix-cache namespace it was stored in: an opaque digest of the request's ``cache_salt`` (never the salt),
    # equal for equal salts. A chain's first page has no parent key, so only this tells two namespaces' first pages
    # apart (the explainer's "another namespace"). None: not reported (a vLLM server's events carry no salt).
    namespace: bytes | None = None


@dataclass(frozen=True, slots=True)
class PageEvicted(EngineEvent):
    """A cached page was taken by the eviction policy; its KV is gone (what it held is kept here).

    ``for_request`` is the request whose page allocation took it, None when it was evicted on demand (the trace
    replay trims its cache so) or where not reported (vLLM). It was the policy's victim, the first of the
    ``evictable`` cached pages in the eviction order at that moment (itself included); None: not reported (vLLM
    publishes no eviction order).
    """

    page: int
    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    for_request: int | None = None
    evictable: int | None = None


@dataclass(frozen=True, slots=True)
class TierPageWritten(EngineEvent):
    """A full page's KV was copied from pool page ``page`` into the second tier's ``slot``: under the "through"
    policy when the pool stored it, under "on_evict" when the pool evicted it (then ``page`` is already free)."""

    page: int
    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    slot: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TierPageLoaded(EngineEvent):
    """A page's KV was loaded from the second tier's ``slot`` into pool page ``page`` for ``request``'s lookup (the
    pool's ``PageStored`` for it comes before), in ``seconds``: its even share of the lookup's load, which reads all
    its pages at once, in runs. ``kept``: the tier keeps its copy ("through"), or gave it up to the pool
    ("on_evict")."""

    page: int
    key: bytes
    slot: int
    request: int | None
    nbytes: int
    seconds: float
    kept: bool


@dataclass(frozen=True, slots=True)
class TierPageEvicted(EngineEvent):
    """The second tier's own policy gave up the page in ``slot`` for another one: its KV is gone from the tier."""

    key: bytes
    parent_key: bytes | None
    token_ids: tuple[int, ...]
    slot: int


@dataclass(frozen=True, slots=True)
class CacheCleared(EngineEvent):
    """The prefix index was emptied: ``pages`` cached pages went free (in-use pages were only unindexed)."""

    pages: int


@dataclass(frozen=True, slots=True)
class RequestAdmitted(EngineEvent):
    """A waiting request got a batch slot, with the KV of its leading ``hit_pages`` served by the prefix cache.

    A first admission looks up the prompt. A re-admission (after a preemption) looks up what it must recompute:
    the prompt *and* the tokens generated so far, whose pages may still be cached too. The hit is reported split
    at the prompt's end, so ``cached_tokens <= prompt_tokens`` always holds and never counts generated tokens:

    * ``cached_tokens`` - prompt tokens served from the cache (at a first admission, at most ``prompt_tokens - 1``);
    * ``cached_output_tokens`` - generated tokens served from the cache; 0 at a first admission.

    Their sum is the hit the counters add: to ``hit_tokens`` at a first admission, to ``readmitted_hit_tokens`` at a
    re-admission (see ``CacheStats``).
    """

    request: int
    prompt_tokens: int
    cached_tokens: int
    cached_output_tokens: int
    hit_pages: tuple[int, ...]
    readmission: bool  # True when it comes back after a preemption
    namespace: bytes | None = None  # its prefix-cache namespace, as ``PageStored.namespace``; None: not reported


@dataclass(frozen=True, slots=True)
class RequestPreempted(EngineEvent):
    """A running request gave its pages back (registered ones stay cached) and waits to be recomputed."""

    request: int


@dataclass(frozen=True, slots=True)
class RequestFinished(EngineEvent):
    """A request ended; ``status`` is "finished", "cancelled" or "failed"."""

    request: int
    status: str


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step, recorded as it ended: what the charts draw, at the engine's own pace."""

    step: int
    time: float  # wall clock (time.time()) at the end of the step
    duration_s: float  # schedule + forward + sampling
    free_pages: int | None  # None where the backend cannot know (see the module docstring)
    used_pages: int | None  # None: not reported (a vLLM server's /metrics without its pool's usage)
    cached_pages: int | None
    prefill_tokens: int | None  # prompt (or recomputed) tokens run through the model in this step
    decode_tokens: int | None
    hit_tokens: int  # tokens served from the cache to requests admitted in this step (first admissions)
    query_tokens: int
    evictions: int | None  # in this step
    preemptions: int  # in this step
    requests: tuple[int, ...]  # requests the step computed
    sampled: tuple[tuple[int, int], ...]  # (request, token id) for every token this step appended
    page_changes: tuple[PageRecord, ...]  # pages whose state, refs or owners changed, in order of their last change
    # (request, prompt tokens, prompt tokens served by the cache) of each first admission the step counted in
    # ``hit_tokens`` / ``query_tokens`` (a vLLM server's: when the usage of a request says so)
    admitted: tuple[tuple[int, int, int], ...] = ()
    tier_pages: int | None = None  # pages the second tier holds at the step's end; None: no second tier


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """Per-request progress, for badges and tables."""

    id: int
    status: str
    prompt_tokens: int
    cached_tokens: int | None  # prefix hit at first admission; None before it
    generated_tokens: int
    preemptions: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    ttft: float | None
    tokens_per_s: float | None
    error: str | None
    # tokens computed again after preemptions took their KV (prompt or output; not what the cache served back);
    # None: not reported (vLLM)
    recomputed_tokens: int | None = None
    ended_step: int | None = None  # the step whose sample records its end, its pages given back; None: still live,
    # or not reported (vLLM)
