"""The prefix cache as a tree (SGLang's radix-tree picture, made live). Pure: records in, nodes out.

Every indexed page is a node whose parent is the page its chained key was built on, so the tree branches exactly
where prompts diverge. Pages evicted since the last drawing appear once more, as ghosts, where they were. A large
tree collapses each run of single-child pages of one kind into one node ("5 pages"), so 1,024 pages stay legible.
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
    kind: str  # "in_use" | "cached" | "evicted"
    panel: int | None  # this visitor's first panel using it, for the colour
    lru_rank: int | None
    pages: list[int] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)  # None: another session's text
    hits: int | None = 0  # None: not reported by the backend (vLLM)

    @property
    def label(self) -> str:
        if any(t is None for t in self.texts):
            text = "other session"
        else:
            text = "".join(t or "" for t in self.texts).replace("\n", "⏎")
            text = text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"
        return f"{len(self.pages)} pages: {text}" if len(self.pages) > 1 else text


@dataclass(frozen=True)
class Tree:
    nodes: list[TreeNode]
    pages: int  # indexed pages drawn (ghosts excluded)
    in_use: int
    cached: int
    evicted: int


def prefix_tree(
    records: Sequence[PageRecord],
    evicted: Sequence[PageEvicted],
    owners: dict[int, Owner],
    session: str,
    decode: Callable[[list[int]], str],
) -> Tree:
    nodes: dict[str, TreeNode] = {}
    for record in records:
        if record.key is None:
            continue
        mine, visible = visible_panels(record, owners, session)
        nodes[record.key.hex()] = TreeNode(
            id=record.key.hex(),
            parent=record.parent_key.hex() if record.parent_key else ROOT,
            kind=record.state,
            panel=mine[0] if mine else None,
            lru_rank=record.lru_rank,
            pages=[record.page],
            texts=[decode(list(record.token_ids)) if visible else None],
            hits=record.hits,
        )
    live = len(nodes)
    for event in evicted:
        key = event.key.hex()
        if key not in nodes:  # the text of an evicted page is shown to nobody: its owner may be unknown by now
            parent = event.parent_key.hex() if event.parent_key else ROOT
            nodes[key] = TreeNode(key, parent, "evicted", None, None, [event.page], [None])
    for node in nodes.values():
        if node.parent != ROOT and node.parent not in nodes:
            node.parent = ROOT  # its parent left before it (a clear): hang it on the root
    ordered = _collapse(nodes) if len(nodes) > COLLAPSE_OVER else list(nodes.values())
    kinds = [n.kind for n in nodes.values()]
    return Tree(ordered, live, kinds.count("in_use"), kinds.count("cached"), kinds.count("evicted"))


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
                head.hits = None if None in (head.hits, child.hits) else max(head.hits, child.hits)
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
