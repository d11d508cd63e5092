"""A result as people read it: a per-layer table in torchinfo's style, and a bar chart (matplotlib)."""

from __future__ import annotations

from typing import Any

from gradsvc.wire import ITEMSIZE


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _label(row: Any) -> str:
    """A memory row as people name it: "2 (Linear)", or "(root) (Block)" for a graph model's own ops."""
    return f"{row.name or '(root)'} ({row.type})"


def summary(result: Any) -> str:
    """The per-layer (per-module for graph models) table: type, output shape, parameters, saved bytes
    and their share of the total; then the numerical check and the timings."""
    itemsize = ITEMSIZE.get(result.dtype, 4)
    lines: list[str] = []
    memory = result.memory
    header = f"{'Layer (type)':<34} {'Output shape':<20} {'Param #':>10} {'Saved for backward':>19} {'Share':>6}"
    rule = "=" * len(header)
    lines += [rule, header, rule]
    total_params = 0
    if memory is not None:
        total = memory.saved_bytes_total or 1
        for row in memory.layers:
            params = row.parameter_bytes // itemsize
            total_params += params
            shape = "" if row.output_shape is None else str(list(row.output_shape))
            name = _label(row)
            lines.append(f"{name[:34]:<34} {shape[:20]:<20} {params:>10,} {_bytes(row.saved_bytes):>19} "
                         f"{100 * row.saved_bytes / total:>5.1f}%")
        lines.append(rule)
        lines.append(f"Saved for backward: {_bytes(memory.saved_bytes_total)}"
                     + (f"; device peak: {_bytes(memory.device_peak_bytes)}" if memory.device_peak_bytes else ""))
    else:
        lines.append("(memory was not recorded: options.memory=false)")
        lines.append(rule)
    lines.append(f"Parameters: {result.parameter_count:,} ({result.dtype}); loss {result.loss:.6g}; "
                 f"device {result.device}; micro-batches {result.micro_batches}")
    check = result.numcheck
    if check is None or check.passed is None:
        lines.append("Numerical check: off (the gradients were not checked)")
    else:
        verdict = "passed" if check.passed else "FAILED"
        text = (f"Numerical check ({check.mode}, float64, {check.evaluations} evaluations): {verdict}; "
                f"max rel error {check.max_rel_error:.2e} (tolerance {check.tolerance:.0e})")
        returned = getattr(check, "returned_max_rel_error", None)
        if returned is not None:
            text += (f"; returned gradients {returned:.2e} (tolerance "
                     f"{getattr(check, 'returned_tolerance', 0.0):.0e})")
        lines.append(text)
    t = result.timings
    lines.append(f"Timings (ms): queue {t.queue_ms:.2f}, forward {t.forward_ms:.2f}, backward {t.backward_ms:.2f}, "
                 f"numcheck {t.numcheck_ms:.2f}, total {t.total_ms:.2f}")
    lines.append(rule)
    return "\n".join(lines)


def plot(result: Any, path: str | None = None):
    """Saved bytes per layer and the phase timings as two bar charts; saved to `path` (PNG, ...) when
    given. Returns the matplotlib Figure. Needs matplotlib (`pip install 'gradsvc[plot]'`)."""
    try:
        import matplotlib

        if path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("result.plot() needs matplotlib: pip install 'gradsvc[plot]'") from exc
    rows = result.memory.layers if result.memory is not None else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.35 * len(rows) + 1.5)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    names = [_label(r) for r in rows]
    left.barh(names, [r.saved_bytes / 1024 for r in rows], color="#4c72b0")
    left.invert_yaxis()
    left.set_xlabel("KiB saved for backward")
    left.set_title("Activation memory per layer")
    t = result.timings
    phases = {"queue": t.queue_ms, "forward": t.forward_ms, "backward": t.backward_ms, "numcheck": t.numcheck_ms,
              "total": t.total_ms}
    right.barh(list(phases), list(phases.values()), color="#dd8452")
    right.invert_yaxis()
    right.set_xlabel("ms")
    right.set_title("Phase timings")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig
