"""Payload formats for one 10M-element float32 gradient (40 MB raw): JSON nested lists vs base64 in
JSON vs MessagePack raw bytes, each way, with the service's own code.

  encode  a torch gradient -> the bytes the API sends: gradsvc.engine.tensors.encode (raw bytes, as
          the worker stores them), then for JSON service.negotiation.for_json (nested lists or base64)
          and msgspec's JSON encoder; for MessagePack msgspec's MessagePack encoder.
  decode  the bytes a client sends -> a torch tensor: msgspec decode into gradsvc.wire.Tensor, then
          gradsvc.engine.tensors.decode (what the worker runs on request tensors).
MB/s counts the 40 MB of raw tensor data, whatever the format's size on the wire.

Run: .venv/bin/python bench/payload.py
"""

from __future__ import annotations

import common  # noqa: F401  (puts the repo on sys.path)
import msgspec
import torch

from common import footer, header, median, table, timed, verdict
from gradsvc.wire import Tensor
from service.negotiation import for_json
from gradsvc.engine import tensors

N = 10_000_000


class Holder(msgspec.Struct):
    """Stands in for the result: for_json rewrites the tensors of a GradientResult's dicts."""

    gradient: Tensor


def encoders(grad: torch.Tensor):
    from gradsvc.wire import GradientResult, Timings

    def result(t):
        return GradientResult(device="cpu", dtype="float32", parameter_count=N, torch_version="", loss=0.0,
                              gradients={"w": t}, timings=Timings())

    json, mp = msgspec.json.Encoder(), msgspec.msgpack.Encoder()
    return {
        "JSON list": lambda: json.encode(for_json(result(tensors.encode(grad)), "list")),
        "JSON base64": lambda: json.encode(for_json(result(tensors.encode(grad)), "b64")),
        "MessagePack": lambda: mp.encode(result(tensors.encode(grad))),
    }


def decoders(wire: dict[str, bytes]):
    jd, md = msgspec.json.Decoder(Tensor), msgspec.msgpack.Decoder(Tensor)
    lim = 1 << 40
    return {
        "JSON list": lambda: tensors.decode(jd.decode(wire["JSON list"]), where="t", max_elements=lim),
        "JSON base64": lambda: tensors.decode(jd.decode(wire["JSON base64"]), where="t", max_elements=lim),
        "MessagePack": lambda: tensors.decode(md.decode(wire["MessagePack"]), where="t", max_elements=lim),
    }


def main() -> list[list]:
    started = header("Payload: a 10M-element float32 gradient, JSON list vs base64 vs MessagePack",
                     __doc__.split("Run:")[0])
    grad = torch.randn(N, generator=torch.Generator().manual_seed(0))
    raw_mb = grad.numel() * grad.element_size() / 1e6
    json, mp = msgspec.json.Encoder(), msgspec.msgpack.Encoder()
    # What a client sends: the tensor alone, in each format.
    t = tensors.encode(grad)
    wire = {"JSON list": json.encode(tensors.to_listed(t)), "JSON base64": json.encode(tensors.to_b64(t)),
            "MessagePack": mp.encode(t)}
    enc, dec = encoders(grad), decoders(wire)
    rows = []
    for name in wire:
        repeat = 1 if name == "JSON list" else 7
        e = median(timed(enc[name], repeat=repeat, warmup=0 if repeat == 1 else 1))
        d = median(timed(dec[name], repeat=repeat, warmup=0 if repeat == 1 else 1))
        rows.append([name, len(wire[name]) / 1e6, 1e3 * e, raw_mb / e, 1e3 * d, raw_mb / d])
    base = {r[0]: r for r in rows}["JSON list"]
    for r in rows:
        r += [r[3] / base[3], r[5] / base[5]]
    table(["format", "wire MB", "encode ms", "encode MB/s", "decode ms", "decode MB/s", "encode x list",
           "decode x list"], rows)
    mp_row = rows[-1]
    slowest = min(mp_row[3], mp_row[5])
    print(f"\ngoal MessagePack >= 1000 MB/s each way: encode {mp_row[3]:.0f}, decode {mp_row[5]:.0f} "
          f"({verdict(slowest, 1000, at_most=False)})")
    footer(started)
    return rows


if __name__ == "__main__":
    main()
