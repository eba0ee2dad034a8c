""" "Why is my hit rate low?" in the page: the hit-rate ladder (``astrai.lab.ladder``) of the visitor's last run, of
their engine since it started, or of a shipped trace, computed on a press in the request's worker thread (never the
engine's loop), with its exports to download.

The visitor's sources are read through the observation API alone, as Replay my requests reads them: the requests'
records (``request_info``: prompt token ids, never text; ``cached_tokens``, which gives the ``delivered`` rung),
their admission events for their namespaces where the backend reports them, the engine's stats for its page size,
pool and policy, and, on a fleet, which replica served each request (``served_by``). Every visitor's requests on
an engine are the page's own (``Visitors.requests``): the engine serves nothing else. The shipped traces never
change, so each of their ladders is computed once per (trace, capacity, policy, rules) in the process.

Exports are written to a directory of the visitor's own, made for each ladder (the previous one removed), never
shared between visitors.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from astrai.eviction import POLICIES
from astrai.lab.ladder import Ladder, LadderError, fleet_ladder, ladder
from astrai.lab.record import ENDED, from_requests
from astrai.lab.replay import Semantics
from astrai.lab.report import ladder_csv, ladder_html
from astrai.lab.trace import Trace, read_trace
from astrai.observation import RequestAdmitted, RequestInfo
from astrai.playground.backends.protocol import Backend, BackendError
from astrai.playground.callbacks.context import Context, Update, session_of
from astrai.playground.views import ladder as view

SEMANTICS: Semantics = "engine"  # a capacity is an engine's pool of that many pages, as the visitor's engine has
KEEP_EXPORTS = 256  # visitors whose last ladder's files are kept on disk; the least recent are removed first
UNREPORTED_POLICY = "lru"  # a server that does not say (vLLM): its free-block queue gives back the least recent first


@dataclass(frozen=True)
class Counted:
    """A visitor source's requests as the ladder takes them: the ladder, and what the caption must add."""

    ladder: Ladder
    notes: tuple[str, ...]


def counted(infos: Sequence[RequestInfo]) -> list[RequestInfo]:
    """The requests a ladder can count: ended (``record.ENDED``), with prompt tokens, looked up (``cached_tokens``
    reported: a request cancelled while waiting never was). ``from_requests`` then keeps every one, in order."""
    return [i for i in infos if i.status in ENDED and i.prompt_ids and i.cached_tokens is not None]


def namespaces_of(backend: Backend, infos: Sequence[RequestInfo]) -> list[Hashable] | None:
    """Each request's prefix-cache namespace, from its first admission's event; None unless every one is known
    (a vLLM server's records carry no salt, and an engine's event ring forgets)."""
    known = {
        e.request: e.namespace
        for e in backend.events(0)
        if isinstance(e, RequestAdmitted) and not e.readmission and e.namespace is not None
    }
    if any(i.id not in known for i in infos):
        return None
    return [known[i.id] for i in infos]


def visitor_ladder(backend: Backend, infos: Sequence[RequestInfo], source: str) -> Counted | str:
    """The ladder of these requests (a run's, or an engine's), in their order, at the engine's pool and policy,
    with their reported hits as ``delivered``; or why there is none, in words."""
    stats = backend.stats()
    if not stats.prefix_caching:
        return f"**{source}**: prefix caching is off on your engine: nothing was looked up, so there is no ladder."
    requests = counted(infos)
    if not requests:
        return f"**{source}**: no ended request to count yet: press Run first."
    if stats.page_size is None or stats.n_pages is None:
        return f"**{source}**: your engine does not report its page size and pool, which a ladder needs."
    notes = []
    if len(requests) < len(infos):
        notes.append(
            f"{len(infos) - len(requests)} of the {len(infos)} requests are left out: still running, never looked "
            "up (cancelled while waiting) or with no prompt tokens."
        )
    policy = stats.eviction or UNREPORTED_POLICY
    if stats.eviction is None:
        notes.append(f"The server does not report its eviction policy: replayed under {policy}.")
    if stats.second_tier is not None:
        notes.append(
            "Your engine has a second tier; this replay has none: the tokens it loaded from the tier are delivered, "
            "and show in the scheduling gap (the lab's ladder replays a tier: python -m astrai.lab ladder --tier2)."
        )
    namespaces = namespaces_of(backend, requests)
    if namespaces is None:
        notes.append(
            "The records do not say each request's namespace: the replay lets requests of different namespaces "
            "share pages, and what the engine kept apart shows in the scheduling gap."
        )
    try:
        if len(backend.replicas) > 1:
            return _fleet(backend, requests, stats.page_size, policy, namespaces, source, notes)
        trace = from_requests(requests, stats.page_size, source)
        delivered = [i.cached_tokens or 0 for i in requests]
        built = ladder(trace, stats.n_pages, policy, delivered=delivered, namespaces=namespaces, semantics=SEMANTICS)
    except LadderError as exc:
        return f"**{source}**: {exc}."
    return Counted(built, tuple(notes))


def _fleet(
    backend: Backend,
    requests: list[RequestInfo],
    page_size: int,
    policy: str,
    namespaces: list[Hashable] | None,
    source: str,
    notes: list[str],
) -> Counted | str:
    """A fleet's ladder: each request on the replica whose KV events name it (the rest left out, said so), each
    replica's pool its own (the smallest, where they differ)."""
    replicas = backend.replicas
    labels = {replica.label: r for r, replica in enumerate(replicas)}
    served = backend.served_by([i.id for i in requests])
    known = [k for k, i in enumerate(requests) if i.id in served and served[i.id].replica in labels]
    if not known:
        return f"**{source}**: no request's replica is known yet (its KV events name it): try again in a moment."
    if len(known) < len(requests):
        notes.append(f"{len(requests) - len(known)} requests whose replica is not known are left out.")
    pools = sorted({replica.stats().n_pages or 0 for replica in replicas})
    if not pools[0]:
        return f"**{source}**: a replica does not report its pool, which a ladder needs."
    if len(pools) > 1:
        notes.append(f"The replicas' pools differ ({pools}): each is taken as the smallest, {pools[0]:,} pages.")
    placed = [requests[k] for k in known]
    whole = from_requests(placed, page_size, source)  # one numbering of ids, one order (the timestamps)
    on: list[list[int]] = [[] for _ in replicas]  # each replica's requests, as indexes into ``placed``
    for n, info in enumerate(placed):
        on[labels[served[info.id].replica]].append(n)
    built = fleet_ladder(
        [Trace(tuple(whole.requests[n] for n in mine), page_size, replicas[r].name) for r, mine in enumerate(on)],
        pools[0],
        policy,
        delivered=[[placed[n].cached_tokens or 0 for n in mine] for mine in on],
        namespaces=None if namespaces is None else [[namespaces[known[n]] for n in mine] for mine in on],
        semantics=SEMANTICS,
    )
    return Counted(built, tuple(notes))


@functools.lru_cache(maxsize=2)
def shipped_trace(path: Path) -> Trace:
    return read_trace(path)


@functools.lru_cache(maxsize=32)
def trace_ladder(path: Path, capacity: int, policy: str, semantics: Semantics) -> Ladder:
    """A shipped trace's ladder: the traces never change, so each is computed once in the process."""
    return ladder(shipped_trace(path), capacity, policy, semantics=semantics)


class LadderCallbacks:
    def __init__(self, ctx: Context):
        self.ctx, self.ui = ctx, ctx.ui
        self._lock = threading.Lock()  # guards _exports
        self._exports: OrderedDict[str, Path] = OrderedDict()  # session -> its last ladder's directory

    def compute(
        self,
        source: str | None,
        policy: str | None,
        capacity: float | None,
        request: gr.Request,
        progress: gr.Progress = gr.Progress(),  # noqa: B008 - gradio injects it
    ) -> Update:
        """The chosen source's ladder: the chart, the caption, and its three exports to download."""
        session = session_of(request)
        source = source or view.LAST_RUN
        if source in view.TRACE_FILES:
            if policy not in POLICIES or capacity is None or int(capacity) < 0:
                return self._none("pick a policy, and a pool size in 'How big should the cache be?'")
            progress(0, desc=f"replaying {source} under {policy} and the optimum")
            built = trace_ladder(view.TRACE_FILES[source], int(capacity), str(policy), SEMANTICS)
            result: Counted | str = Counted(
                built, ("The pool size is the one picked in 'How big should the cache be?'.",)
            )
        elif source in (view.LAST_RUN, view.ENGINE):
            result = self._visitor_source(session, source)
        else:
            return self._none(f"unknown source {source!r}")
        if isinstance(result, str):
            return self._none(result)
        files = self._write(session, result.ladder)
        views = self.ui.ladder
        return {
            views.chart: view.ladder_chart(result.ladder),
            views.note: view.caption(result.ladder, source, result.notes),
            **{
                button: gr.DownloadButton(value=str(files[kind]), interactive=True)
                for kind, button in views.downloads.items()
            },
        }

    def _visitor_source(self, session: str, source: str) -> Counted | str:
        visitor = self.ctx.visitors.act(session)
        shown = visitor.shown
        if source == view.LAST_RUN:
            if shown is not None and not shown.caching and shown.caching_on_half is not None:
                shown = shown.caching_on_half  # Compare: its caching-on half is the run that looked anything up
            if shown is None:
                return f"**{source}**: you have no run on this page yet: press Run first."
            profile, ids = shown.profile, list(shown.request_ids)
        else:
            profile, ids = visitor.profile, self.ctx.visitors.requests()
        backend = self.ctx.engines.backend(profile)
        if backend is None:
            return f"**{source}**: that engine is not running now."
        try:
            infos = backend.request_info(ids)
            result = visitor_ladder(backend, infos, source)
            if isinstance(result, Counted) and source == view.ENGINE:
                known = sum(i.status in ENDED for i in infos)
                result = Counted(result.ladder, (*_engine_notes(backend, known), *result.notes))
            elif isinstance(result, Counted):
                result = Counted(result.ladder, (*result.notes, _COLD_START))
        except BackendError as exc:
            return f"**{source}**: {exc}"
        return result

    def _none(self, why: str) -> Update:
        views = self.ui.ladder
        return {
            views.chart: None,
            views.note: why,
            **{button: gr.DownloadButton(value=None, interactive=False) for button in views.downloads.values()},
        }

    def folder(self, session: str) -> Path | None:
        """Where this visitor's last ladder's exports are (Gradio serves copies of them), if any."""
        with self._lock:
            return self._exports.get(session)

    def _write(self, session: str, built: Ladder) -> dict[str, Path]:
        """The ladder's exports in a new directory of this visitor's own; their previous one is removed."""
        folder = Path(tempfile.mkdtemp(prefix="astrai-ladder-"))
        files = {
            "html": folder / "hit-rate-ladder.html",
            "json": folder / "hit-rate-ladder.json",
            "csv": folder / "hit-rate-ladder.csv",
        }
        files["html"].write_text(ladder_html(built), encoding="utf-8")
        files["json"].write_text(json.dumps(built.to_dict(), indent=2), encoding="utf-8")
        files["csv"].write_text(ladder_csv(built), encoding="utf-8")
        with self._lock:
            stale = [self._exports.pop(session, None)]
            self._exports[session] = folder
            while len(self._exports) > KEEP_EXPORTS:
                stale.append(self._exports.popitem(last=False)[1])
        for old in stale:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        return files

    def wire(self) -> None:
        views = self.ui.ladder
        views.compute.click(
            self.compute,
            [views.source, views.policy, self.ui.sizing.capacity],
            [views.chart, views.note, *views.downloads.values()],
            api_name="hit_rate_ladder",
            concurrency_limit=2,
            concurrency_id="ladder",
            show_progress_on=views.note,
        )


_COLD_START = (
    "The replay starts from an empty cache: hits on pages cached before the run (your earlier runs', or another "
    "visitor's in the same namespace) are delivered but not replayed, so they show as a negative scheduling gap."
)


def _engine_notes(backend: Backend, known: int) -> tuple[str, ...]:
    """Whose requests an engine's ladder counts, and what it leaves out: requests that ended on the engine before
    the ``known`` ones it (and the page) still keep."""
    stats = backend.stats()
    ended = stats.finished + stats.cancelled + stats.failed
    if known >= ended:
        return ("Every visitor's requests on it, as token ids: no one's text is read.",)
    return (
        f"The {known:,} of the {ended:,} requests ended on it that it still keeps (its oldest are forgotten), "
        "every visitor's, as token ids: no one's text is read. Pages the forgotten ones left cached are delivered "
        "but not replayed (the replay starts empty): they show as a negative scheduling gap.",
    )
