"""The prefix cache as a tree (SGLang's radix-tree picture, made live). Pure: records in, nodes out.

Every indexed page is a node whose parent is the page its chained key was built on, so the tree branches exactly
where prompts diverge. Pages evicted since the last drawing appear once more, as ghosts, where they were. A large
tree collapses each run of single-child pages of one kind into one node ("5 pages"), so 1,024 pages stay legible.

With a ``focus`` (the request ids of the visitor's last run), the tree draws that run's pages (those it uses or
stored, and the pages they chain from, which it hit) and gathers every other indexed page into one node: on an
engine a class shares, the branches of one run stay readable. The counts are always the whole index's, so they
agree with the stats line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from astrai.observation import PageEvicted, PageRecord
from astrai.playground.views.pages import Owner, visible_panels

ROOT = "root"
COLLAPSE_OVER = 64  # nodes; below this every page is its own node
LABEL_CHARS = 24


@dataclass
class TreeNode:
    id: str
    parent: str
    kind: str  # "in_use" | "cached" | "evicted" | "others" (with a focus: every page not the focused run's)
    panel: int | None  # this visitor's first panel using it, for the colour
    lru_rank: int | None
    pages: list[int] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)  # None: another session's text
    hits: int | None = 0  # None: not reported by the backend (vLLM)

    @property
    def label(self) -> str:
        if self.kind == "others":
            return f"{len(self.pages)} other pages (earlier runs, other sessions)"
        if self.kind == "evicted":  # whose it was is not kept with the event: its tokens are shown to nobody
            return f"{len(self.pages)} pages evicted" if len(self.pages) > 1 else "evicted"
        if any(t is None for t in self.texts):
            text = "other session"
        else:
            text = "".join(t or "" for t in self.texts).replace("\n", "⏎")
            text = text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"
        return f"{len(self.pages)} pages: {text}" if len(self.pages) > 1 else text


@dataclass(frozen=True)
class Tree:
    nodes: list[TreeNode]
    pages: int  # indexed pages, the whole index (ghosts excluded)
    in_use: int
    cached: int
    evicted: int  # ghosts drawn
    focused: int | None = None  # with a focus: the focused run's pages drawn (the rest are in ``others``)
    others: int = 0  # indexed pages gathered into the "other pages" node: ``focused + others == pages``


OTHERS = "others"


def prefix_tree(
    records: Sequence[PageRecord],
    evicted: Sequence[PageEvicted],
    owners: dict[int, Owner],
    session: str,
    decode: Callable[[Sequence[int]], str],
    focus: set[int] | None = None,
) -> Tree:
    nodes: dict[str, TreeNode] = {}
    used_by: dict[str, bool] = {}  # key -> the focused run uses or stored the page
    for record in records:
        if record.key is None:
            continue
        mine, visible = visible_panels(record, owners, session)
        key = record.key.hex()
        nodes[key] = TreeNode(
            id=key,
            parent=record.parent_key.hex() if record.parent_key else ROOT,
            kind=record.state,
            panel=mine[0] if mine else None,
            lru_rank=record.lru_rank,
            pages=[record.page],
            texts=[decode(record.token_ids) if visible else None],
            hits=record.hits,
        )
        used_by[key] = focus is not None and (record.stored_by in focus or bool(focus.intersection(record.requests)))
    kinds = [n.kind for n in nodes.values()]
    whole = (len(nodes), kinds.count("in_use"), kinds.count("cached"))
    for event in evicted:
        key = event.key.hex()
        if key not in nodes:  # the text of an evicted page is shown to nobody: its owner may be unknown by now
            parent = event.parent_key.hex() if event.parent_key else ROOT
            nodes[key] = TreeNode(key, parent, "evicted", None, None, [event.page], [None])
    for node in nodes.values():
        if node.parent != ROOT and node.parent not in nodes:
            node.parent = ROOT  # its parent left before it (a clear): hang it on the root
    focused, others = None, 0
    if focus is not None:  # the run's indexed pages drawn, the rest gathered; every ghost drawn
        kept = _with_ancestors({k for k, used in used_by.items() if used}, nodes)
        gathered = {k: n for k, n in nodes.items() if k not in kept and n.kind != "evicted"}
        for ghost in (n for n in nodes.values() if n.kind == "evicted" and n.parent in gathered):
            ghost.parent = OTHERS  # it chained from a page gathered with the others
        nodes = {k: n for k, n in nodes.items() if k not in gathered}
        focused, others = len([n for n in nodes.values() if n.kind != "evicted"]), len(gathered)
        if gathered:
            pages = [p for n in gathered.values() for p in n.pages]
            nodes[OTHERS] = TreeNode(OTHERS, ROOT, "others", None, None, pages, [])
    ordered = _collapse(nodes) if len(nodes) > COLLAPSE_OVER else list(nodes.values())
    ghosts = sum(n.kind == "evicted" for n in nodes.values())
    return Tree(ordered, *whole, ghosts, focused, others)


def _with_ancestors(keys: set[str], nodes: dict[str, TreeNode]) -> set[str]:
    """``keys`` and every page they chain from (a run's hits are its pages' ancestors)."""
    kept, todo = set(), list(keys)
    while todo:
        key = todo.pop()
        if key in kept or key not in nodes:
            continue
        kept.add(key)
        todo.append(nodes[key].parent)
    return kept


def _collapse(nodes: dict[str, TreeNode]) -> list[TreeNode]:
    """Merge each node into its parent when it is that parent's only child and looks the same."""
    children: dict[str, list[str]] = {}
    for node in nodes.values():
        children.setdefault(node.parent, []).append(node.id)
    merged_into: dict[str, str] = {}
    for node in _top_down(nodes, children):
        kids = children.get(node.id, [])
        head = nodes[merged_into.get(node.id, node.id)]
        if len(kids) == 1:
            child = nodes[kids[0]]
            if (child.kind, child.panel, child.texts[0] is None) == (head.kind, head.panel, head.texts[0] is None):
                head.pages += child.pages
                head.texts += child.texts
                head.hits = None if head.hits is None or child.hits is None else max(head.hits, child.hits)
                merged_into[child.id] = head.id
    kept = [n for n in nodes.values() if n.id not in merged_into]
    for node in kept:
        node.parent = merged_into.get(node.parent, node.parent)
    return kept


def _top_down(nodes: dict[str, TreeNode], children: dict[str, list[str]]) -> list[TreeNode]:
    order, frontier = [], list(children.get(ROOT, []))
    while frontier:
        node = nodes[frontier.pop()]
        order.append(node)
        frontier.extend(children.get(node.id, []))
    return order
