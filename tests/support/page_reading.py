"""Reading the playground as a visitor's browser shows it: every figure, line and badge of one page in one snapshot,
parsed into numbers; and a watch on the page that records, at every change the live view makes, its console errors,
uncaught exceptions, toasts, and any number that contradicts another on the same view.

One ``page.evaluate`` reads the whole page: Gradio applies an update's outputs inside one browser task, so a snapshot
never sees half of one. (Plotly draws a figure after its props land, so a figure may lag the text by a frame:
comparisons across views are polled until they agree, never read once.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.playground.views import charts

# Installed in every page before the playground loads. A MutationObserver sees every change the page makes (each live
# tick, each streamed message, each toast), and after each batch of them, in the page's own task:
# - records each toast's message once (its kind: error / warning / info / success, and its text), even one gone since;
# - checks the numbers that one view states together: the stats line's parts sum to its pool and its hits are at
#   most its lookups, each badge's cached tokens are at most its prompt tokens, the tree title's pages are its in use
#   plus its cached. A contradiction is recorded with the text that showed it.
WATCH_JS = r"""
(() => {
  const walk = {toasts: [], violations: [], checks: 0, seen: new WeakSet()};
  window.__walk = walk;
  const violate = (what, text) => {
    const line = `${what}: ${text}`;
    if (walk.violations.length < 50 && !walk.violations.includes(line)) walk.violations.push(line);
  };
  const check = () => {
    pending = false;
    // a toast of a kind already on screen takes the new message in: one entry per message
    for (const message of document.querySelectorAll('[data-testid=toast-body] [data-testid=toast-text]')) {
      if (walk.seen.has(message)) continue;
      const text = (message.innerText || '').trim();
      const body = message.closest('[data-testid=toast-body]');
      const kind = ['error', 'warning', 'info', 'success'].find(k => body.classList.contains(k)) || 'unknown';
      if (!text && kind !== 'error') continue;  // its text renders a moment later
      walk.seen.add(message);
      walk.toasts.push({kind, text});
    }
    const stats = document.getElementById('stats')?.innerText || '';
    if (stats.includes('Now:')) {
      walk.checks++;
      const now = new RegExp('Now: (\\d+) pages in use by running requests · (\\d+) cached \\(kept for reuse\\) · '
        + '(\\d+) free, of (\\d+) pages').exec(stats);
      if (!now) violate('the stats line does not read', stats);
      else if (+now[1] + +now[2] + +now[3] !== +now[4]) violate('in use + cached + free is not the pool', stats);
      const reuse = /Reuse so far: (\d+) of (\d+) prompt tokens/.exec(stats);
      if (reuse && +reuse[1] > +reuse[2]) violate('more hits than lookups', stats);
    }
    for (const badge of document.querySelectorAll('[id^=badge_]')) {
      const m = /(\d+) prompt tokens · (\d+) cached/.exec(badge.innerText || '');
      if (m && +m[2] > +m[1]) violate(`${badge.id}: more cached than prompt tokens`, badge.innerText);
    }
    const tree = document.querySelector('#prefix_tree .js-plotly-plot');
    const title = tree?.layout?.title?.text || '';
    const t = /Prefix tree: (\d+) pages \((\d+) in use, (\d+) cached\)/.exec(title);
    if (title && !t) violate('the tree title does not read', title);
    if (t && +t[1] !== +t[2] + +t[3]) violate('the tree pages are not in use + cached', title);
  };
  let pending = false;
  new MutationObserver(() => {
    if (!pending) { pending = true; setTimeout(check, 0); }
  }).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
})();
"""


EXPECTED_TOASTS = ("warning", "info", "success")  # gr.Warning and gr.Info: said to the visitor on purpose


@dataclass
class Watch:
    """What one page said that it should not have: console errors, uncaught exceptions, error toasts (a gr.Error; an
    unexpected exception in a callback shows nothing on the page, only in the app's log), contradictions between the
    numbers of one view (``WATCH_JS``). ``attach`` it before the page opens the playground."""

    name: str
    console: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    page: Any = None

    def attach(self, page: Any) -> None:
        self.page = page
        page.add_init_script(WATCH_JS)
        page.on("console", lambda msg: self.console.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))

    def state(self) -> dict[str, Any]:
        return self.page.evaluate("(({toasts, violations, checks}) => ({toasts, violations, checks}))(window.__walk)")

    def toasts(self) -> list[dict[str, str]]:
        return self.state()["toasts"]

    def problems(self) -> list[str]:
        """Everything wrong so far, each as a line naming this visitor; [] when all is well."""
        state = self.state()
        lines = [f"console error: {text}" for text in self.console]
        lines += [f"uncaught exception: {text}" for text in self.page_errors]
        lines += [f"{t['kind']} toast: {t['text']}" for t in state["toasts"] if t["kind"] not in EXPECTED_TOASTS]
        lines += [f"contradiction: {text}" for text in state["violations"]]
        return [f"{self.name}: {line}" for line in lines]


# Everything the checks read, in one task of the page (see the module's docstring).
READ_JS = r"""
() => {
  const text = id => document.getElementById(id)?.innerText ?? '';
  const value = selector => document.querySelector(selector)?.value ?? null;
  const plot = id => {
    const p = document.querySelector(`#${id} .js-plotly-plot`);
    if (!p || !p.data || !p.layout) return null;
    return {
      title: p.layout.title?.text ?? '',
      traces: p.data.map(t => ({
        name: t.name ?? null, type: t.type ?? 'scatter', xaxis: t.xaxis ?? null,
        y: t.y ? Array.from(t.y) : null, z: t.z ? Array.from(t.z, row => Array.from(row)) : null,
        text: t.type === 'heatmap' && t.text ? Array.from(t.text, row => Array.from(row)) : null,
        ids: t.ids ? Array.from(t.ids) : null,
      })),
    };
  };
  const tokens = i => {
    const box = document.getElementById(`tokens_${i}`);
    if (!box) return null;
    const spans = [...box.querySelectorAll('[data-cause]')];  // a run of tokens of one cause (views/causes.py)
    const count = runs => runs.reduce((n, s) => n + +s.dataset.tokens, 0);
    // served: the pool's cached tokens and those loaded from a second tier, as a badge's cached count is
    return {total: count(spans), cached: count(spans.filter(s => ['cached', 'loaded'].includes(s.dataset.cause))),
            titled: spans.every(s => s.title.length > 0)};
  };
  const table = [];
  for (const cell of document.querySelectorAll('#requests [role=gridcell][data-row]')) {
    const row = +cell.dataset.row, col = +cell.dataset.col;
    (table[row] = table[row] || [])[col] = cell.innerText.trim();
  }
  const slider = document.querySelector('#replay_step input[type=number]');
  const panels = [0, 1, 2, 3, 4, 5];
  return {
    stats: text('stats'), note: text('scenario_note'), replay_note: text('replay_note'),
    savings_note: text('savings_note'), badges: panels.map(i => text(`badge_${i}`)), tokens: panels.map(tokens),
    prompts: panels.map(i => value(`#prompt_${i} textarea`)), outputs: panels.map(i => value(`#out_${i} textarea`)),
    n_panels: value('#n_panels input[type=number]'), max_tokens: value('#max_tokens input[type=number]'),
    namespace: document.querySelector('#cache_namespace input:checked')?.value ?? null,
    replay_step: slider ? +slider.value : null, replay_max: slider ? +slider.max : null,
    table: table.filter(Boolean),
    plots: {
      page_map: plot('page_map'), occupancy: plot('plot_0'), lru: plot('plot_1'), hit_rate: plot('plot_2'),
      tree: plot('prefix_tree'), savings: plot('savings'),
    },
  };
}
"""


def _int(text: str) -> int:
    return int(text.replace(",", ""))


@dataclass(frozen=True)
class StatsLine:
    """The stats line under the page map: which engine, what its pool holds now, what it reused so far."""

    engine: str  # "default · 1024 pages × 16 tokens, batch 64, float32"
    used: int
    cached: int
    free: int
    n_pages: int
    page_size: int
    hit_tokens: int
    query_tokens: int
    evictions: int
    preemptions: int

    NOW = re.compile(
        r"Now: (\d+) pages in use by running requests · (\d+) cached \(kept for reuse\) · (\d+) free, of (\d+) pages "
        r"× (\d+) tokens"
    )
    REUSE = re.compile(r"Reuse so far: (\d+) of (\d+) prompt tokens came from the cache")
    NONE_YET = "Reuse so far: no prompt has been looked up yet"
    COUNTS = re.compile(r"· (\d+) evictions · (\d+) preemptions")
    ENGINE = re.compile(r"Your engine: (.*?) · (?:only you on it now|shared with)")

    @classmethod
    def parse(cls, text: str) -> StatsLine | None:
        now, reuse, counts, engine = (p.search(text) for p in (cls.NOW, cls.REUSE, cls.COUNTS, cls.ENGINE))
        if not (now and counts and engine and (reuse or cls.NONE_YET in text)):
            return None
        hits, queries = (_int(reuse.group(1)), _int(reuse.group(2))) if reuse else (0, 0)
        used, cached, free, n_pages, page_size = (_int(g) for g in now.groups())
        return cls(engine.group(1), used, cached, free, n_pages, page_size, hits, queries, *map(_int, counts.groups()))

    def as_engine_reports(self) -> dict[str, int]:
        """These figures under the names of the engine's own counters (``CacheStats``, the ``/cache_stats`` API)."""
        return {
            "used_pages": self.used,
            "cached_pages": self.cached,
            "free_pages": self.free,
            "n_pages": self.n_pages,
            "page_size": self.page_size,
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "evictions": self.evictions,
            "preemptions": self.preemptions,
        }


@dataclass(frozen=True)
class Badge:
    """A panel's badge: "**56** prompt tokens · **48** cached (86%) · TTFT 0.07 s · 347.1 tok/s"."""

    prompt: int
    cached: int | None  # None: its engine had prefix caching off
    ended: bool  # the request finished (its speed is shown)

    @classmethod
    def parse(cls, text: str) -> Badge | None:
        prompt = re.search(r"(\d+) prompt tokens", text)
        if prompt is None:
            return None
        cached = re.search(r"· (\d+) cached", text)
        if cached is None and "prefix caching off" not in text:
            return None
        return cls(int(prompt.group(1)), int(cached.group(1)) if cached else None, "tok/s" in text)


@dataclass(frozen=True)
class TreeTitle:
    pages: int
    in_use: int
    cached: int

    @classmethod
    def parse(cls, title: str) -> TreeTitle | None:
        m = re.match(r"Prefix tree: (\d+) pages \((\d+) in use, (\d+) cached\)", title)
        return cls(*map(int, m.groups())) if m else None


@dataclass(frozen=True)
class MapCells:
    """The page map's cells, counted by what their colour says (``charts.PALETTE``)."""

    title: str
    pool: int  # the pool size its title states
    free: int
    in_use: int  # by a panel of this visitor's, or another session's
    cached: int
    evicted: int  # just evicted (red)
    z: list[list[int | None]]
    hover: list[list[str]]

    @classmethod
    def parse(cls, plot: dict[str, Any] | None) -> MapCells | None:
        if not plot or not plot["traces"] or plot["traces"][0]["z"] is None:
            return None
        # "Page map (40 pages; x = shared)", or "Page map (pages 0–223 of 1024; the rest are free; x = shared)"
        pool = re.search(r"of (\d+); the rest|\((\d+) pages", plot["title"])
        z = plot["traces"][0]["z"]
        cells = [c for row in z for c in row if c is not None]
        shades = range(charts.FIRST_SHADE, len(charts.PALETTE))
        return cls(
            title=plot["title"],
            pool=int(pool.group(1) or pool.group(2)) if pool else -1,
            free=sum(c == 0 for c in cells),
            in_use=sum(c == 1 or charts.FIRST_PANEL <= c < charts.FIRST_SHADE for c in cells),
            cached=sum(c in shades for c in cells),
            evicted=sum(c == 2 for c in cells),
            z=z,
            hover=plot["traces"][0]["text"] or [],
        )


def last(plot: dict[str, Any] | None, name: str) -> Any:
    """The last y of the trace called ``name`` (None when there is no such trace, or it is empty)."""
    for trace in (plot or {}).get("traces", []):
        if trace["name"] == name and trace["y"]:
            return trace["y"][-1]
    return None


@dataclass(frozen=True)
class View:
    """One snapshot of a page (``read``), with its figures parsed."""

    raw: dict[str, Any]

    @property
    def stats(self) -> StatsLine | None:
        return StatsLine.parse(self.raw["stats"])

    def badges(self, n: int) -> list[Badge | None]:
        return [Badge.parse(b) for b in self.raw["badges"][:n]]

    @property
    def tree(self) -> TreeTitle | None:
        plot = self.raw["plots"]["tree"]
        return TreeTitle.parse(plot["title"]) if plot else None

    @property
    def cells(self) -> MapCells | None:
        return MapCells.parse(self.raw["plots"]["page_map"])

    @property
    def occupancy(self) -> tuple[int | None, int | None, int | None]:
        """The occupancy chart's last in use and cached, and the pool its title states."""
        plot = self.raw["plots"]["occupancy"]
        pool = re.search(r"pool of (\d+)", plot["title"]) if plot else None
        return last(plot, "in use"), last(plot, "cached (evictable)"), int(pool.group(1)) if pool else None

    @property
    def lru_length(self) -> int | None:
        return last(self.raw["plots"]["lru"], "LRU length (pages)")

    @property
    def hit_rate_percent(self) -> float | None:
        return last(self.raw["plots"]["hit_rate"], "since the engine started")

    @property
    def finished_rows(self) -> int:
        return sum(len(row) > 2 and row[2] == "finished" for row in self.raw["table"])

    def live_disagreements(self) -> list[str]:
        """Where this live view's figures contradict its own stats line (or the stats line does not read): [] once
        every view is drawn from one quiet moment of its engine."""
        stats = self.stats
        if stats is None:
            return [f"the stats line does not read: {self.raw['stats']!r}"]
        out = []
        used, cached, pool = self.occupancy
        if (used, cached, pool) != (stats.used, stats.cached, stats.n_pages):
            out.append(f"occupancy ends at in use {used}, cached {cached}, pool {pool}; the stats line: {stats}")
        if self.lru_length != stats.cached:
            out.append(f"the LRU chart ends at {self.lru_length} pages, the stats line says {stats.cached} cached")
        rate = self.hit_rate_percent
        expected = 100 * stats.hit_tokens / stats.query_tokens if stats.query_tokens else None
        if (rate is None) != (expected is None) or (rate is not None and abs(rate - expected) > 1e-6):
            out.append(f"the hit rate chart ends at {rate}%; the stats line's {stats.hit_tokens}/{stats.query_tokens}")
        tree = self.tree
        if tree is None or tree.cached != stats.cached or tree.in_use > stats.used:
            out.append(f"the tree ({tree}) does not count the stats line's pages ({stats})")
        cells = self.cells
        if cells is None or "after step" in cells.title:
            out.append(f"the page map is not live: {cells.title if cells else None}")
        elif (cells.pool, cells.cached, cells.in_use, cells.evicted) != (stats.n_pages, stats.cached, stats.used, 0):
            out.append(
                f"the page map shows a pool of {cells.pool}, {cells.cached} cached, {cells.in_use} in use and "
                f"{cells.evicted} just evicted; the stats line: {stats}"
            )
        return out


def read(page: Any) -> View:
    return View(page.evaluate(READ_JS))


def poll(page: Any, problems: Callable[[View], list[str]], timeout: float, interval: float = 0.2) -> View:
    """Read the page until ``problems`` finds none (a bounded wait: the live view lags its engine by up to a few
    seconds); fails with the last problems found."""
    deadline = time.monotonic() + timeout
    while True:
        view = read(page)
        found = problems(view)
        if not found:
            return view
        if time.monotonic() > deadline:
            raise AssertionError(f"still after {timeout} s: " + "; ".join(found))
        page.wait_for_timeout(interval * 1000)
