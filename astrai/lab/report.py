"""The ladder as files a user can attach to an issue: a self-contained HTML report (an inline SVG chart, no script,
no font or stylesheet fetched: it renders offline, anywhere) and CSV.

The chart draws one bar per rung, its length the rung's share of the prompt tokens; the part of each bar that the
rung above had and this one lost is the gap, hatched, and hovering it (an SVG ``<title>``) lists its causes.
"""

from __future__ import annotations

import csv
import io
from html import escape

from astrai.lab.ladder import CSV_HEADER, Gap, Ladder

_BAR_HEIGHT, _ROW, _LABEL, _WIDTH = 22, 34, 130, 560  # px: bar, row pitch, label column, bar of 100%
_RUNG_COLOUR, _GAIN_COLOUR, _LOSS_COLOUR = "#3b6fb6", "#4c9a57", "#d98b3a"


def ladder_csv(ladder: Ladder) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_HEADER)
    writer.writerows(ladder.csv_rows())
    return out.getvalue()


def gap_summary(gap: Gap) -> str:
    """``policy: 31,307,264 tokens (21.62%): evicted_by_policy 31,307,264``: a gap and its causes on one line."""
    causes = ", ".join(f"{cause} {tokens:,}" for cause, tokens in gap.causes)
    return f"{gap.name}: {gap.tokens:,} tokens ({gap.share:.2%}): {causes}"


def ladder_html(ladder: Ladder) -> str:
    """A whole HTML page: what was replayed, the chart, and the rungs' and gaps' tables."""
    title = f"Why is my hit rate low? {ladder.trace}"
    rules = ladder.semantics or "the replay's default"
    fleet = f", {ladder.replicas} replicas" if ladder.replicas > 1 else ""
    setting = (
        f"{ladder.requests:,} requests{fleet}, pages of {ladder.block_size} tokens, {ladder.setting}; replay "
        f"rules: {rules}"
    )
    rungs = "".join(
        f"<tr><td>{escape(r.name)}</td><td>{r.tokens:,}</td><td>{r.share:.2%}</td></tr>" for r in ladder.rungs
    )
    gaps = "".join(
        f"<tr><td>{escape(g.name)}</td><td>{escape(g.above)} → {escape(g.below)}</td><td>{g.tokens:,}</td>"
        f"<td>{g.share:.2%}</td><td>{escape(', '.join(f'{c} {t:,}' for c, t in g.causes))}</td></tr>"
        for g in ladder.gaps
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:right}}td:first-child,th:first-child,td:last-child,
th:last-child{{text-align:left}}
</style></head><body>
<h1>{escape(title)}</h1>
<p>{escape(setting)}. Each bar is a rung: prompt tokens served (or servable) as a share of all prompt tokens. The
hatched part is the gap from the rung above; hover it for its causes (tokens).</p>
{_chart(ladder)}
<h2>Rungs</h2><table><tr><th>rung</th><th>tokens</th><th>share</th></tr>{rungs}</table>
<h2>Gaps</h2><table><tr><th>gap</th><th>rungs</th><th>tokens</th><th>share</th><th>causes (tokens)</th></tr>{gaps}
</table>
<p>Made by <code>python -m astrai.lab ladder</code> (AstrAI's cache lab).</p>
</body></html>
"""


def _chart(ladder: Ladder) -> str:
    top = max(r.share for r in ladder.rungs)  # delivered may pass a rung above it (same-step sharing)
    scale = _WIDTH / max(top, 1e-9)
    height = _ROW * len(ladder.rungs) + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LABEL + _WIDTH + 260}" height="{height}" '
        f'role="img" aria-label="hit-rate ladder">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="3" height="6" fill="white" fill-opacity="0.55"/></pattern></defs>',
    ]
    gaps_below = {g.below: g for g in ladder.gaps}
    for row, rung in enumerate(ladder.rungs):
        y = 5 + row * _ROW
        parts.append(f'<text x="0" y="{y + 16}" font-size="13">{escape(rung.name)}</text>')
        parts.append(
            f'<rect x="{_LABEL}" y="{y}" width="{rung.share * scale:.1f}" height="{_BAR_HEIGHT}" '
            f'fill="{_RUNG_COLOUR}"><title>{escape(rung.name)}: {rung.tokens:,} tokens ({rung.share:.2%})</title>'
            "</rect>"
        )
        gap = gaps_below.get(rung.name)
        if gap is not None and gap.tokens != 0:
            start, end = sorted((rung.share, rung.share + gap.share))
            colour = _LOSS_COLOUR if gap.tokens > 0 else _GAIN_COLOUR
            parts.append(
                f"<g><title>{escape(gap_summary(gap))}</title>"
                f'<rect x="{_LABEL + start * scale:.1f}" y="{y}" width="{(end - start) * scale:.1f}" '
                f'height="{_BAR_HEIGHT}" fill="{colour}"/>'
                f'<rect x="{_LABEL + start * scale:.1f}" y="{y}" width="{(end - start) * scale:.1f}" '
                f'height="{_BAR_HEIGHT}" fill="url(#hatch)"/></g>'
            )
        label_x = _LABEL + max(rung.share, rung.share + (gap.share if gap else 0)) * scale + 6
        lost = f" (gap above: {gap.name} {gap.share:.2%})" if gap is not None else ""
        parts.append(f'<text x="{label_x:.1f}" y="{y + 16}" font-size="12">{rung.share:.2%}{escape(lost)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)
