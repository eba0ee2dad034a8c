"""The explainer's answers: typed, frozen records a view can keep as long as it likes.

An ``Explanation`` covers one request's prompt with ``Segment``s, ``[start, end)`` token ranges in order, each with
one ``Cause``: every prompt token is in exactly one segment, so ``counts`` sums to ``prompt_tokens``, and the
``CACHED`` count plus the ``LOADED`` one (served from the second tier) is the engine's own ``cached_tokens`` (0 before
the first admission), except in two typed states
that cover the whole prompt: ``IN_PROGRESS`` (the admission's step is still running, so its pages are not all
stored yet: read again once it ends) and ``UNKNOWN`` / ``CONFLICT`` for an impossible ``cached_tokens`` (negative,
or the whole prompt: a server's usage is outside input). What a preemption made the
request compute again is counted apart, as the cache statistics count re-admissions apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Cause(StrEnum):
    """Why a prompt token was, or was not, served from the prefix cache at the request's first admission."""

    CACHED = "cached"  # served: ``Segment.page`` says who stored the page (and whether in the very same step)
    LOADED = "loaded"  # served from the second tier: loaded into the pool for this very lookup (``astrai.tier``)
    # no page with these tokens after this prefix was stored in this namespace, as far as the history goes back
    NEW = "new"
    EVICTED = "evicted"  # stored, then evicted before the lookup: ``Segment.page`` says when and for whom
    EVICTED_BOTH = "evicted_both"  # evicted from the pool, and from the second tier too, before the lookup
    CLEARED = "cleared"  # stored, then dropped by a Clear cache before the lookup
    DIVERGED = "diverged"  # the viewer's own page after the same prefix differs from this one: ``Segment.divergence``
    PARTIAL_PAGE = "partial_page"  # after the last full page: only full pages are cached
    LAST_TOKEN = "last_token"  # the last prompt token is always computed, for the first output's logits
    OTHER_NAMESPACE = "other_namespace"  # the viewer's own page with these tokens is cached under another salt
    CACHING_OFF = "caching_off"  # the engine runs without prefix caching: nothing is looked up
    OTHER_REPLICA = "other_replica"  # another replica of the fleet held it (``Segment.page.replica``)
    NOT_ADMITTED = "not_admitted"  # never admitted (waiting, or ended before): nothing was looked up yet
    IN_PROGRESS = "in_progress"  # admitted in the step still running: the causes are told once it ends
    UNKNOWN = "unknown"  # the kept history cannot tell: ``Segment.unknown`` says why


class Unknown(StrEnum):
    """Why the history cannot tell a miss's cause (it never guesses)."""

    FORGOTTEN = "forgotten"  # this page, or one before it, was stored and evicted before the kept history (its
    # bound); past the bound's fingerprints too, any page may have been
    EVENTS_LOST = "events_lost"  # events between two read ones were lost (a gap in ``seq``): the page may have lived
    NO_ADMISSION = "no_admission"  # the request's lookup is not in the kept history, so its moment is unknown
    CONFLICT = "conflict"  # the history says it was cached at the lookup, yet it was not served (e.g. a vLLM server,
    # whose events carry no salt, held it under another namespace; or a partly cached page); or the reported
    # ``cached_tokens`` is impossible (negative, or not below the prompt's length)


@dataclass(frozen=True)
class PageLife:
    """One stay of a page in one replica's cache: who stored it and when, and how it ended (or not yet)."""

    request: int | None  # whose forward computed and stored it; None: not reported (a vLLM block nobody here owns)
    replica: int
    stored_step: int | None  # None: stored before the kept history (only its end was seen)
    same_step: bool  # stored in the step that admitted the explained request: shared while still being computed
    ended_step: int | None  # None: still cached when the explained request was looked up (or to this day)
    cleared: bool  # ended by a Clear cache, not an eviction
    evicted_for: int | None  # the request whose page allocation took it; None: not an eviction, or not reported
    evictable: int | None  # the cached pages in the eviction order when it was taken, it the first of them


@dataclass(frozen=True)
class Divergence:
    """The viewer's own cached page after the same prefix, which differs from the prompt's from token ``at`` on."""

    at: int  # index within the page of the first differing token
    prompt_tokens: tuple[int, ...]  # the explained prompt's page
    cached_tokens: tuple[int, ...]  # the cached page's
    cached: PageLife


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of the prompt and their one cause, with the facts that cause names.

    ``page``: for ``CACHED`` the page that served them; for ``EVICTED`` / ``CLEARED`` the stay that ended; for
    ``OTHER_NAMESPACE`` / ``OTHER_REPLICA`` the page that held them there; for ``LAST_TOKEN`` with ``costs_page``
    the cached page that the cap left unused. ``stranded_behind``: these tokens' own page was still cached, but an
    earlier page of the prefix (at this token) missed, and a page serves only after every page before it; the
    cause and ``page`` are that earlier page's.
    """

    start: int
    end: int
    cause: Cause
    page: PageLife | None = None
    divergence: Divergence | None = None
    stranded_behind: int | None = None
    costs_page: bool = False  # LAST_TOKEN: the cap at len - 1 cost this whole cached page
    unknown: Unknown | None = None  # UNKNOWN: why


@dataclass(frozen=True)
class Explanation:
    """Every prompt token of one request with its cause, at its first admission (see the module docstring)."""

    request: int
    prompt_tokens: int
    # the engine's own count (None: not admitted yet); equals ``counts[Cause.CACHED] + counts[Cause.LOADED]`` but
    # where the whole prompt reads ``IN_PROGRESS`` or, the count being impossible, ``UNKNOWN`` (conflict)
    cached_tokens: int | None
    replica: int  # the replica that served it
    admitted_step: int | None  # the step of its first admission, where the history holds it
    segments: tuple[Segment, ...]
    counts: Mapping[Cause, int]  # tokens per cause, every cause present (a dict: copies and pickles); sums to
    # ``prompt_tokens``
    # counted apart, not in ``counts``: tokens computed again after preemptions (None: not reported, e.g. vLLM),
    # the re-admissions, and the tokens the cache served back at them (prompt and output)
    recomputed_tokens: int | None
    readmissions: int
    readmitted_cached_tokens: int
    # False where the events carry no namespace (a vLLM server's): "another namespace" cannot be told apart there,
    # and a first page cached under another salt reads as the request's own
    namespaces_known: bool
