"""Kinks within reach of rounding, for the returned gradients' tolerance (graph models): a ReLU (or clamp, hardtanh,
hardsigmoid, threshold) input so close to its kink that float32's rounding may put it on the other side, where the
float32 gradient then takes the other branch's slope than float64's. No margin over a simulated rounding covers
that: the rounding moves a value by a millionth, the branch changes its slope by one. So the check finds those
elements and measures what taking the other branch does to the gradient:

1. `record`: a float64 forward (the check's own), each kink op's input as it is;
2. `mark`, while the rounding simulation runs: an element is within reach when its distance to the nearest kink
   is at most KINK_REACH times how far the simulated rounding moved it there; the simulation keeps it on
   float64's branch (what it measures, times ARITHMETIC_SAFETY, is the smooth rounding);
3. `flip`: a float64 forward and backward with those elements on the other branch (their values as they are,
   their slope the other side's), whose gradient's distance from float64's is what a branch flip can do.

`tolerances.kink_tolerances` widens each tensor's tolerance to KINK_MARGIN x that distance."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

# An element within this many of its simulated roundings (the distance rounding moved it) of a kink is within reach:
# the simulation's one draw against float32's real accumulation, as ARITHMETIC_SAFETY allows for.
KINK_REACH = 16

_SCALAR = (int, float)
_KEEP = object()  # _hooked: the model's visit left as it is


def kinks_of(name: str, args: tuple, kwargs: dict) -> list[float] | None:
    """The kinks of an elementwise piecewise op (its first argument's values where its slope changes), None for
    any other op or for bounds that are tensors."""
    base = name.rsplit(".", 1)[0].removesuffix("_")
    if base in ("aten.relu", "aten.leaky_relu"):
        return [0.0]
    if base in ("aten.hardsigmoid", "aten.hardswish"):
        return [-3.0, 3.0]
    rest = [*args[1:], *kwargs.values()]
    if base == "aten.threshold":
        return [float(args[1])] if len(args) > 1 and isinstance(args[1], _SCALAR) else None
    if base == "aten.hardtanh":
        bounds = (args[1] if len(args) > 1 else kwargs.get("min_val", -1.0),
                  args[2] if len(args) > 2 else kwargs.get("max_val", 1.0))
        return [float(b) for b in bounds] if all(isinstance(b, _SCALAR) for b in bounds) else None
    if base in ("aten.clamp", "aten.clamp_min", "aten.clamp_max") and not name.endswith(".Tensor"):
        if any(isinstance(a, torch.Tensor) for a in rest):
            return None
        found = [float(a) for a in rest if isinstance(a, _SCALAR)]
        return found or None
    return None


class NearKinks:
    """The three passes of the module docstring over a GraphModel's steps."""

    def __init__(self, steps: list) -> None:
        self.steps = steps
        self.kinks: dict[int, list[float]] = {}
        self.exact: dict[int, torch.Tensor] = {}  # a kink op's input in the float64 forward, by step
        self.near: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (within reach, its nearest kink), by step
        self.extra: dict[int, tuple[tuple, dict]] = {}  # a kink op's other arguments (bounds, slopes), by step
        self._inputs: dict[int, torch.Tensor] = {}  # this run's input of the step running now (before it ran)
        # A comparison's value (a boolean node's) in the float64 forward: passes 2 and 3 take it as it was. Their
        # perturbations would otherwise break its ties (FCOS's degenerate boxes at initialisation: `x2 > x1` with
        # x2 == x1) and change a mask that selects rows, and the shapes that follow it.
        self.decisions: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator[None]:
        """Pass 1: the forward run in the block is the float64 one; each kink op's input kept, and each decision."""
        with self._hooked(model, before=self._record, visit=self._decided):
            yield
        self._inputs = {}

    def _record(self, i: int, args: Any, kwargs: Any) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        kinks = kinks_of(self.steps[i].op.name, tuple(args), dict(kwargs))
        if kinks is not None:
            self.kinks[i], self.exact[i], self.extra[i] = kinks, x.detach().clone(), (tuple(args[1:]), dict(kwargs))

    def _decided(self, i: int, out: Any, args: Any, kwargs: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool and not self.steps[i].op.inplace:
            self.decisions[i] = out.clone()

    def _as_decided(self, i: int, out: Any) -> torch.Tensor | None:
        decided = self.decisions.get(i)
        return decided if decided is not None and isinstance(out, torch.Tensor) and out.shape == decided.shape else None

    @contextlib.contextmanager
    def simulating(self, model: torch.nn.Module) -> Iterator[None]:
        """Pass 2's hooks: the rounding simulation's visit calls `mark`."""
        with self._hooked(model, before=self._before, visit=_KEEP):
            yield

    def mark(self, i: int, out: Any, args: Any, kwargs: Any) -> Any:
        """Pass 2, from the rounding simulation's visit after step `i`: its elements within reach of a kink, kept on
        float64's branch (the simulation measures the smooth rounding; `flip` the branch): the value to go on
        with, None where nothing is within reach. A decision (a boolean node) goes on as float64 took it."""
        if i in self.decisions:
            return self._as_decided(i, out)
        x, exact = self._inputs.pop(i, None), self.exact.get(i)
        if x is None or exact is None or x.shape != exact.shape:
            return None
        moved = (x.detach() - exact).abs()
        kinks = torch.tensor(self.kinks[i], dtype=exact.dtype, device=exact.device)
        distance = (exact.unsqueeze(-1) - kinks).abs()
        nearest = kinks[distance.argmin(-1)]
        within = (distance.min(-1).values <= KINK_REACH * moved) & (moved > 0)
        if not bool(within.any()):
            return None
        self.near[i] = (within, nearest)
        return self._branch(i, out, x, within, exact, args, kwargs)

    def flip(self, i: int, out: Any, args: Any, kwargs: Any) -> Any:
        """Pass 3, as a visit: the elements within reach at step `i` on the other branch, a decision as float64 took
        it; None elsewhere."""
        if i in self.decisions:
            return self._as_decided(i, out)
        near, x = self.near.get(i), self._inputs.pop(i, None)
        if near is None or x is None:
            return None
        within, nearest = near
        return self._branch(i, out, x, within, 2 * nearest - x.detach(), args, kwargs)  # the kink's other side

    def _branch(self, i: int, out: Any, x: torch.Tensor, within: torch.Tensor, at: torch.Tensor, args: Any,
                kwargs: Any) -> Any:
        """`out` with the elements `within` given the op's slope at `at` (their values as they are)."""
        if not isinstance(out, torch.Tensor) or out.shape != x.shape:
            return None
        with torch.enable_grad():
            point = at.detach().clone().requires_grad_(True)
            y = self.steps[i].op.fn(point.clone(), *list(args)[1:], **dict(kwargs))
            slope, = torch.autograd.grad(y.sum(), point)
        return torch.where(within, out.detach() + slope * (x - x.detach()), out)

    @contextlib.contextmanager
    def flipping(self, model: torch.nn.Module) -> Iterator[None]:
        """Pass 3: the forward run in the block takes the other branch at every element within reach."""
        with self._hooked(model, before=self._before, visit=self.flip):
            yield

    def _before(self, i: int, args: Any, kwargs: Any) -> None:
        if i in self.exact:
            x = args[0]
            # an in-place op overwrites its input: a differentiable copy of it, taken before, carries its slope
            self._inputs[i] = x.clone() if self.steps[i].op.inplace else x

    @contextlib.contextmanager
    def _hooked(self, model: torch.nn.Module, *, before: Any, visit: Any) -> Iterator[None]:
        saved = model.before, model.visit
        model.before = before
        if visit is not _KEEP:
            model.visit = visit
        try:
            yield
        finally:
            model.before, model.visit = saved


class AtKinks:
    """The elements of piecewise ops exactly at a kink in the float64 forward (a ReLU reading the exact zeros of a
    zero-initialised norm plus a ReLU's zeros: timm's BoTNet and HaloNet), held on autograd's own branch there
    in every evaluation of the check: linear in their input, with the value and slope autograd takes at the
    kink. A difference across such an element otherwise measures the mean of the two branches (a ReLU's 1/2)
    where autograd takes one (0), and in a direction many of them cancel in one-sided differences too, so that
    kinks.py cannot tell them from a wrong gradient. Autograd's gradient is unchanged by the hold."""

    def __init__(self, near: NearKinks) -> None:
        self.steps = near.steps
        self.at: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pre: dict[int, torch.Tensor] = {}
        for i, x in near.exact.items():
            kinks = torch.tensor(near.kinks[i], dtype=x.dtype, device=x.device)
            hit = (x.unsqueeze(-1) == kinks).any(-1)
            if bool(hit.any()):
                rest, kwargs = near.extra[i]
                with torch.enable_grad():
                    point = x.clone().requires_grad_(True)
                    y = self.steps[i].op.fn(point.clone(), *rest, **kwargs)
                    slope, = torch.autograd.grad(y.sum(), point)
                self.at[i] = (hit, x, y.detach(), slope)

    def before(self, i: int, args: Any, kwargs: Any) -> None:
        if i in self.at and self.steps[i].op.inplace:
            self._pre[i] = args[0].clone()  # an in-place op overwrites its input

    def visit(self, i: int, out: Any, args: Any, kwargs: Any) -> Any:
        at = self.at.get(i)
        if at is None:
            return None
        x = self._pre.pop(i, None) if self.steps[i].op.inplace else args[0]
        hit, x0, y0, slope = at
        if x is None or not isinstance(out, torch.Tensor) or out.shape[-x0.dim():] != x0.shape:
            return None
        return torch.where(hit, y0 + slope * (x - x0), out)
