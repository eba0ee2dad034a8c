"""``explain``: every prompt token of a request with exactly one cause, from a ``KeyHistory`` and ``RequestInfo``s.

A pure function: no engine, no lock, no UI. Everything is judged as of the request's *lookup*, its first admission
(``KeyHistory`` keeps its moment: the admission's ``seq``, or the first eviction its own allocation made in that
step), because that is when the engine decided what it served. A page stored after the lookup (by the request's own
earlier chunk, by a later run) never reads as cached, and ``CACHED`` is the engine's own ``cached_tokens``.

The prompt's full pages are followed along the request's own chain: the namespace's first page with these tokens,
then each child of the previous key with the next page's tokens (a key is a hash of its parent and its tokens, so
``(parent, tokens)`` names one key without the salt). Then, in this order:

* ``CACHING_OFF``: the engine looked nothing up; ``NOT_ADMITTED``: no lookup yet (``cached_tokens`` None).
* ``IN_PROGRESS``: admitted in a step after ``completed_step`` (the step still running): the pages that step
  stores, which the request may share, are not stored yet, so any cause told now could change when it ends.
* ``UNKNOWN`` (``CONFLICT``), the whole prompt: ``cached_tokens`` is impossible (negative, or not below the prompt's
  length; a hit stops at ``len - 1``), as a server's usage may report.
* ``CACHED``: the first ``cached_tokens``; the page is the stay that held the key at the lookup, else one stored
  later in the same step by a request scheduled before (a *pending* page, computed once for prompts submitted
  together: ``same_step``).
* The last page of a prompt whose length is a multiple of the page size is never looked up (the hit is capped at
  ``len - 1`` so the last token is computed for its logits). When every page before it hit and its key was
  available, ``LAST_TOKEN`` covers it whole, ``costs_page``; the last token is ``LAST_TOKEN`` in any case, and
  the tokens after the last full page are ``PARTIAL_PAGE``.
* A missed page whose own key still held the page at the lookup, behind an earlier missed page: that earlier page's
  cause, ``stranded_behind`` it (a page serves only after every page before it). The first missed page itself held
  at the lookup cannot be, by the engine's rules: ``UNKNOWN`` (events lost, or a conflict), except that against a
  caller's estimate of the moment (``looked_up_after``) a stay that ended after it, and no later than the request
  ended (``ended_after``), reads as evicted: an eviction after the request ran never rewrites its explanation; and
  where either namespace is unknown (a server sends no salts), it was held under another salt: ``OTHER_NAMESPACE``
  to the viewer who stored it, ``NEW`` to anyone else.
* ``LOADED`` rather than ``CACHED``: a served page whose stay began with a load from the second tier for this very
  request's lookup (a later request served by that page reads ``CACHED``).
* ``EVICTED`` / ``CLEARED``: the key's last stay before the lookup ended so (for whom, and first of how many);
  ``EVICTED_BOTH`` where the key was in the second tier too, and its last stay there before the lookup ended by the
  tier's own eviction;
  ``UNKNOWN`` (events lost) where no event ended it (the history's ``max_live`` bound did).
* ``OTHER_REPLICA``: another replica held the whole chain to this page at the lookup (replicas share one ``seq``
  clock, as a fleet's samplers do). ``OTHER_NAMESPACE``: another namespace on the serving replica held it (or was
  computing it in the same step).
* ``DIVERGED``: a page after the same prefix was available, and differs from this one from token ``at`` on (for the
  chain's first page, the prefix is empty: it must share at least the first token).
* ``UNKNOWN``: the history cannot prove the key was never stored before (events lost, or dropped by its bound).
* ``NEW`` otherwise.

Privacy: a page stored by a request the viewer may not see (``viewer_owns``) is never the divergent page, nor the
page held under another namespace, nor (where namespaces are unknown) on another replica: those read as ``NEW`` to
them, and its tokens are never returned. ``CACHED`` names the storing request whoever it is (the UI words it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from astrai.explain.history import KeyHistory, KeyRecord, Life, Parent, Tokens
from astrai.explain.records import Cause, Divergence, Explanation, PageLife, Segment, Unknown
from astrai.observation import RequestInfo

Held = tuple[KeyRecord, Life]


class _Fact(NamedTuple):
    """A segment without its place: ``Segment``'s fields after ``end``, in order (a tuple: cheap to compare)."""

    cause: Cause
    page: PageLife | None = None
    divergence: Divergence | None = None
    stranded_behind: int | None = None
    costs_page: bool = False
    unknown: Unknown | None = None


_NEW = _Fact(Cause.NEW)


@dataclass(frozen=True)
class _Lookup:
    """Where and when a request's prompt was looked up. ``at`` None: unknown (not in the kept history)."""

    at: int | None
    step: int | None  # the admission's step; None where only a caller's estimate of ``at`` is known
    namespace: bytes | None
    replica: int
    ended: int | None = None  # with an estimate: the last seq fed when the request ended (None: not ended, or unknown)


def explain(
    history: KeyHistory,
    requests: Sequence[RequestInfo],
    *,
    page_size: int,
    prefix_caching: bool = True,
    viewer_owns: Callable[[int | None], bool] | None = None,
    served_by: Mapping[int, int] | None = None,
    looked_up_after: Mapping[int, int] | None = None,
    ended_after: Mapping[int, int] | None = None,
    completed_step: int | None = None,
) -> list[Explanation]:
    """One ``Explanation`` per request, in order.

    ``viewer_owns``: which storing requests are the viewer's own (None: all, as for a notebook). ``served_by``:
    request -> the replica that served it (default: its admission's replica, else 0). ``looked_up_after``: request
    -> the last ``seq`` fed before it was looked up, for a backend whose history has no ``RequestAdmitted`` (a vLLM
    server): its misses are then judged as of that moment, and a page held then but not served reads as evicted if
    its stay ended after it (while the request waited for its turn). ``ended_after``: request -> the last ``seq``
    fed when it ended, for the same backends: a stay that ended after it is not its cause. ``completed_step``: the
    last step whose events are all in the history (an engine's completed steps; None: every step's are): a request
    admitted after it reads ``IN_PROGRESS``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    moments = _Moments(looked_up_after or {}, ended_after or {}, completed_step)
    owns = viewer_owns or _everyone
    return [_explain_one(history, info, page_size, prefix_caching, owns, served_by or {}, moments) for info in requests]


@dataclass(frozen=True)
class _Moments:
    """What the caller knows of when requests ran, and how far the history is complete (``explain``'s arguments)."""

    looked_up_after: Mapping[int, int]
    ended_after: Mapping[int, int]
    completed_step: int | None


def _everyone(request: int | None) -> bool:
    return True


def _explain_one(
    history: KeyHistory,
    info: RequestInfo,
    page_size: int,
    prefix_caching: bool,
    owns: Callable[[int | None], bool],
    served_by: Mapping[int, int],
    moments: _Moments,
) -> Explanation:
    admission = history.admission(info.id)
    replica = served_by.get(info.id, admission.replica if admission is not None else 0)
    length = len(info.prompt_ids)
    done = moments.completed_step
    if not prefix_caching:
        segments = [Segment(0, length, Cause.CACHING_OFF)]
    elif info.cached_tokens is None:
        segments = [Segment(0, length, Cause.NOT_ADMITTED)]
    elif not 0 <= info.cached_tokens <= max(length - 1, 0):
        segments = [Segment(0, length, Cause.UNKNOWN, unknown=Unknown.CONFLICT)] if length else []
    elif admission is not None and done is not None and admission.step > done:
        segments = [Segment(0, length, Cause.IN_PROGRESS)] if length else []
    else:
        if admission is not None:
            lookup = _Lookup(admission.seq, admission.step, admission.namespace, replica)
        elif info.id in moments.looked_up_after:
            ended = moments.ended_after.get(info.id)
            lookup = _Lookup(moments.looked_up_after[info.id] + 1, None, None, replica, ended)
        else:
            lookup = _Lookup(None, None, None, replica)
        segments = _Prompt(history, lookup, info.prompt_ids, page_size, owns).segments(info.cached_tokens, info.id)
    counts = dict.fromkeys(Cause, 0)
    for segment in segments:
        counts[segment.cause] += segment.end - segment.start
    return Explanation(
        request=info.id,
        prompt_tokens=length,
        cached_tokens=info.cached_tokens,
        replica=replica,
        admitted_step=admission.step if admission is not None else None,
        segments=tuple(segments),
        counts=counts,
        recomputed_tokens=info.recomputed_tokens,
        readmissions=admission.readmissions if admission is not None else 0,
        readmitted_cached_tokens=admission.readmitted_cached_tokens if admission is not None else 0,
        namespaces_known=history.namespaces_known and (admission is None or admission.namespace is not None),
    )


class _Prompt:
    """One prompt's pages against the history, as of its lookup (see the module docstring for the rules)."""

    def __init__(
        self,
        history: KeyHistory,
        lookup: _Lookup,
        prompt: tuple[int, ...],
        page_size: int,
        owns: Callable[[int | None], bool],
    ) -> None:
        self.history, self.lookup, self.owns = history, lookup, owns
        length, size = len(prompt), page_size
        self.length, self.size = length, size
        self.pages: list[Tokens] = [prompt[i * size : (i + 1) * size] for i in range(length // size)]
        self.forgotten_from: int | None = None  # the first page whose key was dropped by the history's bound
        self.own = self._walk_own() if lookup.at is not None else []
        self._other: dict[bool, list[Held | None]] = {}  # other replicas (True) / namespaces (False): per page

    # ----- the segments ---------------------------------------------------------------------------------
    def segments(self, cached: int, request: int) -> list[Segment]:
        """Cover ``[0, length)`` once, in order: cached (or loaded for ``request``), misses page by page, the partial
        page, the last token."""
        size, last = self.size, self.length - 1
        if last < 0:
            return []
        out: list[tuple[int, int, _Fact]] = []
        hit = -(-cached // size)
        for i in range(hit):
            served = self._served(i)
            page = self._life(*served, with_end=False) if served else None
            loaded = served is not None and served[1].loaded and served[1].request == request
            out.append((i * size, min((i + 1) * size, cached), _Fact(Cause.LOADED if loaded else Cause.CACHED, page)))
        if min(hit * size, last) > cached:  # a partly cached page: never from this engine's full-page hits
            out.append((cached, min(hit * size, last), _Fact(Cause.UNKNOWN, unknown=Unknown.CONFLICT)))
        capped = len(self.pages) - 1 if self.length % size == 0 else None  # the last page, never looked up
        stranded: _Fact | None = None  # the first missed page's cause, for the held pages behind it
        for i in range(hit, len(self.pages)):
            lo, hi = i * size, min((i + 1) * size, last)
            if i == capped and i == hit and (available := self._available_own(i)) is not None:
                life = self._life(*available, with_end=False)
                out.append((lo, self.length, _Fact(Cause.LAST_TOKEN, page=life, costs_page=True)))
                return _segments(out)
            if lo >= hi:
                continue
            if stranded is None:
                miss = self._miss(i)
                stranded = miss._replace(stranded_behind=lo)
            else:
                miss = stranded if self._held(i) is not None else self._miss(i)
            out.append((lo, hi, miss))
        partial = max(len(self.pages) * size, cached)
        if partial < last:
            out.append((partial, last, _Fact(Cause.PARTIAL_PAGE)))
        out.append((last, self.length, _Fact(Cause.LAST_TOKEN)))
        return _segments(out)

    def _miss(self, i: int) -> _Fact:
        """Why page ``i``, looked up (or capped) after the served prefix, was not served."""
        at = self.lookup.at
        if at is None:
            return _Fact(Cause.UNKNOWN, unknown=Unknown.NO_ADMISSION)
        held = self._held(i)
        if held is not None:  # held at the lookup and the first miss: only a caller's estimate of ``at`` explains it
            end, until = held[1].end_seq, self.lookup.ended
            if self.lookup.step is None and end is not None and (until is None or end <= until):
                return self._ended(*held)
            if self.history.incomplete_before(at) is Unknown.EVENTS_LOST:
                return _Fact(Cause.UNKNOWN, unknown=Unknown.EVENTS_LOST)
            if self.lookup.namespace is None or not self.history.namespaces_known:  # a server sends no salts
                return self._other_namespace(*held)
            return _Fact(Cause.UNKNOWN, unknown=Unknown.CONFLICT)
        ended = [(rec, life) for rec in self._own(i) if (life := rec.ended_before(at)) is not None]
        if ended:
            return self._ended(*max(ended, key=lambda held: held[1].end_seq or 0))
        for elsewhere, cause in ((True, Cause.OTHER_REPLICA), (False, Cause.OTHER_NAMESPACE)):
            other = self._other_chain(i, elsewhere)
            if other is not None:
                return _Fact(cause, page=self._life(*other, with_end=False))
        divergence = self._diverged(i)
        if divergence is not None:
            return _Fact(Cause.DIVERGED, divergence=divergence)
        reason = self.history.incomplete_before(at)
        if self._forgotten(i, at):
            reason = reason or Unknown.FORGOTTEN
        return _Fact(Cause.UNKNOWN, unknown=reason) if reason else _NEW

    def _other_namespace(self, record: KeyRecord, life: Life) -> _Fact:
        """A page held at the lookup, not served, where namespaces are not known (a server sends no salts): the
        one reading the server's rules allow is a salt other than the request's, so it is told as another namespace
        to a viewer who stored it, and as new to anyone else (privacy, as for a known namespace)."""
        return (
            _Fact(Cause.OTHER_NAMESPACE, page=self._life(record, life, with_end=False))
            if self.owns(life.request)
            else _NEW
        )

    def _forgotten(self, i: int, at: int) -> bool:
        """Whether the bound dropped what would tell: page ``i``'s stay before the lookup, or the key of a page of
        its prefix (the chain to page ``i`` is then unknown)."""
        if self.forgotten_from is not None and i >= self.forgotten_from:
            return True
        return any(rec.forgotten_before(at) for rec in self._own(i))

    def _ended(self, record: KeyRecord, life: Life) -> _Fact:
        if life.lost:
            return _Fact(Cause.UNKNOWN, unknown=Unknown.EVENTS_LOST)
        if life.cleared:
            cause = Cause.CLEARED
        elif self.lookup.at is not None and record.evicted_from_tier_before(self.lookup.at):
            cause = Cause.EVICTED_BOTH
        else:
            cause = Cause.EVICTED
        return _Fact(cause, page=self._life(record, life, with_end=True))

    # ----- the request's own chain --------------------------------------------------------------------
    def _walk_own(self) -> list[list[KeyRecord]]:
        """The keys of the prompt's pages in its namespace, as far as any was ever stored (several per page only
        where namespaces are unknown: then every namespace's first page with these tokens is a candidate)."""
        replica = self.lookup.replica
        chain: list[list[KeyRecord]] = []
        parents: list[Parent] = [(replica, None, self.lookup.namespace)]
        for tokens in self.pages:
            found = [rec for parent in parents for rec in self.history.children(parent, tokens)]
            if not found:
                if any(self.history.was_dropped(parent, tokens) for parent in parents):
                    self.forgotten_from = len(chain)
                break
            chain.append(found)
            parents = [(replica, rec.key, None) for rec in found]
        return chain

    def _own(self, i: int) -> list[KeyRecord]:
        return self.own[i] if i < len(self.own) else []

    def _held(self, i: int) -> Held | None:
        """The own key's stay that held page ``i`` at the lookup."""
        at = self.lookup.at
        if at is None:
            return None
        return next(((rec, life) for rec in self._own(i) if (life := rec.covering(at)) is not None), None)

    def _served(self, i: int) -> Held | None:
        """The stay that served hit page ``i``: held at the lookup, else the first stored after it (pending)."""
        at = self.lookup.at
        if at is None:
            return None
        held = self._held(i)
        if held is not None:
            return held
        later = [(rec, life) for rec in self._own(i) if (life := rec.first_after(at)) is not None]
        return min(later, key=lambda held: held[1].stored_seq, default=None)

    def _available(self, record: KeyRecord) -> Life | None:
        """The stay of ``record`` a lookup could use: held then, or pending (stored later in the same step by a
        request looked up before this one)."""
        at, step = self.lookup.at, self.lookup.step
        if at is None:
            return None
        life = record.covering(at)
        if life is not None or step is None:
            return life
        life = record.first_after(at)
        if life is None or life.stored_step != step:
            return None
        storer = self.history.admission(life.request)
        return life if storer is not None and storer.seq < at else None

    def _available_own(self, i: int) -> Held | None:
        return next(((rec, life) for rec in self._own(i) if (life := self._available(rec)) is not None), None)

    def _life(self, record: KeyRecord, life: Life, with_end: bool) -> PageLife:
        """The record of a stay; its end only where it is the cause (an explanation stays what it was)."""
        at, step = self.lookup.at, self.lookup.step
        ended = with_end and life.end_seq is not None
        return PageLife(
            request=life.request,
            replica=record.replica,
            stored_step=life.stored_step,
            same_step=step is not None and at is not None and life.stored_step == step and life.stored_seq >= at,
            ended_step=life.end_step if ended else None,
            cleared=ended and life.cleared,
            evicted_for=life.evicted_for if ended else None,
            evictable=life.evictable if ended else None,
        )

    # ----- elsewhere: other replicas, other namespaces, divergent pages --------------------------------
    def _other_chain(self, i: int, other_replicas: bool) -> Held | None:
        """A page with page ``i``'s tokens held, with every page before it, on another replica (``other_replicas``)
        or in another namespace of the serving replica, that the viewer may be told of."""
        chain = self._other.get(other_replicas)
        if chain is None:
            chain = self._other[other_replicas] = self._walk_other(other_replicas)
        return chain[i] if i < len(chain) else None

    def _walk_other(self, other_replicas: bool) -> list[Held | None]:
        if not self.pages:
            return []
        at, replica, namespace = self.lookup.at, self.lookup.replica, self.lookup.namespace
        assert at is not None, "walked only for a lookup in the history"
        roots = self.history.roots(self.pages[0])
        if other_replicas:  # in the request's namespace, or where either namespace is unknown
            starts = [r for r in roots if r.replica != replica and _may_share(r.namespace, namespace)]

            def hold(record: KeyRecord) -> Life | None:
                return record.covering(at)  # another replica's steps are not this one's: nothing is pending there
        else:  # a known namespace other than the request's (unknown ones cannot be told apart)
            starts = [r for r in roots if r.replica == replica and not _may_share(r.namespace, namespace)]
            hold = self._available
        frontier = [(rec, life) for rec in starts if (life := hold(rec)) is not None]
        chain: list[Held | None] = []
        for i, tokens in enumerate(self.pages):
            if i:
                parents = [(rec.replica, rec.key, None) for rec, _ in frontier]
                children = (child for parent in parents for child in self.history.children(parent, tokens))
                frontier = [(child, life) for child in children if (life := hold(child)) is not None]
            if not frontier:
                break
            chain.append(next((held for held in frontier if self._may_tell(held, other_replicas)), None))
        return chain

    def _may_tell(self, held: Held, other_replicas: bool) -> bool:
        """Another namespace is another's unless the viewer stored it; another replica's page is in the request's
        own namespace where both namespaces are known (a hit there would have told the same)."""
        record, life = held
        same_namespace = None not in (record.namespace, self.lookup.namespace)
        if other_replicas and same_namespace and record.namespace == self.lookup.namespace:
            return True
        return self.owns(life.request)

    def _diverged(self, i: int) -> Divergence | None:
        """The viewer's own available page after the same prefix that shares the longest start with page ``i``."""
        if i > len(self.own):
            return None  # the prefix itself was never stored: nothing follows it
        replica, page = self.lookup.replica, self.pages[i]
        if i == 0:
            parents: list[Parent] = [(replica, None, self.lookup.namespace)]
        else:
            parents = [(replica, rec.key, None) for rec in self.own[i - 1]]
        best: tuple[int, int, KeyRecord, Life] | None = None
        for parent in parents:
            # after the empty prefix every first page is a sibling: only those sharing a first token
            candidates = self.history.children_from(parent, page[0]) if i == 0 else self.history.all_children(parent)
            for rec in candidates:
                life = self._available(rec) if rec.tokens != page else None
                if life is None or not self.owns(life.request):
                    continue
                at = _common_prefix(page, rec.tokens)
                if best is None or (at, life.stored_seq) > best[:2]:
                    best = (at, life.stored_seq, rec, life)
        if best is None:
            return None
        at, _, rec, life = best
        return Divergence(at, page, rec.tokens, self._life(rec, life, with_end=False))


def _may_share(a: bytes | None, b: bytes | None) -> bool:
    """Whether two first pages may be in one namespace: the same one, or either unknown."""
    return a is None or b is None or a == b


def _common_prefix(a: Tokens, b: Tokens) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _segments(runs: list[tuple[int, int, _Fact]]) -> list[Segment]:
    """The runs as segments, adjacent ones with equal facts merged; checks that they tile the prompt."""
    merged: list[tuple[int, int, _Fact]] = []
    for start, end, fact in runs:
        if start == end:
            continue
        if merged and merged[-1][1] == start and merged[-1][2] == fact:
            merged[-1] = (merged[-1][0], end, fact)
        else:
            assert not merged or merged[-1][1] == start, "segments tile the prompt"
            merged.append((start, end, fact))
    return [Segment(start, end, *fact) for start, end, fact in merged]
