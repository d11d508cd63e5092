"""The worker a PyTorch user would write instead of gradsvc: Celery with Redis as broker and result backend,
a solo-pool worker process (one task at a time), plain PyTorch. It takes gradsvc's own request bodies (the
subset the peers bench sends: a Sequential of Linear/Tanh/ReLU, seeded weights, one cross-entropy or MSE
loss) so both sides compute the same thing, and answers in the same form (gradients by parameter name).

Generous to the peer: the body is passed through undecoded (no validation, no limits), the seeded model
is built once per spec and kept, MessagePack (msgspec, registered as a kombu serializer) carries raw bytes
both ways, not JSON or pickle."""

from __future__ import annotations

import functools
import os

import msgspec
import torch
import torch.nn.functional as F
from celery import Celery
from kombu.serialization import register
from torch import nn

register("msgspec", msgspec.msgpack.encode, msgspec.msgpack.decode, content_type="application/x-msgspec",
         content_encoding="binary")
app = Celery("peer", broker=os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("PEER_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(task_serializer="msgspec", result_serializer="msgspec", accept_content=["msgspec"],
                worker_prefetch_multiplier=1, broker_connection_retry_on_startup=True, result_expires=3600)
if "PEER_TORCH_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["PEER_TORCH_THREADS"]))

LAYERS = {"Linear": nn.Linear, "Tanh": nn.Tanh, "ReLU": nn.ReLU}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


@functools.lru_cache(maxsize=16)
def model_for(layers: bytes, dtype: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[LAYERS[spec.pop("type")](**spec) for spec in msgspec.json.decode(layers)]).to(DTYPES[dtype])


def tensor(value, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, dict):  # {"dtype", "shape", "data": raw bytes}
        return torch.frombuffer(bytearray(value["data"]), dtype=DTYPES[value["dtype"]]).reshape(value["shape"])
    return torch.tensor(value, dtype=dtype)


def wire(t: torch.Tensor, binary: bool) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.numpy().tobytes() if binary else t.tolist()}


@app.task(name="gradients")
def gradients(body: bytes, binary: bool) -> bytes:
    req = (msgspec.msgpack.decode if binary else msgspec.json.decode)(body)
    spec = req["model"]
    dtype = DTYPES[spec["dtype"]]
    model = model_for(msgspec.json.encode(spec["layers"]), spec["dtype"], spec.get("seed", 0))
    x = tensor(req["inputs"], dtype)
    out = model(x)
    if req.get("loss", "cross_entropy") == "cross_entropy":
        loss = F.cross_entropy(out, tensor(req["targets"], torch.int64))
    else:
        loss = F.mse_loss(out, tensor(req["targets"], dtype))
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params)
    answer = {"loss": float(loss.detach()), "gradients": {n: wire(g, binary) for n, g in zip(names, grads)}}
    return (msgspec.msgpack.encode if binary else msgspec.json.encode)(answer)
