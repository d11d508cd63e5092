"""The input validation layer specs and graphs share: the request's losses, targets, options (validate_*), HVP
vector and weights decoded and validated against the model (its output on meta, its parameters), and the options
that split the batch refused where the model's output rows do not follow the batch's. ("check" in the engine
means the numerical check alone.)"""

from __future__ import annotations

import msgspec
import torch
from torch import nn

from gradsvc.wire import (PER_EXAMPLE_DIAGNOSTICS, CurvatureOptions, GradientRequest, LossSpec, Options, Tensor,
                          is_tensor)

from . import tensors
from .config import EngineConfig
from .diagnostics import lanczos
from .errors import SpecError
from .losses import OWN_LOSS, LossTerm, make_term, own_term, prepare_target
from .prepared import Batch


def loss_terms(request: GradientRequest) -> list[LossTerm]:
    if request.losses is not None:
        if request.loss is not None:
            raise SpecError("bad_loss", "give either 'loss' or 'losses', not both")
        if not request.losses:
            raise SpecError("bad_loss", "'losses' is empty; give at least one loss or use 'loss'")
        terms = []
        for i, spec in enumerate(request.losses):
            name = spec.name or f"loss{i}"
            if any(t.name == name for t in terms):
                raise SpecError("bad_loss", f"two losses are named {name!r}; give each a distinct 'name'", loss=name)
            if spec.output is not None:
                raise SpecError("bad_loss", f"losses[{i}]: 'output' (the model's own loss) stands alone; give it as "
                                "'loss', not in 'losses'", loss=name)
            terms.append(make_term(name, spec.type, spec.reduction, spec.weight, spec.target))
        return terms
    loss = request.loss if request.loss is not None else "cross_entropy"
    if loss == OWN_LOSS or (isinstance(loss, LossSpec) and (loss.type == OWN_LOSS or loss.output is not None)):
        return [own_term(loss)]
    if isinstance(loss, str):
        return [make_term("loss", loss, "mean", 1.0, None)]
    assert isinstance(loss, LossSpec)
    return [make_term(loss.name or "loss", loss.type, loss.reduction, loss.weight, None)]


def _target_for(term: LossTerm, targets, *, max_elements: int, shape_only: bool) -> torch.Tensor:
    if isinstance(targets, dict) and not is_tensor(targets):
        key = term.target or term.name
        if key not in targets:
            raise SpecError("bad_target", f"{term.label} ({term.type}) needs targets[{key!r}]; targets has "
                            f"{sorted(targets)}. Name it in the loss's 'target' field", loss=term.name)
        raw = targets[key]
        where = f"targets.{key}"
    else:
        if term.target is not None:
            raise SpecError("bad_target", f"{term.label} names target {term.target!r}, but 'targets' is a "
                            "single tensor; send an object of named targets", loss=term.name)
        raw, where = targets, "targets"
    if raw is None:
        raise SpecError("bad_target", f"{term.label} ({term.type}) needs targets; add 'targets' to the request",
                        loss=term.name)
    return tensors.decode(dense_only(as_tensor_value(raw, where), where), where=where, max_elements=max_elements,
                          shape_only=shape_only)


def dense_only(value, where: str):
    """`value` unless it is a sparse tensor object, which only a graph's sparse input takes."""
    if isinstance(value, Tensor) and value.layout is not None:
        raise SpecError("bad_tensor", f"{where}: a {value.layout!r} tensor; only a graph model's input declared "
                        "sparse takes one, everything else is dense: send 'data' or 'b64' without 'layout'",
                        where=where)
    return value


def decode_targets(request: GradientRequest, terms: list[LossTerm], out: torch.Tensor, dtype: torch.dtype,
             max_elements: int, shape_only: bool) -> dict[str, torch.Tensor]:
    """Each loss term's target, checked against the model's output (its shape and the loss's rules, not
    the inputs' batch size: every-position LM logits (batch*seq, vocab) take targets (batch*seq,)). The
    model's own loss ("output") takes none."""
    if any(t.type == OWN_LOSS for t in terms):
        if request.targets is not None:
            raise SpecError("bad_target", f"loss {OWN_LOSS!r} differentiates the model's own first output, which "
                            "takes no targets; leave 'targets' out (pass labels to the model as an input instead)")
        if out.numel() != 1:
            raise SpecError("bad_loss", f"loss {OWN_LOSS!r} differentiates the model's first output, which must be "
                            f"a scalar (a loss), but it has shape {list(out.shape)}; return the loss first (a Hugging "
                            "Face model returns .loss first when given labels=), or use a built-in loss",
                            output_shape=list(out.shape))
        return {}
    return {t.name: prepare_target(t, out, _target_for(t, request.targets, max_elements=max_elements,
                                                    shape_only=shape_only), dtype)
            for t in terms}


def splits(opts: Options, rows: int) -> list[str]:
    """The options of this request that split the batch into parts of rows."""
    out = []
    if opts.micro_batch is not None and opts.micro_batch < rows:
        out.append("options.micro_batch")
    if per_example_option(opts):
        out.append(per_example_option(opts))
    if isinstance(opts.shards, int) and opts.shards > 1:  # "auto" is checked with its count (validate_shardable)
        out.append("options.shards")
    return out


def refuse_own_loss_split(opts: Options, terms: list[LossTerm], rows: int) -> None:
    split = splits(opts, rows)
    if split and any(t.type == OWN_LOSS for t in terms):
        raise SpecError("bad_option", f"{split[0]}: loss {OWN_LOSS!r} is one scalar the model computes over the "
                        "whole batch, which the service cannot split into parts of the batch; remove "
                        f"{split[0]}, or return per-example outputs and use a built-in loss", option=split[0])


def per_example_option(opts: Options) -> str | None:
    """The option of this request that needs each example's own gradient (None when none does)."""
    if opts.per_sample != "off":
        return "options.per_sample"
    wanted = [d for d in opts.diagnostics if d in PER_EXAMPLE_DIAGNOSTICS]
    if wanted:
        return f"options.diagnostics {wanted[0]!r}"
    if opts.clip is not None and opts.clip.per_sample:
        return "options.clip.per_sample"
    return None


def rows_per_example(opts: Options, inputs: Batch, out: torch.Tensor,
                      out_batch: tuple[int, int] | None, split_by: str | None = None) -> int | None:
    """How many output rows each batch row owns, when the output's rows follow the batch's in order
    (`out_batch` is where the batch sits in the output: (dim, rows per example)); refuses an option that
    splits the batch when they do not (a part of the batch would not know its targets' rows). `split_by`: what
    else splits it (a session's options.workers)."""
    n = inputs.rows
    k = None
    if out_batch is not None and out_batch[0] == 0 and out.dim() >= 1 and out.shape[0] == n * out_batch[1]:
        k = out_batch[1]
    split = splits(opts, n)
    if not split and split_by and k is None and out.dim() >= 1 and n and out.shape[0] % n == 0:
        return out.shape[0] // n  # each member's part normalises by its own rows (DDP's rule): rows in order suffice
    split = split or ([split_by] if split_by else [])
    if not split:
        return k
    if not any(inputs.batched):
        raise SpecError("bad_option", f"{split[0]}: no input of the model carries a batch dimension, so there are "
                        f"no rows to split; remove {split[0]}", option=split[0])
    if k is None:
        raise SpecError("bad_option", f"{split[0]}: the model's output {list(out.shape)} has no rows that map to "
                        f"the batch's {n} rows in order (its first dimension is neither the batch nor batch x "
                        "positions), so the targets cannot be split with the inputs; remove "
                        f"{split[0]}", option=split[0], output_shape=list(out.shape), rows=n)
    return k


def validate_options(opts: Options, config: EngineConfig, batch: int, top_layers: int, names: list[str]) -> set[str]:
    def bad(msg: str, **detail) -> None:
        raise SpecError("bad_option", msg, **detail)

    if not (0 < opts.numcheck_eps < 1):
        bad(f"options.numcheck_eps={opts.numcheck_eps} must lie in (0, 1); 1e-6 suits float64",
            option="numcheck_eps", value=opts.numcheck_eps)
    if opts.numcheck_samples is not None and opts.numcheck_samples < 1:
        bad("options.numcheck_samples must be at least 1", option="numcheck_samples", value=opts.numcheck_samples)
    if not (opts.numcheck_tolerance > 0):
        bad("options.numcheck_tolerance must be positive", option="numcheck_tolerance", value=opts.numcheck_tolerance)
    if not (1 <= opts.timing_repeat <= config.max_timing_repeat):
        bad(f"options.timing_repeat must lie in [1, {config.max_timing_repeat}], got {opts.timing_repeat}",
            option="timing_repeat", value=opts.timing_repeat, max=config.max_timing_repeat)
    if opts.micro_batch is not None and not (1 <= opts.micro_batch):
        bad(f"options.micro_batch must be at least 1, got {opts.micro_batch}", option="micro_batch",
            value=opts.micro_batch)
    if opts.checkpoint_segments is not None and not (1 <= opts.checkpoint_segments <= top_layers):
        bad(f"options.checkpoint_segments must lie in [1, {top_layers}] (the number of top-level layers), "
            f"got {opts.checkpoint_segments}", option="checkpoint_segments", value=opts.checkpoint_segments,
            max=top_layers)
    frozen = set()
    exact = set(names)
    for prefix in opts.freeze:
        # A parameter's own name (what the SDK sends for a module's frozen parameters) is found without a scan
        # (a frozen GPT-2 names ~60: the scan took a millisecond a request); a module prefix takes its parameters.
        hit = [prefix] if prefix in exact else [n for n in names if n.startswith(prefix.rstrip(".") + ".")]
        if not hit:
            bad(f"options.freeze: prefix {prefix!r} matches no parameter; parameters are {names[:8]}"
                f"{' ...' if len(names) > 8 else ''}", option="freeze", prefix=prefix)
        frozen.update(hit)
    if names and len(frozen) == len(names):
        bad("options.freeze freezes every parameter; leave at least one trainable", option="freeze",
            parameters=len(names))
    if not names and not opts.input_grad:
        bad("the model has no parameters, so there is no gradient to return; set options.input_grad=true for "
            "the gradient with respect to the inputs", option="input_grad")
    if not opts.batch_gradient:
        _validate_no_batch_gradient(opts)
    del batch
    return frozen


# What only the batch's own forward and backward give: refused when options.batch_gradient is false.
BATCH_PASS_OPTIONS = ("hvp", "input_grad", "per_loss", "checkpoint_segments", "micro_batch", "graph")


def _validate_no_batch_gradient(opts: Options) -> None:
    if opts.per_sample == "off":
        raise SpecError("bad_option", "options.batch_gradient=false leaves nothing to compute; ask for "
                        "per_sample='norms' or 'full', or leave batch_gradient out", option="batch_gradient")
    for name in BATCH_PASS_OPTIONS:
        if getattr(opts, name) not in (None, False):
            raise SpecError("bad_option", f"options.{name} is a quantity of the batch's own forward and backward, "
                            "which options.batch_gradient=false skips; leave one of them out", option=name)


def validate_reductions(opts: Options, terms: list[LossTerm]) -> None:
    """Without the batch pass the loss is rebuilt from the examples' losses, and the check compares the
    examples' gradients summed or averaged: one reduction for every loss."""
    if not opts.batch_gradient and len({t.reduction for t in terms}) > 1:
        raise SpecError("bad_option", "options.batch_gradient=false needs one reduction for every loss (the "
                        "examples' gradients sum or average to the batch's); give the losses the same reduction",
                        option="batch_gradient")


def validate_hvp(opts: Options, model: nn.Module, frozen: set[str]) -> None:
    """The HVP vector's names and shapes, checked before the job is queued."""
    if opts.hvp is None:
        return
    vector = opts.hvp.vector
    if isinstance(vector, str):
        if vector != "random":
            raise SpecError("bad_option", f"options.hvp.vector={vector!r}: use 'random' or an object "
                            "{parameter: tensor} with every trainable parameter", option="hvp.vector",
                            value=vector, valid=["random", "{parameter: tensor}"])
        return
    trainable = {n: list(p.shape) for n, p in model.named_parameters() if n not in frozen}
    for name in trainable:
        if name not in vector:
            raise SpecError("bad_option", f"options.hvp.vector: parameter {name!r} is missing; give a tensor for "
                            "every trainable parameter", parameter=name)
    for name, wire in vector.items():
        if name not in trainable:
            raise SpecError("bad_option", f"options.hvp.vector: {name!r} is not a trainable parameter; they are "
                            f"{sorted(trainable)[:12]}", parameter=name)
        if list(wire.shape) != trainable[name]:
            raise SpecError("bad_option", f"options.hvp.vector[{name!r}] has shape {list(wire.shape)}, expected "
                            f"{trainable[name]}", parameter=name)


def validate_diagnostics(opts: Options, terms: list[LossTerm], model: nn.Module, frozen: set[str],
                         max_krylov_bytes: int | None = None) -> None:
    """options.diagnostics, clip and curvature against the model and the losses, before the queue."""
    def bad(msg: str, **detail) -> None:
        raise SpecError("bad_option", msg, **detail)

    asked = [name for name, on in (("diagnostics", opts.diagnostics), ("clip", opts.clip),
                                   ("curvature", opts.curvature)) if on]
    if not asked:
        return
    if not opts.batch_gradient:
        bad(f"options.{asked[0]} is computed from the batch's gradient, which options.batch_gradient=false skips; "
            "leave one of them out", option=asked[0])
    whole = [name for name in asked if name != "curvature"]  # curvature is spread over shards (diagnostics/sharded.py)
    if opts.shards != 1 and whole:
        bad(f"options.{whole[0]} needs the whole batch's gradient in one job, and options.shards splits it across "
            "jobs; set shards=1 (micro_batch bounds memory within one job)", option=whole[0])
    size = sum(p.numel() for n, p in model.named_parameters() if n not in frozen)
    if size == 0:
        bad(f"options.{asked[0]}: the model has no trainable parameter, so there is no gradient to diagnose or "
            "clip; unfreeze a parameter or leave it out", option=asked[0])
    if per_example_option(opts) and len({t.reduction for t in terms}) > 1:
        bad(f"{per_example_option(opts)}: the losses reduce differently, so an example's share of the gradient is "
            "not defined; give every loss the same reduction", option=asked[0])
    if opts.clip is not None and opts.clip.noise_multiplier and not opts.clip.per_sample:
        bad("options.clip.noise_multiplier adds the DP-SGD step's noise, which belongs to per-example clipping; "
            "set options.clip.per_sample=true to clip each example and add the noise, or leave noise_multiplier "
            "out for clip_grad_norm_'s global clipping", option="clip.noise_multiplier")
    if opts.curvature is not None:
        _validate_curvature(opts, terms, size)
        if max_krylov_bytes is not None:
            validate_krylov(opts.curvature, size, max_krylov_bytes)


def validate_krylov(c: CurvatureOptions, size: int, max_bytes: int) -> None:
    """The Lanczos basis the curvature options hold (float64 vectors of the parameter count, one per iteration)
    against GRADSVC_MAX_KRYLOV_BYTES, before the queue."""
    vectors = lanczos.krylov_vectors(c, size)
    need = vectors * size * 8
    if need <= max_bytes:
        return
    fits = max_bytes // (size * 8) - (1 + c.top if c.top else 2)  # the iterations' vectors beside the fixed ones
    fix = (f"set options.curvature.iterations to at most {fits}" if fits >= 1 else
           "no Lanczos run of this model fits; ask for the trace alone (top=0, trace=true)")
    raise SpecError("too_large", f"options.curvature: the Lanczos basis holds {vectors} float64 vectors of the "
                    f"{size} trainable parameters, {need} bytes, over GRADSVC_MAX_KRYLOV_BYTES={max_bytes}; {fix}, "
                    "or raise GRADSVC_MAX_KRYLOV_BYTES", option="curvature.iterations",
                    setting="GRADSVC_MAX_KRYLOV_BYTES", bytes=need, max_bytes=max_bytes, max_iterations=max(fits, 0))


def _validate_curvature(opts: Options, terms: list[LossTerm], size: int) -> None:
    c = opts.curvature
    if c.top > size:
        raise SpecError("bad_option", f"options.curvature.top={c.top} asks for more eigenvalues than the {size} "
                        f"trainable parameters have; set top to at most {size}", option="curvature.top",
                        value=c.top, max=size)
    if not (c.top or c.trace or c.density):
        raise SpecError("bad_option", "options.curvature asks for nothing: set top >= 1, trace=true or density=true",
                        option="curvature")
    if c.density and c.probes is None:
        raise SpecError("bad_option", "options.curvature.density needs probes: the number of random starting "
                        "vectors the spectrum is averaged over; set probes (10 is a common choice)",
                        option="curvature.probes")
    if c.eigenvectors and not c.top:
        raise SpecError("bad_option", "options.curvature.eigenvectors returns the top eigenvalues' vectors; set "
                        "top >= 1 or leave eigenvectors out", option="curvature.eigenvectors")
    if c.matrix == "ggn" and any(t.type == OWN_LOSS for t in terms):
        raise SpecError("bad_option", f"options.curvature.matrix='ggn' needs the loss as a function of the model's "
                        f"output, and loss {OWN_LOSS!r} is computed inside the model; use matrix='hessian' or a "
                        "built-in loss", option="curvature.matrix")


def decode_weights(given: dict, state: dict[str, torch.Tensor], parameters, dtype: torch.dtype,
                    max_elements: int, owner: str, layouts: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The given weights as tensors, each checked against the state entry of its name: shape; parameters
    cast to the model's dtype and finite; buffers cast to their own dtype. `layouts`: the buffers a graph
    declares sparse ("sparse_coo", "sparse_csr"), which arrive as their parts."""
    from .graph import sparse

    out: dict[str, torch.Tensor] = {}
    small: list[tuple[str, torch.Tensor]] = []  # parameters checked together (the biases and norms of a model)
    for name, wire in given.items():
        layout = (layouts or {}).get(name)
        if layout is not None:
            t = sparse.decode(as_tensor_value(wire, f"weights[{name!r}]"), layout, f"weights[{name!r}]", max_elements)
        else:
            t = tensors.decode(dense_only(wire, f"weights[{name!r}]"), where=f"weights[{name!r}]",
                               max_elements=max_elements,
                               complex_ok=state[name].is_complex())  # a complex buffer (a rotary table)
        if list(t.shape) != list(state[name].shape):
            _validate_finite(small)  # an earlier weight's fault is named first, as it comes first
            raise _wrong_shape(name, list(t.shape), state[name], owner)
        if name in parameters:
            t = t.to(state[name].dtype if t.is_complex() else dtype)  # a complex parameter stays complex
            if t.is_meta:
                pass
            elif t.numel() <= _SMALL_WEIGHT and t.layout == torch.strided and not t.is_complex():
                small.append((name, t))
            elif not tensors.all_finite(t):
                _validate_finite(small)
                raise SpecError("bad_weights", f"weights: {name!r} holds NaN or infinite values", parameter=name)
        else:
            t = t.to(state[name].dtype)
        out[name] = t
    _validate_finite(small)
    return out


def _wrong_shape(name: str, shape: list[int], held: torch.Tensor, owner: str) -> SpecError:
    want = list(held.shape)
    return SpecError("bad_weights", f"weights: {name!r} has shape {shape}, {owner} needs {want}", parameter=name,
                     shape=shape, expected=want)


def check_by_reference(given: dict, state: dict[str, torch.Tensor], max_elements: int, owner: str,
                       layouts: dict[str, str]) -> dict:
    """The check on meta of the weights sent by reference alone (their bytes in Redis, checked by the worker that
    puts them in place): dtype and shape, as decode_weights checks them, without a meta tensor made for each
    (timm's shvit_s1, 232 of its 471 weights by reference: 3.4 -> 2.4 ms of the API's check). What is left,
    for decode_weights: the weights sent with their bytes, and the sparse ones."""
    rest = {}
    for name, wire in given.items():
        shape = None if name in layouts else tensors.by_reference(
            wire, where=f"weights[{name!r}]", max_elements=max_elements, complex_ok=state[name].is_complex())
        if shape is None:
            rest[name] = wire
        elif list(shape) != list(state[name].shape):
            raise _wrong_shape(name, list(shape), state[name], owner)
    return rest


# Parameters up to this many elements are checked for NaN and infinity together, in one pass over their
# concatenation (a graph's ~50 small weights: one check, not ~100 ops; with the read-only warning caught
# once, decode_weights of GPT-2's frozen-backbone body 4.5 -> 2.5 ms in process, in the API and again in the
# worker). A larger one has its own pass (tensors.all_finite).
_SMALL_WEIGHT = 1 << 14


def _validate_finite(small: list[tuple[str, torch.Tensor]]) -> None:
    """SpecError naming the first of `small` (name, parameter, all of one dtype) that holds NaN or infinity."""
    if tensors.all_finite_many([t for _, t in small]):  # one pass over their concatenation
        return
    for name, t in small:
        if not tensors.all_finite(t):
            raise SpecError("bad_weights", f"weights: {name!r} holds NaN or infinite values", parameter=name)


def input_values(value, names: list[str], *, what: str) -> list[tuple[str, object]]:
    """`inputs` as (name, wire value) in `forward`'s order: one tensor, a list of tensor objects (the
    positional arguments) or an object of named tensors (the keyword arguments), for the `names` the model
    takes. A bare nested list is one tensor."""
    takes = f"{what} takes {len(names)} input{'s' if len(names) != 1 else ''} ({', '.join(names)})"
    if value is None:
        raise SpecError("bad_tensor", f"inputs: missing; {takes}", where="inputs")
    if isinstance(value, dict) and not is_tensor(value):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise SpecError("bad_tensor", f"inputs: {unknown[0]!r} is not an input of the model; {takes}",
                            where=f"inputs.{unknown[0]}"[:200], inputs=names)
        missing = [n for n in names if n not in value]
        if missing:
            raise SpecError("bad_tensor", f"inputs: {missing[0]!r} is missing; {takes}, by name",
                            where=f"inputs.{missing[0]}", inputs=names)
        return [(f"inputs.{n}", value[n]) for n in names]
    if isinstance(value, list) and value and all(is_tensor(v) for v in value):
        if len(value) != len(names):
            raise SpecError("bad_tensor", f"inputs: a list of {len(value)} tensors, but {takes}; send them in that "
                            "order, or as an object by name", where="inputs", inputs=names)
        return [(f"inputs[{i}]", v) for i, v in enumerate(value)]
    if len(names) != 1:
        raise SpecError("bad_tensor", f"inputs: one tensor, but {takes}; send a list of tensors in that order, or an "
                        "object of named tensors", where="inputs", inputs=names)
    return [("inputs", value)]


def as_tensor_value(value, where: str):
    """A tensor object inside an untyped field (a plain dict) as the wire Struct."""
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, Tensor)
        except msgspec.ValidationError as exc:
            raise SpecError("bad_tensor", f"{where}: {exc}", where=where) from None
    return value

