"""The grad_fn chain (`result.graph`, with `options.graph`) drawn as an SVG, on the server: no JS library."""

from __future__ import annotations

from html import escape

from gradsvc.wire import GraphNode

_ROW_H, _BOX_H, _GAP_X, _PAD, _CHAR_W = 64, 28, 16, 12, 7.2


def _depths(nodes: list[GraphNode]) -> dict[int, int]:
    """Each node's row: its longest path from a root (the loss's grad_fn), so every edge points down."""
    ids = {n.id for n in nodes}
    pointed = {c for n in nodes for c in n.next if c in ids}
    depth = {n.id: 0 for n in nodes if n.id not in pointed} or {nodes[0].id: 0}
    by_id = {n.id: n for n in nodes}
    for _ in range(len(nodes)):  # longest-path relaxation; a DAG settles within len(nodes) passes
        changed = False
        for parent in list(depth):
            for child in by_id[parent].next:
                if child in ids and depth.get(child, -1) < depth[parent] + 1 <= len(nodes):
                    depth[child] = depth[parent] + 1
                    changed = True
        if not changed:
            break
    for n in nodes:  # unreachable from a root (not expected): below the rest
        depth.setdefault(n.id, len(nodes))
    return depth


def render(nodes: list[GraphNode]) -> str:
    """SVG markup: one box per grad_fn, rows by depth, an arrow per `next` edge. Names are escaped."""
    if not nodes:
        return ""
    depth = _depths(nodes)
    rows: dict[int, list[GraphNode]] = {}
    for n in nodes:
        rows.setdefault(depth[n.id], []).append(n)
    width_of = {n.id: len(n.name) * _CHAR_W + 2 * _PAD for n in nodes}
    row_widths = {r: sum(width_of[n.id] for n in ns) + _GAP_X * (len(ns) - 1) for r, ns in rows.items()}
    total_w = max(row_widths.values()) + 2 * _GAP_X
    place: dict[int, tuple[float, float]] = {}  # id -> (centre x, top y)
    for row_index, (r, ns) in enumerate(sorted(rows.items())):
        x = (total_w - row_widths[r]) / 2
        for n in ns:
            place[n.id] = (x + width_of[n.id] / 2, _GAP_X + row_index * _ROW_H)
            x += width_of[n.id] + _GAP_X
    total_h = _GAP_X * 2 + (len(rows) - 1) * _ROW_H + _BOX_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="grad-fn-graph" role="img" width="{total_w:.0f}" '
           f'height="{total_h:.0f}" viewBox="0 0 {total_w:.0f} {total_h:.0f}">',
           "<title>grad_fn chain, from the loss down to the parameters</title>",
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    for n in nodes:
        x, y = place[n.id]
        for child in n.next:
            if child in place:
                cx, cy = place[child]
                out.append(f'<line x1="{x:.1f}" y1="{y + _BOX_H:.1f}" x2="{cx:.1f}" y2="{cy:.1f}" stroke="#555" '
                           'marker-end="url(#arrow)"/>')
    for n in nodes:
        x, y = place[n.id]
        w = width_of[n.id]
        out.append(f'<g class="grad-fn" data-id="{n.id}"><rect x="{x - w / 2:.1f}" y="{y:.1f}" width="{w:.1f}" '
                   f'height="{_BOX_H}" rx="5" fill="#eef3fb" stroke="#3b6db3"/><text x="{x:.1f}" '
                   f'y="{y + _BOX_H / 2 + 4:.1f}" text-anchor="middle" font-family="monospace" font-size="12">'
                   f"{escape(n.name)}</text></g>")
    out.append("</svg>")
    return "".join(out)
