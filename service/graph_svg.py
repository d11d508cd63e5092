"""The grad_fn chain (`result.graph`, with `options.graph`) drawn as an SVG, on the server: no JS library.

Linear in nodes and edges, and at most `max_nodes` boxes (GRADSVC_PAGE_GRAPH_NODES): a longer chain is drawn
from the loss down to that many nodes and the drawing says how many it left out, so a 6,000-step recurrent
model's 24,000-node chain costs the page milliseconds, not the event loop's next 40 seconds."""

from __future__ import annotations

from collections import deque
from html import escape

from gradsvc.wire import GraphNode

_ROW_H, _BOX_H, _GAP_X, _PAD, _CHAR_W = 64, 28, 16, 12, 7.2
_NOTE_H = 24
DEFAULT_MAX_NODES = 400


def _nearest(nodes: list[GraphNode], max_nodes: int) -> list[GraphNode]:
    """The max_nodes nodes nearest the roots (the loss's grad_fn), breadth first: what a summary draws."""
    if len(nodes) <= max_nodes:
        return nodes
    by_id = {n.id: n for n in nodes}
    pointed = {c for n in nodes for c in n.next}
    queue = deque(n.id for n in nodes if n.id not in pointed) or deque([nodes[0].id])
    kept: dict[int, None] = dict.fromkeys(queue)
    while queue and len(kept) < max_nodes:
        for child in by_id[queue.popleft()].next:
            if child in by_id and child not in kept and len(kept) < max_nodes:
                kept[child] = None
                queue.append(child)
    return [by_id[i] for i in list(kept)[:max_nodes]]


def _depths(nodes: list[GraphNode]) -> dict[int, int]:
    """Each node's row: its longest path from a root (the loss's grad_fn), so every edge points down. Kahn's
    topological order: each node and edge is visited once."""
    ids = {n.id for n in nodes}
    by_id = {n.id: n for n in nodes}
    parents = dict.fromkeys(ids, 0)
    for n in nodes:
        for child in n.next:
            if child in ids:
                parents[child] += 1
    depth = {i: 0 for i, k in parents.items() if k == 0}
    ready = deque(depth)
    while ready:
        node = by_id[ready.popleft()]
        for child in node.next:
            if child not in ids:
                continue
            depth[child] = max(depth.get(child, 0), depth[node.id] + 1)
            parents[child] -= 1
            if parents[child] == 0:
                ready.append(child)
    below = max(depth.values(), default=-1) + 1
    for n in nodes:  # on a cycle (not expected from autograd): below the rest
        depth.setdefault(n.id, below)
    return depth


def render(nodes: list[GraphNode], max_nodes: int = DEFAULT_MAX_NODES) -> str:
    """SVG markup: one box per grad_fn, rows by depth, an arrow per `next` edge. Names are escaped. Past
    max_nodes, the nodes nearest the loss and a line saying how many more there are."""
    if not nodes:
        return ""
    total = len(nodes)
    nodes = _nearest(nodes, max_nodes)
    depth = _depths(nodes)
    rows: dict[int, list[GraphNode]] = {}
    for n in nodes:
        rows.setdefault(depth[n.id], []).append(n)
    left_out = total - len(nodes)
    width_of = {n.id: len(n.name) * _CHAR_W + 2 * _PAD for n in nodes}
    row_widths = {r: sum(width_of[n.id] for n in ns) + _GAP_X * (len(ns) - 1) for r, ns in rows.items()}
    total_w = max(max(row_widths.values()) + 2 * _GAP_X, 560 if left_out else 0)
    place: dict[int, tuple[float, float]] = {}  # id -> (centre x, top y)
    for row_index, (r, ns) in enumerate(sorted(rows.items())):
        x = (total_w - row_widths[r]) / 2
        for n in ns:
            place[n.id] = (x + width_of[n.id] / 2, _GAP_X + row_index * _ROW_H)
            x += width_of[n.id] + _GAP_X
    total_h = _GAP_X * 2 + (len(rows) - 1) * _ROW_H + _BOX_H + (_NOTE_H if left_out else 0)
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
    if left_out:
        out.append(f'<text class="grad-fn-summary" x="{_GAP_X}" y="{total_h - _GAP_X / 2:.0f}" font-size="12">'
                   f"the {len(nodes)} nodes nearest the loss of {total}; {left_out} more are in the job's "
                   "result.graph (GET /jobs/{id})</text>")
    out.append("</svg>")
    return "".join(out)
