"""A recorded program (trace.py) run again in this process, on the module's own tensors: to say whether a new batch
keeps its guards (`check_guards`, so that the SDK reuses the graph), and to verify a recording before it is sent
(`verify_recording`): its outputs on the batch equal the module's, and, asked for, so do the gradients of its
loss, so that a recording that lost a dependency is refused with a reason instead of answered."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .errors import UnsupportedModuleError
from .module_state import restore, snapshot, state_of
from .trace import Traced, _is_ref, _tensor_or_none, _wire_name


def check_guards(traced: Traced, module: nn.Module, xs: list[torch.Tensor]) -> bool:
    """Whether the traced graph is this batch's program: the inputs' shapes and dtypes, then (when the graph read
    values) its calls replayed on this batch up to the last read, under no_grad, each read compared."""
    if len(xs) != len(traced.guards.inputs):
        return False
    for x, (shape, dtype) in zip(xs, traced.guards.inputs):
        if list(x.shape) != shape or str(x.dtype).removeprefix("torch.") != dtype:
            return False
    if traced.guards.constants:
        return False
    if not traced.guards.values and not traced.guards.sizes:
        return True
    return _replay_holds(traced, module, xs)


def _env(traced: Traced, module: nn.Module, xs: list[torch.Tensor]) -> dict[str, Any]:
    """The values a replay starts from: the module's tensors by their graph names, the inputs, the constants."""
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    env: dict[str, Any] = {_wire_name(n, params): t for n, t in state_of(module).items()}
    env.update({name: x.detach().clone() for name, x in zip(traced.input_names, xs)})
    env.update(traced.constants)
    return env


def _value(env: dict[str, Any], a: Any) -> Any:
    if _is_ref(a):
        return env[a[1]]
    if isinstance(a, (list, tuple)):
        return type(a)(_value(env, x) for x in a)
    return a


def _replay_holds(traced: Traced, module: nn.Module, xs: list[torch.Tensor]) -> bool:
    state = state_of(module)
    env = _env(traced, module, xs)
    sized = [i for i, c in enumerate(traced.calls) if c.shape is not None]
    last = max([n for n, _ in traced.reads] + [i + 1 for i in sized] + [0])
    saved = {n: t.detach().clone() for n, t in state.items()
             if traced.state_kinds.get(n) == "buffer" and t.layout == torch.strided}
    reads = list(traced.reads)

    def reads_hold(before: int) -> bool:
        while reads and reads[0][0] <= before:
            _, (func, args, kwargs, value) = reads.pop(0)
            got = func(*_value(env, args), **{k: _value(env, v) for k, v in kwargs.items()})
            if (bool(got) != value) if isinstance(value, bool) else got != value:
                return False
        return True

    try:
        with torch.no_grad():
            for i, c in enumerate(traced.calls[:last]):
                if not reads_hold(i):
                    return False
                env[c.name] = c.func(*_value(env, c.args), **{k: _value(env, v) for k, v in c.kwargs.items()})
                if c.shape is not None and list(env[c.name].shape) != c.shape:
                    return False
            return reads_hold(last)
    except Exception:  # noqa: BLE001  (a replay that cannot run is a program that changed: capture again)
        return False
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                state[n].copy_(t)


def _objective(outputs: list[torch.Tensor]) -> torch.Tensor:
    """One scalar of a forward's outputs to differentiate: the first output when it is a floating scalar (a loss),
    else every floating output summed."""
    floats = [o for o in outputs if o.is_floating_point() or o.is_complex()]
    if floats and floats[0].dim() == 0:
        return floats[0].real if floats[0].is_complex() else floats[0]
    return sum((o.real if o.is_complex() else o).sum() for o in floats)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not (got.is_floating_point() or got.is_complex()):
        return bool(torch.equal(got, want))
    scale = float(want.abs().max()) if want.numel() else 0.0
    tol = 64 * torch.finfo(want.real.dtype if want.is_complex() else want.dtype).eps
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * max(scale, 1e-30), equal_nan=True))


def _close_gradient(got: torch.Tensor, want: torch.Tensor, scale: float) -> bool:
    """A recording's gradient against the module's: the same ops forward, but autograd's formulas for what eager
    ran fused (attention, a norm) round otherwise backward, so within 1e-3 of the model's gradient scale in float32
    (1e-9 in float64); a lost dependency is off by a part of the gradient itself."""
    if got.shape != want.shape:
        return False
    got, want = got.to_dense(), want.to_dense()  # a sparse parameter's gradient
    tol = 1e-9 if want.dtype == torch.float64 else 1e-3
    return bool(((got - want).abs() <= tol * max(scale, 1e-30) + tol * want.abs()).all())


def verify_recording(traced: Traced, module: nn.Module, args: tuple, kwargs: dict, gradients: bool = False) -> None:
    """The recording replayed on this batch against the module's own forward, both from the same random state: the
    outputs equal (and, with `gradients`, the gradients of their loss by every trainable parameter); else
    UnsupportedModuleError naming the first that differs. The module, its buffers and the RNG are left as found."""
    if traced.guards.constants:
        # Tensors the forward made outside torch's ops (numpy's draws among them) are this call's values: a second
        # forward would make others, and its outputs would differ from a recording that is right for this call.
        if traced.functions:  # nor can a Function's backward be checked against the recording's gradient
            raise UnsupportedModuleError(_function_reason(traced, "cannot be checked (the forward makes tensors "
                                                                  "outside torch's ops, which a second run redraws)"))
        return
    gradients = gradients or bool(traced.functions)
    snap = snapshot(module)
    xs = pytree.tree_leaves((args, kwargs))
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    rng = torch.random.get_rng_state()
    try:
        eager = _outputs(module, args, kwargs)
        restore(module, snap)  # restore() hands the snapshot's copies to the module: take new ones for the end
        snap = snapshot(module)
        torch.random.set_rng_state(rng)
        env = _env(traced, module, xs)
        with torch.set_grad_enabled(gradients):
            for c in traced.calls:
                env[c.name] = c.func(*_value(env, c.args), **{k: _value(env, v) for k, v in c.kwargs.items()})
            replayed = [env[o["node"]] for o in traced.graph.outputs]
        if len(replayed) != len(eager):
            raise UnsupportedModuleError(f"the recording returns {len(replayed)} tensors where the module returns "
                                         f"{len(eager)}; it cannot be sent as it is")
        for i, (got, want) in enumerate(zip(replayed, eager)):
            if not _close(got.detach(), want.detach()):
                raise UnsupportedModuleError(f"the recording's output {i} differs from the module's on this batch: "
                                             "the forward computed something the recording did not write down")
        if gradients and params:
            names = list(params)
            want, got = _grads(_objective(eager), params), _grads(_objective(replayed), params)
            scale = max((float(w.to_dense().abs().max()) for w in want if w.numel()), default=0.0)
            for name, g, w in zip(names, got, want):
                # a custom Function's backward held to its forward's derivative as closely as the outputs: a
                # surrogate gradient (YOSO's, a straight-through estimator's) may differ from it by little
                if not (_close(g, w) if traced.functions else _close_gradient(g, w, scale)):
                    raise UnsupportedModuleError(_function_reason(traced, f"differs from the recording's for {name!r} "
                                                 "on this batch (a straight-through or surrogate gradient)")
                                                 if traced.functions else
                                                 f"the recording's gradient of {name!r} differs from the module's on "
                                                 "this batch: it lost a dependency the forward has")
    finally:
        restore(module, snap)
        torch.random.set_rng_state(rng)


def _outputs(forward: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `forward` returns on copies of the inputs, in order, with grad on (as a recording or an export
    ran it: a forward may take a gradient itself)."""
    with torch.enable_grad():
        c_args, c_kwargs = pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                                           (args, kwargs))
        return [o for o in pytree.tree_leaves(pytree.tree_map(_tensor_or_none, forward(*c_args, **c_kwargs)))
                if isinstance(o, torch.Tensor)]


def export_differs(program: "torch.export.ExportedProgram", module: nn.Module, args: tuple, kwargs: dict) -> str:
    """"" when the exported program's outputs on this batch equal the module's own forward's (both from the same
    random state), else what differs: export traces the forward symbolically, and a library that takes another
    path while traced (`torch.compiler.is_compiling()`) can compute something else than it runs. The module, its
    buffers and the RNG are left as found."""
    snap, rng = snapshot(module), torch.random.get_rng_state()
    # restore() gives the module its values back in new memory; what the capture took before (the graph's weights,
    # aliases of the module's tensors) still reads the old, which a forward updating buffers in place moved
    params = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    held = [(t.detach(), t.detach().clone()) for n, t in state_of(module).items()
            if n not in params and t.layout == torch.strided]
    try:
        try:
            eager = _outputs(module, args, kwargs)
        except Exception:  # noqa: BLE001  (the module fails on these values, token ids past its embedding, say:
            return ""  # nothing to compare, and the service's checks say what is wrong with the batch)
        restore(module, snap)
        snap = snapshot(module)
        torch.random.set_rng_state(rng)
        exported = _outputs(program.module(), args, kwargs)
    except Exception as exc:  # noqa: BLE001  (the exported program does not run where the module does)
        return f"the exported program fails on this batch ({type(exc).__name__}: {str(exc)[:200]})"
    finally:
        restore(module, snap)
        torch.random.set_rng_state(rng)
        with torch.no_grad():
            for alias, value in held:
                if not torch.equal(alias, value):
                    alias.copy_(value)
    if len(exported) != len(eager):
        return f"the exported program returns {len(exported)} tensors where the module returns {len(eager)}"
    for i, (got, want) in enumerate(zip(exported, eager)):
        if not _close(got.detach(), want.detach()):
            return f"the exported program's output {i} differs from the module's on this batch"
    return ""


def _grads(objective: torch.Tensor, params: dict) -> tuple:
    """d objective / d each parameter, zeros where none depends on it (nothing does when the objective has no
    gradient at all: a forward whose Function takes no tensor that trains)."""
    if not objective.requires_grad:
        return tuple(torch.zeros_like(p) for p in params.values())
    return torch.autograd.grad(objective, list(params.values()), allow_unused=True, materialize_grads=True)


def _function_reason(traced: Traced, what: str) -> str:
    return (f"the forward calls the custom autograd Function(s) {', '.join(traced.functions)} and torch.export cannot "
            f"capture the module; the recording holds their forward's ops, so it differentiates their forward, and "
            f"their own backward {what}. Make the rest of forward exportable (an exported graph keeps a Function's "
            "backward), or write the Function's math with torch ops")
