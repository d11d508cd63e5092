"""Specs for every allow-listed layer type with each argument at each of a few values the table
accepts: the SDK's round-trip test and the engine's "accepted means computable" test walk them."""

from __future__ import annotations

from gradsvc.layers import LAYERS, ArgumentError, canonical

# Values for required arguments, by name, that make every allow-listed type constructible.
REQUIRED = {"in_features": 4, "out_features": 6, "in_channels": 4, "out_channels": 6, "kernel_size": 3,
            "output_size": 2, "num_features": 4, "num_groups": 2, "num_channels": 4, "normalized_shape": [4],
            "size": 3, "num_embeddings": 10, "embedding_dim": 3, "dim": 1, "unflattened_size": [2, 2],
            "threshold": 0.5, "value": 1.5, "padding": 1, "upscale_factor": 2, "downscale_factor": 2,
            "input_size": 4, "hidden_size": 6, "d_model": 8, "nhead": 2, "norm_type": 2.0}


def _candidates(arg) -> list:
    if arg.choices:
        return list(arg.choices)
    values = {"int": [2, 1, -1, 0, 3], "int | null": [None, 1, 2, -2], "number": [0.3, 2.0, 0.0, -1.5],
              "number | null": [None, 0.3, 2.0]}.get(arg.kind)
    if values is not None:
        return values
    if "list[number]" in arg.kind:
        return [None, 2.0, [2.0, 3.0], [1.5, 2.0, 2.5]]
    if "list[int]" in arg.kind:
        n = int(arg.kind.split("length ")[1].split(")")[0]) if "length" in arg.kind else 2
        extra = ["same", "valid"] if "'same'" in arg.kind else []
        return [None, 1, 2, [1] * n, list(range(1, n + 1)), [0] * n, [2, None][: n], *extra]
    raise AssertionError(f"no candidates for kind {arg.kind}")


def every_argument_value():
    """(type, argument, spec) for each allow-listed type, each argument and each value the table accepts
    among a few candidates (both bools, every choice, null, ints and lists)."""
    for kind, layer in LAYERS.items():
        base = {name: REQUIRED[name] for name, arg in layer.args.items() if arg.required}
        yield kind, None, {"type": kind, **base}
        for name, arg in layer.args.items():
            for value in _candidates(arg):
                args = {**base, name: value}
                try:
                    canonical(kind, args)
                except ArgumentError:
                    continue
                yield kind, name, {"type": kind, **args}


def input_shape(kind: str) -> tuple[int, ...] | None:
    """An input shape that each type's example spec (REQUIRED) can take; None: integer indices (2, 3) below 2."""
    fixed = {"Linear": (2, 4), "Embedding": None, "LayerNorm": (2, 3, 4), "RMSNorm": (2, 3, 4), "RNN": (2, 5, 4),
             "LSTM": (2, 5, 4), "GRU": (2, 5, 4), "TransformerEncoderLayer": (2, 5, 8), "Unflatten": (2, 4),
             "PixelShuffle": (2, 8, 3, 3), "PixelUnshuffle": (2, 2, 4, 4), "Upsample": (2, 4, 5, 5)}
    if kind in fixed:
        return fixed[kind]
    return {"1d": (2, 4, 9), "2d": (2, 4, 9, 9), "3d": (2, 4, 6, 6, 6)}.get(kind[-2:], (2, 4, 5))
