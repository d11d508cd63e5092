"""The layer allow-list, defined once: each type the declarative spec accepts, with torch's constructor
arguments (kind, torch's default, range or choices, required), the checkers that enforce them and how to
read each one back from a built module. The engine builds from it, `GET /layers` lists it and the SDK
converts modules with it.

Torch-free: the SDK imports this without PyTorch. A value's canonical form is what torch keeps on the
module (Conv2d's kernel_size 3 becomes [3, 3], MaxPool2d's stays 3), so `spec -> module -> spec` gives
`canonical(spec)` back, and a canonical spec back unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

REQUIRED = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


class ArgumentError(ValueError):
    """An argument's value is outside what torch accepts; `expected` says what it takes."""

    def __init__(self, argument: str, expected: str) -> None:
        super().__init__(f"{argument}: expected {expected}")
        self.argument = argument
        self.expected = expected


@dataclass(frozen=True)
class Arg:
    kind: str  # the accepted JSON forms, e.g. "int | list[int]"
    check: Callable[[Any], Any]  # wire value -> canonical wire value; raises ValueError(what it expects)
    default: Any = REQUIRED  # torch's default, as torch's signature writes it
    range: str = ""  # the range or choices the checker enforces, e.g. ">= 1", "[0, 1]"
    read: Callable[[Any, str], Any] | None = None  # (module, name) -> wire value; None: the same-named attribute
    choices: tuple = ()  # the accepted values, when they are few

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


@dataclass(frozen=True)
class Layer:
    args: dict[str, Arg] = field(default_factory=dict)
    # Rules across arguments (in_channels divisible by groups, ...) and canonical forms that depend on
    # another argument (a pool's stride None is its kernel_size): canonical args -> canonical args.
    fix: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # "sequence" for the recurrent layers: their (output, state) tuple is reduced to the output sequence.
    output: str = "tensor"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"{'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}" if hi is not None else ""


def _wire(v: Any) -> Any:
    """A module attribute as JSON data: tuples (and torch.Size) become lists."""
    return [_wire(x) for x in v] if isinstance(v, (tuple, list)) else v


def integer(default: Any = REQUIRED, lo: int | None = None, hi: int | None = None, null: bool = False) -> Arg:
    rng = _bounds(lo, hi)

    def check(v):
        if v is None and null:
            return None
        if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"an integer {rng}".rstrip() + (" or null" if null else ""))
        return v

    return Arg("int" + (" | null" if null else ""), check, default, rng)


def number(default: Any = REQUIRED, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           null: bool = False, nonzero: bool = False) -> Arg:
    rng = _bounds(lo, hi, lo_open) + (", not 0" if nonzero else "")
    rng = rng.removeprefix(", ")

    def check(v):
        if v is None and null:
            return None
        if (not _is_num(v) or (lo is not None and (v <= lo if lo_open else v < lo))
                or (hi is not None and v > hi) or (nonzero and v == 0)):
            raise ValueError(f"a finite number {rng}".rstrip() + (" or null" if null else ""))
        return float(v)

    def read(m, name):
        v = getattr(m, name)
        return None if v is None else float(v)

    return Arg("number" + (" | null" if null else ""), check, default, rng, read)


def boolean(default: Any = REQUIRED, *, null: bool = False) -> Arg:
    def check(v):
        if isinstance(v, bool) or (v is None and null):
            return v
        raise ValueError("true or false" + (" or null" if null else ""))

    return Arg("bool" + (" | null" if null else ""), check, default, choices=(True, False, *((None,) if null else ())))


def choice(default: Any, *choices: Any) -> Arg:
    """One of `choices` (torch's default among them). A bool choice lists the one value the service can honour."""

    def check(v):
        if not any(v == c and type(v) is type(c) for c in choices):
            raise ValueError(f"one of {list(choices)}")
        return v

    kind = "bool" if isinstance(default, bool) else "string"
    return Arg(kind, check, default, "one of " + ", ".join(map(repr, choices)), choices=choices)


def sizes(n: int, default: Any = REQUIRED, lo: int | None = 1, *, expand: bool = False, null: bool = False,
          null_items: bool = False) -> Arg:
    """An int or a list of `n` ints (`expand`: torch keeps it as a list of n, as Conv2d's kernel_size)."""
    rng = _bounds(lo, None)
    item = f"int {rng}".rstrip() + (" or null" if null_items else "")

    def ok(x):
        return (x is None and null_items) or (_is_int(x) and (lo is None or x >= lo))

    def check(v):
        if v is None and null:
            return None
        if ok(v) and v is not None:
            return [v] * n if expand else v
        if isinstance(v, list) and len(v) == n and all(ok(x) for x in v):
            return list(v)
        raise ValueError(f"an {item} or a list of {n} of them" + (", or null" if null else ""))

    return Arg(f"int | list[int] (length {n})" + (" | null" if null else ""), check, default, rng)


def numbers(n: int, default: Any = None) -> Arg:
    """null, a positive number or a list of `n` of them (Upsample's scale_factor: torch keeps floats)."""

    def check(v):
        if v is None:
            return None
        if _is_num(v) and v > 0:
            return float(v)
        if isinstance(v, list) and 1 <= len(v) <= n and all(_is_num(x) and x > 0 for x in v):
            return [float(x) for x in v]
        raise ValueError(f"null, a number > 0 or a list of up to {n} of them")

    return Arg("number | list[number] | null", check, default, "> 0")


def int_list(default: Any = REQUIRED, lo: int | None = 1, *, scalar: bool = False) -> Arg:
    """A non-empty list of ints (`scalar`: an int stands for a list of one, as LayerNorm's normalized_shape)."""
    rng = _bounds(lo, None)

    def check(v):
        if scalar and _is_int(v) and (lo is None or v >= lo):
            return [v]
        if isinstance(v, list) and v and all(_is_int(x) and (lo is None or x >= lo) for x in v):
            return list(v)
        raise ValueError(f"{'an int or ' if scalar else ''}a non-empty list of ints {rng}".rstrip())

    return Arg(("int | " if scalar else "") + "list[int]", check, default, rng)


def _upsample_size() -> Arg:
    def check(v):
        if v is None or (_is_int(v) and v >= 1):
            return v
        if isinstance(v, list) and 1 <= len(v) <= 3 and all(_is_int(x) and x >= 1 for x in v):
            return list(v)
        raise ValueError("null, an int >= 1 or a list of up to 3 of them")

    return Arg("int | list[int] | null", check, None, ">= 1")


def _conv_padding(n: int) -> Arg:
    ints = sizes(n, 0, lo=0, expand=True)

    def check(v):
        if v in ("same", "valid"):
            return v
        try:
            return ints.check(v)
        except ValueError:
            raise ValueError(f"'same', 'valid', an int >= 0 or a list of {n} of them") from None

    return Arg(f"int | list[int] (length {n}) | 'same' | 'valid'", check, 0, ">= 0")


def _pad(n: int) -> Arg:
    """Padding layers: an int (every side) or a list of 2n ints; torch keeps the list of 2n. Negative crops."""

    def check(v):
        if _is_int(v):
            return [v] * (2 * n)
        if isinstance(v, list) and len(v) == 2 * n and all(_is_int(x) for x in v):
            return list(v)
        raise ValueError(f"an int or a list of {2 * n} ints (left, right{', top, bottom' if n > 1 else ''}"
                         f"{', front, back' if n > 2 else ''})")

    return Arg(f"int | list[int] (length {2 * n})", check, REQUIRED)


def _flag(default: bool, read: Callable[[Any, str], Any]) -> Arg:
    """A bool argument that torch does not keep under its own name (Linear's bias: whether `bias` exists)."""
    return Arg("bool", boolean().check, default, read=read, choices=(True, False))


def _inplace() -> Arg:
    return boolean(False)


def _not_none(attr: str) -> Callable[[Any, str], Any]:
    return lambda m, name: getattr(m, attr) is not None


def _bias_if(flag: str) -> Callable[[Any, str], Any]:
    """A norm layer's `bias` argument: whether it has a bias, when it has affine parameters at all."""
    return lambda m, name: (m.bias is not None) if getattr(m, flag) else True


def _require(ok: bool, argument: str, expected: str) -> None:
    if not ok:
        raise ArgumentError(argument, expected)


# --- the layer families ----------------------------------------------------------------------------

def _linear() -> Layer:
    return Layer({"in_features": integer(lo=1), "out_features": integer(lo=1),
                  "bias": _flag(True, _not_none("bias"))})


def _conv_groups(a: dict[str, Any]) -> dict[str, Any]:
    _require(a["in_channels"] % a["groups"] == 0, "groups",
             f"a divisor of in_channels={a['in_channels']} (torch: in_channels must be divisible by groups)")
    _require(a["out_channels"] % a["groups"] == 0, "groups",
             f"a divisor of out_channels={a['out_channels']} (torch: out_channels must be divisible by groups)")
    return a


def _conv_fix(a: dict[str, Any]) -> dict[str, Any]:
    a = _conv_groups(a)
    if a["padding"] == "same":
        _require(all(s == 1 for s in a["stride"]), "padding",
                 "an int or list when stride > 1 (torch: padding='same' is not supported for strided convolutions)")
    return a


def _conv(n: int) -> Layer:
    return Layer({
        "in_channels": integer(lo=1), "out_channels": integer(lo=1),
        "kernel_size": sizes(n, expand=True), "stride": sizes(n, 1, expand=True), "padding": _conv_padding(n),
        "dilation": sizes(n, 1, expand=True), "groups": integer(1, lo=1),
        "bias": _flag(True, _not_none("bias")),
        "padding_mode": choice("zeros", "zeros", "reflect", "replicate", "circular"),
    }, fix=_conv_fix)


def _conv_transpose_fix(a: dict[str, Any]) -> dict[str, Any]:
    for op, s, d in zip(a["output_padding"], a["stride"], a["dilation"]):
        # torch checks this only when the layer runs
        _require(op < max(s, d), "output_padding", f"values smaller than stride or dilation ({a['stride']}, "
                 f"{a['dilation']})")
    return _conv_groups(a)


def _conv_transpose(n: int) -> Layer:
    return Layer({
        "in_channels": integer(lo=1), "out_channels": integer(lo=1),
        "kernel_size": sizes(n, expand=True), "stride": sizes(n, 1, expand=True),
        "padding": sizes(n, 0, lo=0, expand=True), "output_padding": sizes(n, 0, lo=0, expand=True),
        "groups": integer(1, lo=1), "bias": _flag(True, _not_none("bias")),
        "dilation": sizes(n, 1, expand=True),
        # torch raises for any other mode: 'Only "zeros" padding mode is supported for ConvTranspose'
        "padding_mode": choice("zeros", "zeros"),
    }, fix=_conv_transpose_fix)


def _stride_is_kernel(a: dict[str, Any]) -> dict[str, Any]:
    # torch keeps `stride if stride is not None else kernel_size`: null and the kernel size are one pool
    if a["stride"] is None:
        a["stride"] = a["kernel_size"]
    return a


def _maxpool(n: int) -> Layer:
    return Layer({"kernel_size": sizes(n), "stride": sizes(n, None, null=True), "padding": sizes(n, 0, lo=0),
                  "dilation": sizes(n, 1),
                  # a tuple (output, indices) cannot flow through a stack
                  "return_indices": choice(False, False), "ceil_mode": boolean(False)}, fix=_stride_is_kernel)


def _avgpool(n: int) -> Layer:
    args = {"kernel_size": sizes(n, expand=n == 1), "stride": sizes(n, None, null=True, expand=n == 1),
            "padding": sizes(n, 0, lo=0, expand=n == 1), "ceil_mode": boolean(False),
            "count_include_pad": boolean(True)}
    if n > 1:  # torch's AvgPool1d has no divisor_override
        args["divisor_override"] = integer(None, lo=1, null=True)
    return Layer(args, fix=_stride_is_kernel)


def _lppool(n: int) -> Layer:
    return Layer({"norm_type": number(nonzero=True), "kernel_size": sizes(n), "stride": sizes(n, None, null=True),
                  "ceil_mode": boolean(False)})


def _adaptive(n: int, indices: bool) -> Layer:
    args = {"output_size": sizes(n, lo=1, null_items=True)}
    if indices:
        args["return_indices"] = choice(False, False)
    return Layer(args)


def _norm_bias(a: dict[str, Any], flag: str) -> dict[str, Any]:
    if not a[flag]:
        a["bias"] = True  # without affine parameters there is no bias to leave out: one canonical form
    return a


def _batchnorm(affine: bool = True, track: bool = True) -> Layer:
    # eps > 0: torch's batch_norm refuses any other in training mode, which is how the service runs
    return Layer({"num_features": integer(lo=1), "eps": number(1e-5, 0, lo_open=True),
                  "momentum": number(0.1, null=True), "affine": boolean(affine),
                  "track_running_stats": boolean(track),
                  "bias": _flag(True, _bias_if("affine"))},
                 fix=lambda a: _norm_bias(a, "affine"))


def _groupnorm_fix(a: dict[str, Any]) -> dict[str, Any]:
    _require(a["num_channels"] % a["num_groups"] == 0, "num_groups",
             f"a divisor of num_channels={a['num_channels']} (torch: num_channels must be divisible by num_groups)")
    return _norm_bias(a, "affine")


def _embedding_fix(a: dict[str, Any]) -> dict[str, Any]:
    n, idx = a["num_embeddings"], a["padding_idx"]
    if idx is not None:
        _require(-n <= idx < n, "padding_idx", f"an index in [{-n}, {n - 1}] or null (torch: padding_idx must be "
                 "within num_embeddings)")
        a["padding_idx"] = idx % n  # torch keeps a negative index as its positive equivalent
    return a


def _hardtanh_fix(a: dict[str, Any]) -> dict[str, Any]:
    _require(a["max_val"] > a["min_val"], "max_val", f"a number above min_val={a['min_val']}")
    return a


def _rnn_fix(a: dict[str, Any]) -> dict[str, Any]:
    if "proj_size" in a:
        _require(a["proj_size"] < a["hidden_size"], "proj_size",
                 f"an integer in [0, {a['hidden_size'] - 1}] (torch: proj_size has to be smaller than hidden_size)")
    return a


def _rnn(kind: str) -> Layer:
    args = {"input_size": integer(lo=1), "hidden_size": integer(lo=1), "num_layers": integer(1, lo=1)}
    if kind == "RNN":
        args["nonlinearity"] = choice("tanh", "tanh", "relu")
    args.update({"bias": boolean(True), "batch_first": boolean(False), "dropout": number(0.0, 0, 1),
                 "bidirectional": boolean(False)})
    if kind == "LSTM":
        args["proj_size"] = integer(0, lo=0)
    return Layer(args, fix=_rnn_fix, output="sequence")


def _transformer_fix(a: dict[str, Any]) -> dict[str, Any]:
    _require(a["d_model"] % a["nhead"] == 0, "nhead",
             f"a divisor of d_model={a['d_model']} (torch: embed_dim must be divisible by num_heads)")
    return a


def _activation(m, name):
    kind = {1: "relu", 2: "gelu"}.get(getattr(m, "activation_relu_or_gelu", 0))
    if kind is None:
        raise ValueError("activation: only 'relu' and 'gelu' (or F.relu, F.gelu, nn.ReLU, nn.GELU) can be expressed")
    return kind


def _transformer_encoder_layer() -> Layer:
    def at(path: str) -> Callable[[Any, str], Any]:
        def read(m, name):
            for part in path.split("."):
                m = getattr(m, part)
            return m
        return read

    return Layer({
        "d_model": Arg("int", integer(lo=1).check, REQUIRED, ">= 1", at("self_attn.embed_dim")),
        "nhead": Arg("int", integer(lo=1).check, REQUIRED, ">= 1", at("self_attn.num_heads")),
        "dim_feedforward": Arg("int", integer(lo=1).check, 2048, ">= 1", at("linear1.out_features")),
        "dropout": Arg("number", number(lo=0, hi=1).check, 0.1, "[0, 1]", lambda m, n: float(m.dropout.p)),
        "activation": Arg("string", choice("relu", "relu", "gelu").check, "relu", "one of 'relu', 'gelu'",
                          _activation, ("relu", "gelu")),
        "layer_norm_eps": Arg("number", number().check, 1e-5, "",
                              lambda m, n: float(m.norm1.eps)),
        "batch_first": _flag(False, at("self_attn.batch_first")),
        "norm_first": boolean(False),
        "bias": _flag(True, lambda m, n: m.linear1.bias is not None),
    }, fix=_transformer_fix)


def _dropout() -> Layer:
    return Layer({"p": number(0.5, 0, 1), "inplace": _inplace()})


def _plain(*, inplace: bool = False) -> Layer:
    return Layer({"inplace": _inplace()} if inplace else {})


_DIM = {"dim": integer(None, null=True)}

LAYERS: dict[str, Layer] = {
    "Linear": _linear(),
    **{f"Conv{n}d": _conv(n) for n in (1, 2, 3)},
    **{f"ConvTranspose{n}d": _conv_transpose(n) for n in (1, 2, 3)},
    **{f"MaxPool{n}d": _maxpool(n) for n in (1, 2, 3)},
    **{f"AvgPool{n}d": _avgpool(n) for n in (1, 2, 3)},
    **{f"LPPool{n}d": _lppool(n) for n in (1, 2, 3)},
    **{f"AdaptiveAvgPool{n}d": _adaptive(n, False) for n in (1, 2, 3)},
    **{f"AdaptiveMaxPool{n}d": _adaptive(n, True) for n in (1, 2, 3)},
    **{f"BatchNorm{n}d": _batchnorm() for n in (1, 2, 3)},
    **{f"InstanceNorm{n}d": Layer({**_batchnorm(False, False).args}, fix=lambda a: _norm_bias(a, "affine"))
       for n in (1, 2, 3)},
    "GroupNorm": Layer({"num_groups": integer(lo=1), "num_channels": integer(lo=1),
                        "eps": number(1e-5), "affine": boolean(True),
                        "bias": _flag(True, _bias_if("affine"))}, fix=_groupnorm_fix),
    "LayerNorm": Layer({"normalized_shape": int_list(scalar=True), "eps": number(1e-5),
                        "elementwise_affine": boolean(True),
                        "bias": _flag(True, _bias_if("elementwise_affine"))},
                       fix=lambda a: _norm_bias(a, "elementwise_affine")),
    "RMSNorm": Layer({"normalized_shape": int_list(scalar=True), "eps": number(None, null=True),
                      "elementwise_affine": boolean(True)}),
    "LocalResponseNorm": Layer({"size": integer(lo=1), "alpha": number(1e-4), "beta": number(0.75),
                                "k": number(1.0)}),
    "Embedding": Layer({"num_embeddings": integer(lo=1), "embedding_dim": integer(lo=1),
                        "padding_idx": integer(None, null=True), "max_norm": number(None, 0, lo_open=True, null=True),
                        "norm_type": number(2.0), "scale_grad_by_freq": boolean(False),
                        # sparse gradients do not travel: the service returns dense tensors
                        "sparse": choice(False, False)}, fix=_embedding_fix),
    "Flatten": Layer({"start_dim": integer(1), "end_dim": integer(-1)}),
    "Unflatten": Layer({"dim": integer(), "unflattened_size": int_list(lo=-1)}),
    "Identity": Layer(),
    "ReLU": _plain(inplace=True),
    "ReLU6": _plain(inplace=True),
    "LeakyReLU": Layer({"negative_slope": number(0.01), "inplace": _inplace()}),
    "PReLU": Layer({"num_parameters": integer(1, lo=1), "init": number(0.25)}),
    "ELU": Layer({"alpha": number(1.0), "inplace": _inplace()}),
    # torch refuses alpha=0 only when the layer runs (ZeroDivisionError): refused here, before the queue
    "CELU": Layer({"alpha": number(1.0, nonzero=True), "inplace": _inplace()}),
    "SELU": _plain(inplace=True),
    "GELU": Layer({"approximate": choice("none", "none", "tanh")}),
    "SiLU": _plain(inplace=True),
    "Mish": _plain(inplace=True),
    "Hardswish": _plain(inplace=True),
    "Hardsigmoid": _plain(inplace=True),
    "Hardtanh": Layer({"min_val": number(-1.0), "max_val": number(1.0), "inplace": _inplace()}, fix=_hardtanh_fix),
    "Hardshrink": Layer({"lambd": number(0.5)}),
    # torch refuses a negative lambd only when the layer runs
    "Softshrink": Layer({"lambd": number(0.5, 0)}),
    "Threshold": Layer({"threshold": number(), "value": number(), "inplace": _inplace()}),
    "Softplus": Layer({"beta": number(1.0), "threshold": number(20.0)}),
    "Softsign": Layer(),
    "Tanh": Layer(),
    "Tanhshrink": Layer(),
    "Sigmoid": Layer(),
    "LogSigmoid": Layer(),
    "GLU": Layer({"dim": integer(-1)}),
    "Softmax": Layer(dict(_DIM)),
    "Softmin": Layer(dict(_DIM)),
    "LogSoftmax": Layer(dict(_DIM)),
    "Softmax2d": Layer(),
    "Dropout": _dropout(),
    "Dropout1d": _dropout(),
    "Dropout2d": _dropout(),
    "Dropout3d": _dropout(),
    "AlphaDropout": _dropout(),
    "FeatureAlphaDropout": _dropout(),
    **{f"ZeroPad{n}d": Layer({"padding": _pad(n)}) for n in (1, 2, 3)},
    **{f"ConstantPad{n}d": Layer({"padding": _pad(n), "value": number()}) for n in (1, 2, 3)},
    **{f"ReflectionPad{n}d": Layer({"padding": _pad(n)}) for n in (1, 2, 3)},
    **{f"ReplicationPad{n}d": Layer({"padding": _pad(n)}) for n in (1, 2, 3)},
    **{f"CircularPad{n}d": Layer({"padding": _pad(n)}) for n in (1, 2, 3)},
    "Upsample": Layer({"size": _upsample_size(), "scale_factor": numbers(3),
                       "mode": choice("nearest", "nearest", "linear", "bilinear", "bicubic", "trilinear", "area",
                                      "nearest-exact"),
                       "align_corners": boolean(None, null=True), "recompute_scale_factor": boolean(None, null=True)}),
    "PixelShuffle": Layer({"upscale_factor": integer(lo=1)}),
    "PixelUnshuffle": Layer({"downscale_factor": integer(lo=1)}),
    "RNN": _rnn("RNN"),
    "LSTM": _rnn("LSTM"),
    "GRU": _rnn("GRU"),
    "TransformerEncoderLayer": _transformer_encoder_layer(),
}
CONTAINERS = ("Sequential", "Residual")


def canonical(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Every argument of an allow-listed `kind` in canonical form (defaults filled in), or ArgumentError
    naming the argument. Unknown arguments and missing required ones are ArgumentError too."""
    layer = LAYERS[kind]
    for name in args:
        if name not in layer.args:
            raise ArgumentError(name, f"no such argument; {kind} takes {', '.join(layer.args) or 'none'}")
    out = {}
    for name, arg in layer.args.items():
        if name not in args:
            if arg.required:
                raise ArgumentError(name, "a value: it is required")
            value = arg.default
        else:
            value = args[name]
        try:
            out[name] = arg.check(value)
        except ValueError as exc:
            raise ArgumentError(name, str(exc)) from None
    return layer.fix(out) if layer.fix else out


def read_args(kind: str, module: Any) -> dict[str, Any]:
    """The canonical arguments of a built `module` of allow-listed `kind`, read from its attributes."""
    out = {}
    for name, arg in LAYERS[kind].args.items():
        out[name] = arg.read(module, name) if arg.read else _wire(getattr(module, name))
    return out


def to_torch(value: Any) -> Any:
    """A canonical wire value as torch's constructor takes it: lists become tuples."""
    return tuple(to_torch(v) for v in value) if isinstance(value, list) else value


def catalogue() -> list[dict[str, Any]]:
    """What GET /layers lists: each type with its arguments, torch's defaults and the enforced ranges."""
    out = []
    for kind, layer in LAYERS.items():
        args = {name: {"kind": a.kind, "required": a.required, **({} if a.required else {"default": a.default}),
                       "range": a.range}
                for name, a in layer.args.items()}
        out.append({"type": kind, "arguments": {n: f"{a.kind} {a.range}".rstrip() for n, a in layer.args.items()},
                    "required": [n for n, a in layer.args.items() if a.required], "container": False,
                    "details": args, "output": layer.output})
    for kind in CONTAINERS:
        out.append({"type": kind, "arguments": {"layers": "list[layer]"}, "required": ["layers"], "container": True,
                    "details": {"layers": {"kind": "list[layer]", "required": True, "range": ""}}, "output": "tensor"})
    return out
