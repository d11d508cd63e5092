"""Training sessions on a CUDA device (skipped without one): N session steps on the GPU end on the weights and
Adam's state of the same N local torch.optim steps on that GPU, the checkpoint round-trips through the CPU."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from gradclient.tensors import to_wire
from gradsvc import wire
from gradsvc.engine import session_state
from gradsvc.engine.config import EngineCaches, EngineConfig
from gradsvc.engine.session import open_session

from .test_session import LAYERS, assert_same_state, batch, batches, local_bn_net

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_session_steps_on_cuda_equal_local_adam_steps_on_cuda(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    local = local_bn_net(dtype)
    name = str(dtype).removeprefix("torch.")
    body = {"model": {"layers": LAYERS, "dtype": name, "weights": {k: to_wire(v) for k, v in local.state_dict().items()}},
            "optimizer": {"type": "adam", "lr": 1e-2}, "options": {"clip": {"max_norm": 0.1}}}
    create = msgspec.convert(body, wire.SessionCreate)
    config = EngineConfig()
    session = open_session(create, config, EngineCaches.for_config(config), device)
    local = local.to(device)
    opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    for x, y in batches(3, dtype):
        session.train_step(batch(x, y))
        F.cross_entropy(local(x.to(device)), y.to(device)).backward()
        torch.nn.utils.clip_grad_norm_(local.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
    assert_same_state(session, local, opt, dtype)
    again = open_session(create, config, EngineCaches.for_config(config), device, restoring=True)
    again.restore(*session_state.from_bytes(session_state.to_bytes(*session.state())))
    for k, v in session.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[k], v), k
