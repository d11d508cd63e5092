"""A session over several workers (docs/sessions.md, "A session over several workers"), on the live stack: three
real worker processes, Redis, HTTP, torch.distributed's gloo between the workers. A session with `workers: 2`
splits each batch between two replicas and all-reduces their gradients: after 10 AdamW steps its weights equal a
local torch.optim loop and the one-worker session (each tensor within 1e-12 of its norm in float64, 1e-6 in
float32, where the parts' sum rounds apart); BatchNorm's buffers
are rank 0's (DistributedDataParallel's rule); a member killed with SIGKILL mid-run fails its call member_lost,
nothing acknowledged is lost or applied twice, and the session goes on over the workers alive; fewer live workers
than asked is 503 workers_full; the members are listed and each answer carries every member's rows and times."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import httpx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradclient import Client
from gradclient.errors import WorkersFullError
from tests.support.stack import module_stack

pytestmark = pytest.mark.timeout(600)
workers_stack = module_stack(workers=3, GRADSVC_WORKER_HEARTBEAT_S="1", GRADSVC_SESSION_COLLECTIVE_TIMEOUT_S="20")


def mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).to(dtype)


def batches(n: int, dtype: torch.dtype, rows: int = 13) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(rows, 6, generator=g, dtype=dtype), torch.randint(0, 4, (rows,), generator=g))
            for _ in range(n)]


def local(model: nn.Module, data) -> nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def trained(client: Client, model: nn.Module, data, workers: int, page: list | None = None, run: str | None = None):
    with client.session(model, "adamw", lr=1e-2, weight_decay=0.01, workers=workers, run=run) as s:
        outs = [s.step(x, y) for x, y in data]
        got = copy.deepcopy(model)
        s.pull(got)
        info = s.info()
        if page is not None:
            page.append(httpx.get(f"{client.base_url}/ui/sessions/{s.session_id}", timeout=30).text)
    return got, outs, info


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_two_workers_weights_after_ten_adamw_steps_equal_one_worker_and_the_local_loop(workers_stack, dtype, rtol):
    net, data = mlp(dtype), batches(10, dtype)
    want = local(net, data)
    page: list[str] = []
    with Client(workers_stack.base_url, timeout=120) as client:
        run = f"workers-{str(dtype).removeprefix('torch.')}"
        two, outs, info = trained(client, net, data, 2, page, run=run)
        one, single, _ = trained(client, net, data, 1)
        steps = httpx.get(f"{client.base_url}/runs/{run}", timeout=30).json()["steps"]
    assert 'id="session-members"' in page[0] and all(w in page[0] for w in info.members)  # the session's page
    assert [s["step"] for s in steps] == list(range(10))  # rank 0 records each optimizer step, once
    assert len(info.members) == 2 and len(set(info.members)) == 2 and info.worker == info.members[0]
    assert [o.step for o in outs] == list(range(1, 11))
    for a, b in zip(outs, single):  # the batch's loss: the parts' shares summed
        assert a.loss == pytest.approx(b.loss, rel=rtol * 10)
    members = outs[-1].raw.members
    assert [m.rows for m in members] == [6, 7] and all(m.compute_ms > 0 for m in members)
    for name, value in want.state_dict().items():  # float32: the parts' sum rounds apart, within 1e-6 of the norm
        for other in (value, one.state_dict()[name]):
            apart = float((two.state_dict()[name] - other).norm() / other.norm())
            assert apart <= rtol, (name, apart)


def test_batchnorm_buffers_are_rank_zeros_as_distributed_data_parallel_keeps_them(workers_stack):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4)).double()
    data = batches(3, torch.float64, rows=8)
    want = copy.deepcopy(net)  # rank 0's replica: its part's statistics, the gradient of the whole batch
    opt = torch.optim.AdamW(want.parameters(), lr=1e-2, weight_decay=0.01)
    for x, y in data:
        halves = [copy.deepcopy(want), copy.deepcopy(want)]
        losses = [F.cross_entropy(h(x[i * 4:(i + 1) * 4]), y[i * 4:(i + 1) * 4]) * 0.5 for i, h in enumerate(halves)]
        for h, loss in zip(halves, losses):
            loss.backward()
        for p, a, b in zip(want.parameters(), *(h.parameters() for h in halves)):
            p.grad = a.grad + b.grad
        opt.step()
        opt.zero_grad()
        for name, buf in halves[0].named_buffers():
            want.get_buffer(name).copy_(buf)
    with Client(workers_stack.base_url, timeout=120) as client:
        got, _, _ = trained(client, net, data, 2)
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_more_workers_than_are_alive_is_a_503_workers_full(workers_stack):
    x, y = batches(1, torch.float64)[0]
    with Client(workers_stack.base_url, timeout=60, retries=0) as client:
        with pytest.raises(WorkersFullError, match="options.workers=5: 3 workers"):
            with client.session(mlp(torch.float64), "sgd", lr=0.1, workers=5) as s:
                s.step(x, y)


def test_a_member_killed_mid_run_loses_nothing_acknowledged_and_the_session_goes_on(workers_stack):
    """The steps go back to back in a thread; the second member is killed as soon as step 3 is acknowledged, so
    the kill lands in step 4 (its report, its pass or its all-reduce): that call fails member_lost on rank 0, the
    API sends it again to the members alive (the third worker in the dead one's place, the replicas rebuilt from
    the checkpoint of step 3), and every step is applied once."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)).double()
    data = batches(8, torch.float64, rows=512)
    want = local(net, data)
    done: list[int] = []
    with Client(workers_stack.base_url, timeout=120) as client:
        with client.session(net, "adamw", lr=1e-2, weight_decay=0.01, workers=2, checkpoint_every=1) as s:
            s.step(*data[0])
            victim = s.info().members[1]
            steps = threading.Thread(target=lambda: done.extend(s.step(x, y).step for x, y in data[1:]))
            steps.start()
            while len(done) < 2 and steps.is_alive():
                time.sleep(0.001)
            proc = next(p for p in workers_stack.workers if p.pid == int(victim.split("-")[-2]))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            steps.join()
            info = s.info()
            got = copy.deepcopy(net)
            s.pull(got)
    assert done == list(range(2, 9)) and info.step == 8, done
    assert victim not in info.members and len(info.members) == 2
    for name, value in want.state_dict().items():  # a step applied twice, or lost, is 1e-3 off
        apart = float((got.state_dict()[name] - value).norm() / value.norm())
        assert apart <= 1e-12, (name, apart)
    workers_stack.start_worker()
    workers_stack.wait_ready(3)
