"""A run's plots as server-made SVG (no script, nothing from another host): a curve over steps, a module x step
heatmap and the strip of check verdicts, each step linking its job page. Every name is escaped here."""

from __future__ import annotations

import math
from urllib.parse import quote

from markupsafe import escape

from gradsvc.wire import RunStep

WIDTH, HEIGHT, PAD = 640, 200, 40
CELL_H = 14
LABEL_W = 160


def _ticks(lo: float, hi: float) -> str:
    return (f'<text x="{PAD - 4}" y="{PAD}" text-anchor="end">{lo if lo == hi else hi:.3g}</text>'
            f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{lo:.3g}</text>')


def curve(css_id: str, title: str, points: list[tuple[int, float]]) -> str:
    """One value per step: a polyline with a circle per step (its <title> says the step and the value)."""
    if not points:
        return f'<p class="note" id="{css_id}">No {escape(title)} recorded.</p>'
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    lo, hi = min(values), max(values)
    s0, s1 = min(steps), max(steps)

    def x(s: int) -> float:
        return PAD + (WIDTH - 2 * PAD) * ((s - s0) / (s1 - s0) if s1 > s0 else 0.5)

    def y(v: float) -> float:
        return HEIGHT - PAD - (HEIGHT - 2 * PAD) * ((v - lo) / (hi - lo) if hi > lo else 0.5)

    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
    dots = "".join(f'<circle class="point" cx="{x(s):.1f}" cy="{y(v):.1f}" r="3"><title>step {s}: {v:.6g}</title>'
                   "</circle>" for s, v in points)
    return (f'<svg id="{css_id}" class="plot" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
            f'role="img" aria-label="{escape(title)}"><text x="{PAD}" y="16">{escape(title)}</text>{_ticks(lo, hi)}'
            f'<text x="{PAD}" y="{HEIGHT - 12}">step {s0}</text>'
            f'<text x="{WIDTH - PAD}" y="{HEIGHT - 12}" text-anchor="end">step {s1}</text>'
            f'<polyline fill="none" stroke="#2563eb" stroke-width="1.5" points="{line}"/>{dots}</svg>')


def _colour(value: float, lo: float, hi: float) -> str:
    """Light to dark blue on a log scale (norms and ratios span decades)."""
    if value <= 0 or hi <= 0:
        return "#f1f5f9"
    a, b = math.log10(max(lo, 1e-30)), math.log10(hi)
    t = (math.log10(value) - a) / (b - a) if b > a else 1.0
    return f"hsl(215, 80%, {int(92 - 62 * t)}%)"


def heatmap(css_id: str, title: str, steps: list[RunStep], field: str, max_rows: int | None = None) -> str:
    """Modules (rows, in the model's order; the first `max_rows`) x steps (columns): `field` is
    module_grad_norms or update_ratio."""
    rows: dict[str, None] = {}
    for s in steps:
        rows.update(dict.fromkeys(getattr(s, field) or ()))
    if max_rows is not None and len(rows) > max_rows:
        rows = dict.fromkeys(list(rows)[:max_rows])
    values = [v for s in steps for v in (getattr(s, field) or {}).values() if v > 0]
    if not rows or not values:
        return f'<p class="note" id="{css_id}">No {escape(title)} recorded.</p>'
    lo, hi = min(values), max(values)
    cell_w = max(2.0, (WIDTH - LABEL_W) / len(steps))
    width, height = LABEL_W + cell_w * len(steps), 20 + CELL_H * len(rows)
    parts = [f'<svg id="{css_id}" class="plot heatmap" viewBox="0 0 {width:.0f} {height}" width="{width:.0f}" '
             f'height="{height}" role="img" aria-label="{escape(title)}">',
             f'<text x="0" y="12">{escape(title)} (log colour scale {lo:.3g} to {hi:.3g})</text>']
    for r, module in enumerate(rows):
        top = 20 + CELL_H * r
        parts.append(f'<text class="module" x="{LABEL_W - 4}" y="{top + CELL_H - 3}" text-anchor="end">'
                     f'{escape(module)}</text>')
        for c, s in enumerate(steps):
            v = (getattr(s, field) or {}).get(module)
            if v is None:
                continue
            parts.append(f'<rect class="cell" x="{LABEL_W + c * cell_w:.1f}" y="{top}" width="{cell_w:.1f}" '
                         f'height="{CELL_H}" fill="{_colour(v, lo, hi)}"><title>{escape(module)}, step {s.step}: '
                         f"{v:.6g}</title></rect>")
    parts.append("</svg>")
    return "".join(parts)


def verdicts(css_id: str, steps: list[RunStep]) -> str:
    """A cell per step, green where the check passed, red where it failed, grey where it was off; each links
    the step's job page."""
    cell_w = max(2.0, (WIDTH - LABEL_W) / max(len(steps), 1))
    width = LABEL_W + cell_w * len(steps)
    parts = [f'<svg id="{css_id}" class="plot strip" viewBox="0 0 {width:.0f} 24" width="{width:.0f}" height="24" '
             'role="img" aria-label="check verdicts"><text x="0" y="16">check per step</text>']
    for c, s in enumerate(steps):
        nc = s.numcheck
        verdict = "off" if nc is None or nc.passed is None else ("passed" if nc.passed else "failed")
        detail = "not checked" if verdict == "off" else f"{nc.mode} {verdict}, max rel. error {nc.max_rel_error:.2e}"
        parts.append(f'<a href="/ui/jobs/{quote(s.job_id, safe="")}"><rect class="verdict {verdict}" '
                     f'x="{LABEL_W + c * cell_w:.1f}" y="4" width="{cell_w:.1f}" height="16">'
                     f"<title>step {s.step}: {escape(detail)}</title></rect></a>")
    parts.append("</svg>")
    return "".join(parts)
