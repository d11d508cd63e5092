"""Ops of a library (not ATen) that public models call and that the service runs itself, written with torch's
own ops, so that a worker needs the library no more than the client's graph does.

`torchvision.nms.default` (ops.py's LIBRARY_OPS): non-maximum suppression, which every two-stage detector's region
proposals call (`torchvision.ops.nms`, `batched_nms`). It has no gradient (it answers indices) and its output's size
depends on the values, so a graph names it with the size it had at capture (sized.py) and a run checks it. It is computed
here from its inputs, as torchvision's CPU kernel computes it (boxes by descending score, stable; each kept box
suppresses every later one whose IoU with it is above the threshold, IoU as inter / (area_i + area_j - inter)),
not held as the indices it gave at capture: a float64 run, or another device's, orders near-equal scores its own
way, and indices recorded against the capture's order would then pick other boxes.
"""

from __future__ import annotations

import torch

from ..errors import SpecError


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """The indices (int64) of the boxes (x1, y1, x2, y2) kept, by descending score (module docstring)."""
    if boxes.dim() != 2 or boxes.shape[-1] != 4 or scores.dim() != 1 or scores.shape[0] != boxes.shape[0]:
        raise SpecError("shape_mismatch", f"model.graph: op 'torchvision.nms.default' takes boxes (N, 4) and scores "
                        f"(N,); got boxes {list(boxes.shape)} and scores {list(scores.shape)}")
    if boxes.device.type == "meta":  # a node that does not say the size it had (sized.py takes it when it does)
        raise SpecError("bad_option", "model.graph: op 'torchvision.nms.default': the number of boxes it keeps depends "
                        "on their values; give the node the size its output had on this batch ('shape'), as the "
                        "SDK's recording does")
    boxes, scores = boxes.detach(), scores.detach()
    if boxes.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=boxes.device)
    order = scores.sort(stable=True, descending=True).indices
    b = boxes[order]
    x1, y1, x2, y2 = b.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    suppressed = torch.zeros(b.shape[0], dtype=torch.bool, device=b.device)
    kept = []
    for i in range(b.shape[0]):
        if suppressed[i]:
            continue
        kept.append(i)
        w = (torch.minimum(x2[i], x2) - torch.maximum(x1[i], x1)).clamp(min=0)
        h = (torch.minimum(y2[i], y2) - torch.maximum(y1[i], y1)).clamp(min=0)
        inter = w * h
        over = inter / (areas[i] + areas - inter) > iou_threshold
        over[: i + 1] = False  # a box suppresses only the ones after it in the order
        suppressed |= over
    return order[torch.tensor(kept, dtype=torch.long, device=b.device)]
