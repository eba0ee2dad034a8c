"""Record the local engine's requests as a trace in Mooncake's format, with the engine's page size as block size.

``from_engine(engine, path)`` reads only the observation API: ``events()`` for which requests were admitted, in
what order and when, and for the chain keys the engine gave their pages; ``request_info`` for each prompt's tokens
and how many tokens it generated. A request becomes one line: ``timestamp`` (ms from the first admission),
``input_length``, ``output_length``, ``hash_ids`` and ``block_size``. Its ids are the chain keys of its full prompt
pages, numbered in order of first appearance, so two requests share leading ids exactly where they shared, or
could have shared, prefix KV in the engine; the partial last page gets an id of its own that nothing shares.

The keys are the engine's: a page's key is ``page_key(parent key, its tokens)``, and only the first page's key
depends on the request's ``cache_salt``, which no record carries. So the first key is taken from the events (the
``PageStored`` of the request's first page, or the key of the page its first hit served) and the rest are chained
from it with the same ``page_key``. What cannot be recorded exactly:

* requests whose ``RequestAdmitted`` left the event ring (``event_log_size``) or that ``request_info`` no longer
  knows (``keep_finished``), and requests still waiting or running: they are left out;
* a salted request whose first page the events do not show (stored and served before the ring's start, or a
  one-page prompt whose only page was cached already and, holding its last token, could not be hit): it is keyed
  as unsalted, so it may share ids with another salt's requests that the engine kept apart;
* the KV of generated tokens: the engine caches the pages its outputs fill, and a later prompt that repeats them
  (a chat that resends the answer) hits them; the format has no output ids, so a replay counts those hits only
  once a prompt has computed those blocks. With ``max_tokens=1`` nothing generated is cached, and a replay of
  requests run one at a time serves exactly the engine's hits (``tests/test_lab.py``);
* arrival times: ``timestamp`` is the admission, so time a request queued is not in it; partial blocks are never
  shared (Mooncake's last id may be).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from astrai.lab.trace import Trace, TraceRequest, write_trace
from astrai.observation import CacheCleared, PageEvicted, PageStored, RequestAdmitted, RequestInfo
from astrai.page_pool import PageKey, page_key

if TYPE_CHECKING:
    from astrai.engine import InferenceEngine

ENDED = ("finished", "cancelled", "failed")


def from_engine(engine: InferenceEngine, path: str | Path) -> Trace:
    """Write the trace of the engine's ended requests still in its event log to ``path``; return it."""
    admitted, first_keys = _admissions(engine)
    infos = {info.id: info for info in engine.request_info(list(admitted))}
    ended = [(infos[r], at) for r, at in admitted.items() if r in infos and infos[r].status in ENDED]
    trace = _trace(ended, engine.pool.page_size, first_keys, Path(path).name)
    write_trace(path, trace.requests, trace.block_size)
    return trace


def from_requests(infos: Sequence[RequestInfo], block_size: int, name: str = "your requests") -> Trace:
    """The trace of these ended requests, in their order, from their prompts' tokens alone: any backend's requests
    (a vLLM server's too, whose block hashes the app cannot recompute). Prompts that start alike share leading ids
    whatever namespace they ran in (no record says it): a sizing question asks what the traffic could reuse.
    Timestamps are their order (ms apart), not when they ran. A request that ended with no prompt tokens (a vLLM
    panel that failed before its first chunk) computed nothing and is left out: a trace line holds at least one."""
    ended = [(info, float(i) / 1000) for i, info in enumerate(infos) if info.status in ENDED and info.prompt_ids]
    return _trace(ended, block_size, {}, name)


def _trace(
    requests: Sequence[tuple[RequestInfo, float]], size: int, first_keys: dict[int, PageKey], name: str
) -> Trace:
    """Requests (with the time each was admitted) as trace lines: full prompt pages keyed as the engine keys them
    (``first_keys``: a request's first page's key where its salt made it another), numbered as first seen; the
    partial last page an id of its own."""
    numbering = itertools.count()
    ids: dict[PageKey, int] = {}  # chain key -> hash id, numbered as first seen
    lines: list[TraceRequest] = []
    start = requests[0][1] if requests else 0.0
    for info, admitted_at in requests:
        prompt = info.prompt_ids
        keys: list[PageKey] = []
        for i in range(len(prompt) // size):
            if i == 0 and info.id in first_keys:
                keys.append(first_keys[info.id])
            else:
                keys.append(page_key(keys[-1] if keys else None, prompt[i * size : (i + 1) * size]))
        blocks = [ids[key] if key in ids else ids.setdefault(key, next(numbering)) for key in keys]
        if len(prompt) % size:
            blocks.append(next(numbering))  # a partial block: never shared
        timestamp = round((admitted_at - start) * 1000)
        lines.append(TraceRequest(timestamp, len(prompt), info.generated_tokens, tuple(blocks)))
    return Trace(tuple(lines), size, name)


def _admissions(engine: InferenceEngine) -> tuple[dict[int, float], dict[int, PageKey]]:
    """First admissions in order (request -> time), and the first page's chain key of each where the events show
    it. A page's key is known from its ``PageStored`` until it is evicted or the cache is cleared. A first hit on a
    page whose key is not known is either on a page still pending (computed in the same step by another request),
    resolved by that page's ``PageStored`` in the same step, or on a page stored before the ring's start: no later
    step's ``PageStored`` of that page says anything of it (the page may have been evicted and hold another
    prompt's block by then), so it stays unknown."""
    admitted: dict[int, float] = {}
    first_keys: dict[int, PageKey] = {}
    page_keys: dict[int, PageKey] = {}
    pending: dict[tuple[int, int], list[int]] = {}  # (step, page) -> requests whose first hit it was, unregistered
    for event in engine.events():
        if isinstance(event, PageStored):
            page_keys[event.page] = event.key
            if event.chain_pos == 0 and event.request is not None:
                first_keys.setdefault(event.request, event.key)
            for request in pending.pop((event.step, event.page), ()):
                first_keys.setdefault(request, event.key)
        elif isinstance(event, PageEvicted):
            page_keys.pop(event.page, None)
        elif isinstance(event, CacheCleared):
            page_keys.clear()
        elif isinstance(event, RequestAdmitted) and not event.readmission:
            admitted[event.request] = event.time
            if event.hit_pages:
                page = event.hit_pages[0]
                if page in page_keys:
                    first_keys[event.request] = page_keys[page]
                else:
                    pending.setdefault((event.step, page), []).append(event.request)
    return admitted, first_keys
