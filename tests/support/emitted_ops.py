"""Op coverage counted from what programs emit: every `op_db` sample (torch's OpInfo table) and every
`module_db` module (torch's module table) run through the SDK's recorder (gradclient/trace.py, the ATen
program a forward executes) and, with `export=True`, through torch.export as the SDK calls it; the ops their
graphs call are collected and each is allowed (gradsvc/engine/graph/ops.py) or refused with a reason
(ops.REFUSED). Print the figure with

    .venv/bin/python -m tests.support.emitted_ops            # one sample per op and per module (~1 min)
    GRADSVC_TEST_ALL=1 .venv/bin/python -m tests.support.emitted_ops --export   # every sample, export too
"""

from __future__ import annotations

import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from gradclient.errors import UnsupportedModuleError
from gradclient.trace import trace_graph

from .suite import TEST_ALL


@dataclass
class Emitted:
    ops: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # op -> programs calling it
    programs: int = 0
    captured: int = 0
    failed: list[str] = field(default_factory=list)  # programs no capture took, with why


class _Sample(nn.Module):
    """One op_db sample as a module: its tensors as parameters (floating ones) and buffers."""

    def __init__(self, op, sample) -> None:
        super().__init__()
        self.op = op
        leaves, self.spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
        self.slots = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and (
                    leaf.is_floating_point() or leaf.is_complex()) and leaf.requires_grad:
                self.register_parameter(f"p{i}", nn.Parameter(leaf.detach().clone()))
                self.slots.append((True, f"p{i}"))
            elif isinstance(leaf, torch.Tensor):
                self.register_buffer(f"b{i}", leaf.detach().clone())
                self.slots.append((True, f"b{i}"))
            else:
                self.slots.append((False, leaf))

    def forward(self, dummy: torch.Tensor):
        leaves = [getattr(self, v) if is_t else v for is_t, v in self.slots]
        x, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        out = self.op(x, *args, **kwargs)
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] + [dummy]


def _record(found: Emitted, label: str, module: nn.Module, args: tuple, export: bool) -> None:
    found.programs += 1
    batched = [True] + [False] * (len(args) - 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graphs = [trace_graph(module, args, {}, batched).graph]
            if export:
                from gradclient.export import export_graph

                graphs.append(export_graph(module, args).graph)
    except (UnsupportedModuleError, Exception) as exc:  # noqa: BLE001  (a program no capture takes: counted)
        found.failed.append(f"{label}: {str(exc)[:160]}")
        return
    found.captured += 1
    for g in graphs:
        for node in g.nodes:
            found.ops[node.op].add(label)


def op_db_programs(found: Emitted, per_op: int, export: bool = False) -> None:
    from torch.testing._internal.common_methods_invocations import op_db

    dummy = torch.zeros(2, 1, dtype=torch.float64)
    for info in op_db:
        if not info.supports_autograd or torch.float64 not in info.supported_dtypes("cpu"):
            continue
        torch.manual_seed(0)
        try:
            samples = info.sample_inputs("cpu", torch.float64, requires_grad=True)
            for i, sample in zip(range(per_op), samples):
                label = f"op_db:{info.name}{'.' + info.variant_test_name if info.variant_test_name else ''}[{i}]"
                try:
                    module = _Sample(info.op, sample)
                    module(dummy)  # a sample eager itself refuses is no program
                except Exception:  # noqa: BLE001
                    continue
                _record(found, label, module, (dummy,), export)
        except Exception:  # noqa: BLE001  (a sample generator that fails on this torch)
            continue


def module_db_programs(found: Emitted, per_module: int, export: bool = False) -> None:
    from torch.testing._internal.common_modules import module_db

    for info in module_db:
        torch.manual_seed(0)
        try:
            samples = info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                              training=True)
        except Exception:  # noqa: BLE001
            continue
        kept = 0
        for i, sample in enumerate(samples):
            if kept >= per_module:
                break
            fwd = sample.forward_input
            if fwd is None or fwd.kwargs or not fwd.args or not all(isinstance(a, torch.Tensor) for a in fwd.args):
                continue
            if fwd.args[0].dim() == 0:
                continue
            try:
                c = sample.constructor_input
                module = info.module_cls(*c.args, **c.kwargs).to(torch.float64)
                module(*fwd.args)
            except Exception:  # noqa: BLE001
                continue
            kept += 1
            _record(found, f"module_db:{info.module_cls.__name__}[{i}]", module,
                    tuple(a.detach() for a in fwd.args), export)


def measure(per_op: int, per_module: int, export: bool = False) -> Emitted:
    found = Emitted()
    op_db_programs(found, per_op, export)
    module_db_programs(found, per_module, export)
    return found


def coverage(found: Emitted) -> tuple[list[str], dict[str, str], list[str]]:
    """(allowed, refused with its reason, neither) among the emitted ops."""
    from gradsvc.engine.graph.ops import OPS, REFUSED

    allowed = sorted(op for op in found.ops if op in OPS)
    refused = {op: REFUSED[op] for op in found.ops if op not in OPS and op in REFUSED}
    neither = sorted(op for op in found.ops if op not in OPS and op not in REFUSED)
    return allowed, refused, neither


def figure(found: Emitted) -> str:
    allowed, refused, neither = coverage(found)
    return (f"{len(allowed)} of {len(found.ops)} ATen ops emitted by {found.captured} op_db and module_db programs "
            f"are allowed, {len(refused)} refused with a reason, {len(neither)} neither "
            f"({found.programs - found.captured} of {found.programs} programs not captured)")


def main(argv: list[str]) -> int:
    export = "--export" in argv
    per = 1000 if TEST_ALL else 1
    found = measure(per, per, export)
    allowed, refused, neither = coverage(found)
    print(figure(found))
    for op in sorted(refused):
        print(f"  refused {op}: {refused[op][:100]} ({len(found.ops[op])} programs)")
    for op in neither:
        print(f"  NEITHER {op}: {sorted(found.ops[op])[:3]}")
    if "-v" in argv:
        for f in found.failed:
            print(f"  not captured: {f}")
    return 1 if neither else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
