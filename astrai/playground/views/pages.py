"""The privacy rule: what one visitor may see of each page of the pool.

A visitor sees the tokens of a page only when one of their own requests is using it or stored it; any other page
is labelled "other session" and its text is withheld. Every view of pages (the page map, the tree, replay) goes
through ``visible_panels``, on every engine the playground serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from astrai.observation import PageRecord


@dataclass(frozen=True)
class Owner:
    """Who submitted a request: the privacy rule's input."""

    session: str
    panel: int


@dataclass(frozen=True)
class PageView:
    """What one visitor may see of one page."""

    page: int
    state: str  # free / in_use / cached
    ref_count: int | None  # None: the backend does not know (vLLM)
    lru_rank: int | None
    chain_pos: int
    panels: tuple[int, ...]  # this visitor's panels using it
    other_users: int  # requests of other sessions (or unknown ones) using it
    text: str | None  # None when the text is not this visitor's to see
    just_evicted: bool
    hits: int | None = 0  # None: the backend does not know (vLLM)


def visible_panels(record: PageRecord, owners: dict[int, Owner], session: str) -> tuple[tuple[int, ...], bool]:
    """The privacy rule: this session's panels using the page, and whether the session may see its tokens
    (one of its requests uses the page, or stored it)."""
    mine = tuple(owners[r].panel for r in record.requests if r in owners and owners[r].session == session)
    stored_by = owners.get(record.stored_by) if record.stored_by is not None else None
    return mine, bool(mine) or (stored_by is not None and stored_by.session == session)


def page_views(
    records: Sequence[PageRecord],
    owners: dict[int, Owner],
    session: str,
    evicted: set[int],
    decode: Callable[[list[int]], str],
) -> list[PageView]:
    """Apply the privacy rule to every page: text only for pages this session's requests use or stored."""
    views = []
    for record in records:
        mine, visible = visible_panels(record, owners, session)
        views.append(
            PageView(
                page=record.page,
                state=record.state,
                ref_count=record.ref_count,
                lru_rank=record.lru_rank,
                chain_pos=record.chain_pos,
                panels=mine,
                other_users=len(record.requests) - len(mine),
                text=decode(list(record.token_ids)) if visible and record.token_ids else None,
                just_evicted=record.page in evicted,
                hits=record.hits,
            )
        )
    return views
