"""Why a token missed, on a vLLM server or fleet: the explainer (``astrai.explain``) over the KV events the replicas'
samplers turn into page records, each request judged as of its submission.

A server publishes no request events: where the engine's history holds each request's admission, this holds the
last event seen when the request was sent (``looked_up_after``) and when it ended (``ended_after``), and a page
cached when it was sent but not served reads as evicted where its stay ended before the request ended. An eviction
after that never rewrites the explanation: it reads what it read when the request ran. Nor does a server send
salts: another namespace cannot be told apart there (``Explanation.namespaces_known`` is False, and the view says so).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from astrai.explain import Explanation, KeyHistory, explain
from astrai.observation import RequestInfo
from astrai.playground.backends.vllm.replica import Replica


class ServerKeys:
    """The key history of one server's, or a fleet's, blocks. Thread-safe: one lock around feeding and asking."""

    def __init__(self, replicas: Sequence[Replica]):
        self._replicas = tuple(replicas)
        self._keys = KeyHistory()
        self._lock = threading.Lock()
        self._sent_after: dict[int, int] = {}  # request -> the last event seq fed when it was sent
        self._ended_after: dict[int, int] = {}  # request -> the last event seq fed when it ended

    def sent(self, request_ids: Sequence[int]) -> None:
        """These requests are being sent now: their misses are judged as of the events the replicas' subscribers
        hold now (recorded first: a run that just ended has its blocks there, not yet in a sample)."""
        for replica in self._replicas:
            replica.catch_up()
        with self._lock:
            self._feed()
            for rid in request_ids:
                self._sent_after[rid] = self._keys.last_seq

    def ended(self, request_id: int) -> None:
        """This request has ended (its stream closed): its misses are never blamed on a stay that ends later
        (recorded after catching up, as ``sent``: the blocks its run evicted are in the subscribers now)."""
        for replica in self._replicas:
            replica.catch_up()
        with self._lock:
            self._feed()
            if request_id in self._sent_after:
                self._ended_after.setdefault(request_id, self._keys.last_seq)

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._sent_after.pop(request_id, None)
            self._ended_after.pop(request_id, None)

    def explain(
        self,
        infos: Sequence[RequestInfo],
        page_size: int,
        viewer_owns: Callable[[int | None], bool],
        served_by: dict[int, int],
    ) -> list[Explanation]:
        with self._lock:
            self._feed()
            after = {info.id: self._sent_after[info.id] for info in infos if info.id in self._sent_after}
            ended = {info.id: self._ended_after[info.id] for info in infos if info.id in self._ended_after}
            return explain(
                self._keys,
                infos,
                page_size=page_size,
                viewer_owns=viewer_owns,
                served_by=served_by,
                looked_up_after=after,
                ended_after=ended,
            )

    def _feed(self) -> None:
        """The replicas' events since the last feed (one clock numbers them all, so they merge in ``seq`` order)."""
        last = self._keys.last_seq
        if len(self._replicas) == 1:
            self._keys.feed(self._replicas[0].events(last))
        else:
            self._keys.feed_fleet([replica.events(last) for replica in self._replicas])
