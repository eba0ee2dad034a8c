"""vLLM's cached blocks as the playground's pages: stable page numbers, owners and events, from KV-event snapshots.

vLLM numbers its blocks by hash, not by position in a pool, and tells of each block only when it is stored or
removed. The page map needs a pool: ``BlockPages`` gives each cached block a stable slot (its "page" number) while
it stays cached, the lowest free one when it arrives, so the map stays packed and a block does not move. A block is
"in_use" only while one of this app's running requests holds its tokens at its position (a request holds every
block of its sequence), otherwise "cached". vLLM does not publish ref counts, its LRU order or per-block hits: those
fields are ``None``. A block is attributed (``stored_by`` / ``requests``) to this app's request whose tokens contain
the block's tokens at the block's position (at any position when its chain is not all held), so the service's
request -> (session, panel) map colours it.

Not thread-safe: the backend calls it under its own lock.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from typing import Protocol

from astrai.observation import CacheCleared, EngineEvent, PageEvicted, PageRecord, PageStored
from astrai.playground.backends.vllm.encoding import BlockHash
from astrai.playground.backends.vllm.tracker import TrackerSnapshot

EventFactory = Callable[[int, int], EngineEvent]  # (seq, step) -> the event


class OwnRequest(Protocol):
    """What attribution reads of one of this app's requests."""

    id: int
    status: str
    prompt_ids: tuple[int, ...]
    output_ids: list[int]


def page_key(block_hash: BlockHash | None) -> bytes | None:
    if block_hash is None:
        return None
    if isinstance(block_hash, bytes):
        return block_hash
    return block_hash.to_bytes(9, "big", signed=True)  # 64-bit hashes, either sign


class BlockPages:
    """The pages shown for a vLLM server's cached blocks, updated from tracker snapshots."""

    def __init__(self) -> None:
        self.pages: dict[int, PageRecord] = {}  # slot -> its record, free slots included
        self._slots: dict[BlockHash, int] = {}
        self._free_slots: list[int] = []  # a heap
        self._n_slots = 0
        self.epoch: tuple[int, int, int] = (0, 0, 0)  # the tracker's clears, restarts, resets
        self._inputs: tuple = ()  # what the last update read: unchanged inputs, nothing to do

    def update(
        self, snap: TrackerSnapshot, recent: Sequence[OwnRequest], now: float
    ) -> tuple[list[PageRecord], list[EventFactory]]:
        """Diff the tracker's blocks against the pages shown: returns the changed records and the events, as
        factories ``(seq, step) -> event`` that the caller stamps. ``recent``: this app's newest requests, oldest
        first; they are the ones a block can be attributed to."""
        epoch = (snap.clears, snap.restarts, snap.resets)
        inputs = (snap.last_seq, epoch, tuple((r.id, r.status, len(r.prompt_ids), len(r.output_ids)) for r in recent))
        if inputs == self._inputs:
            return [], []  # neither the blocks nor the requests that own them moved
        self._inputs = inputs
        events: list[EventFactory] = []
        if epoch != self.epoch:  # cleared, restarted or resynced: every slot is free again
            cleared = sum(1 for p in self.pages.values() if p.state != "free")
            self.epoch = epoch
            if self._slots:
                events.append(functools.partial(CacheCleared, time=now, pages=cleared))
            self._slots.clear()
            self._free_slots = list(range(self._n_slots))  # sorted: a heap
        blocks = snap.blocks
        bs = snap.block_size or 0
        # slots: release the blocks that left, give the new ones the lowest free slot
        for block_hash in [h for h in self._slots if h not in blocks]:
            slot = self._slots.pop(block_hash)
            heapq.heappush(self._free_slots, slot)
            old = self.pages.get(slot)
            if old is not None and old.key is not None:
                events.append(
                    functools.partial(
                        PageEvicted, time=now, page=old.page, key=old.key, parent_key=old.parent_key,
                        token_ids=old.token_ids,
                    )
                )  # fmt: skip
        new_hashes = [h for h in blocks if h not in self._slots]
        for block_hash in sorted(new_hashes, key=lambda h: blocks[h].stored_seq):
            if self._free_slots:
                slot = heapq.heappop(self._free_slots)
            else:
                slot, self._n_slots = self._n_slots, self._n_slots + 1
            self._slots[block_hash] = slot
        # who holds which tokens: (position, the tokens up to the block's end, hashed) -> this app's requests, newest
        # last. The whole prefix, not the block's own tokens alone: two requests whose first blocks differ can share
        # a second block's tokens, and that block on one replica is not the other request's (seen on a fleet).
        index: dict[tuple[int, int], list[int]] = {}
        anywhere: dict[tuple[int, ...], list[int]] = {}
        live = set()
        if bs:
            for request in recent:
                sequence = (*request.prompt_ids, *request.output_ids)
                prefix = 0
                for k in range(len(sequence) // bs):
                    chunk = tuple(sequence[k * bs : (k + 1) * bs])
                    prefix = hash((prefix, chunk))
                    index.setdefault((k, prefix), []).append(request.id)
                    anywhere.setdefault(chunk, []).append(request.id)
                if request.status == "running":
                    live.add(request.id)
        depth: dict[BlockHash, int] = {}  # -1: unknown (an ancestor is not held)
        prefixes: dict[BlockHash, int] = {}  # of the blocks whose chain is all held: their tokens, and all before

        def chain_pos(block_hash: BlockHash) -> int:
            path: list[BlockHash] = []
            cur: BlockHash | None = block_hash
            while cur is not None and cur in blocks and cur not in depth:
                path.append(cur)
                cur = blocks[cur].parent_hash
            if cur is None:
                base: int | None = -1  # reached the chain's first block
            elif cur in depth and depth[cur] >= 0:
                base = depth[cur]
            else:
                base = None
            prefix = prefixes.get(cur, 0) if cur is not None else 0
            for i, node in enumerate(reversed(path)):
                depth[node] = -1 if base is None else base + 1 + i
                if base is not None:
                    prefix = prefixes[node] = hash((prefix, blocks[node].token_ids))
            return depth[block_hash]

        pages: dict[int, PageRecord] = {}
        for block_hash, slot in self._slots.items():
            block = blocks[block_hash]
            pos = chain_pos(block_hash)
            owners = index.get((pos, prefixes[block_hash]), []) if pos >= 0 else anywhere.get(block.token_ids, [])
            holding = tuple(r for r in owners if r in live)
            pages[slot] = PageRecord(
                page=slot,
                state="in_use" if holding else "cached",
                ref_count=None,
                lru_rank=None,
                requests=holding,
                chain_pos=pos,
                key=page_key(block_hash),
                parent_key=page_key(block.parent_hash),
                stored_by=min(owners) if owners else None,
                hits=None,
                token_ids=block.token_ids,
            )
            previous = self.pages.get(slot)
            if previous is None or previous.key != pages[slot].key:
                p = pages[slot]
                assert p.key is not None  # a stored block always has its hash
                events.append(
                    functools.partial(
                        PageStored, time=now, page=p.page, key=p.key, parent_key=p.parent_key,
                        chain_pos=p.chain_pos, request=p.stored_by, token_ids=p.token_ids,
                    )
                )  # fmt: skip
        for slot in range(self._n_slots):
            if slot not in pages:
                pages[slot] = PageRecord(slot, "free", 0, None, (), -1, None, None, None, 0, ())
        changes = [p for slot, p in sorted(pages.items()) if self.pages.get(slot) != p]
        self.pages = pages
        return changes, events
