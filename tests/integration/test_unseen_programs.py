"""Training programs in the style of public ones, written for these tests, through the SDK, the API, Redis and
a real worker: what torch.export alone cannot capture (distributions validating their arguments, control flow
on a tensor's value, attribute tensors assigned in forward, a boolean mask's data-dependent shape) goes as the
program the forward ran (capture "trace"); ops without a gradient and ops outside the core opset in forward;
a sparse buffer; sparse (COO, CSR) and complex parameters; a forward that writes its input. Every gradient
equals local autograd; three optimizer loops end on the local loop's weights and buffers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from gradclient.errors import BadOptionError

pytestmark = pytest.mark.timeout(600)
TOL = 1e-4


def local(model: nn.Module, *inputs) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(*inputs)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def send(client, model: nn.Module, *inputs, **options):
    return client.gradients(model, inputs if len(inputs) > 1 else inputs[0], loss="output", numcheck="off", **options)


def assert_same(result, loss: float, want: dict[str, torch.Tensor]) -> None:
    assert abs(result.loss - loss) <= TOL * max(1.0, abs(loss)), (result.loss, loss)
    got = {n: g for n, g in result.gradients.items() if g is not None}
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, g in want.items():
        assert got[name].layout == g.layout, (name, got[name].layout, g.layout)  # a sparse gradient comes sparse
        g = g.to_dense()
        scale = max(float(g.abs().max()), 1e-30)
        err = float((torch.as_tensor(got[name]).to_dense().to(g.dtype) - g).abs().max())
        assert err <= TOL * scale, f"{name}: max error {err:.3g} against scale {scale:.3g}"


def same_both_ways(client, make, *inputs, **options):
    """The program's loss and gradients locally (on a copy: forward may write state) and through the service."""
    rng = torch.random.get_rng_state()
    here = make()
    torch.random.set_rng_state(rng)
    there = make()  # the same weights (a sparse CSR buffer cannot be deep-copied)
    loss, want = local(here, *[x.clone() for x in inputs])
    result = send(client, there, *inputs, **options)
    assert_same(result, loss, want)
    return result, here, there


# -- ops without a gradient, and ops outside the core opset, in forward -------------------------------------------


class BucketisedRecommender(nn.Module):
    """A tabular recommender: a numeric feature bucketised against fixed boundaries and one-hot encoded, the
    item id's embedding, positions from arange, the argmax of a score as a hard choice, and a bilinear
    user-item interaction (nn.Bilinear: an op outside the core opset)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("edges", torch.tensor([-1.0, 0.0, 1.0]))
        self.items = nn.Embedding(10, 6)
        self.user = nn.Linear(4 + 3, 6)
        self.inter = nn.Bilinear(6, 6, 1)

    def forward(self, feats: torch.Tensor, item: torch.Tensor, clicked: torch.Tensor) -> torch.Tensor:
        bucket = F.one_hot(torch.bucketize(feats[:, 0].contiguous(), self.edges), 4).to(feats.dtype)
        pos = torch.arange(feats.shape[0], device=feats.device) % 3
        u = torch.tanh(self.user(torch.cat([bucket, feats], 1) + pos[:, None]))
        v = self.items(item)
        hard = F.one_hot(u.argmax(1), 6).to(u.dtype)  # a hard choice: no gradient through it
        score = self.inter(u + hard, v).squeeze(1)
        return F.binary_cross_entropy_with_logits(score, clicked)


def test_a_recommender_with_bucketize_one_hot_arange_argmax_and_a_bilinear_interaction(client):
    torch.manual_seed(0)
    feats, item, clicked = torch.randn(6, 3), torch.randint(0, 10, (6,)), torch.rand(6).round()
    same_both_ways(client, BucketisedRecommender, feats, item, clicked)


# -- a boolean mask from __init__, and one computed in forward -----------------------------------------------------


class NTXent(nn.Module):
    """A SimCLR-style contrastive loss: two views' projections, a similarity matrix, and `sim[mask]` with the
    mask of off-diagonal pairs built in __init__ for a fixed batch."""

    def __init__(self, batch: int = 4, t: float = 0.5) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 4))
        self.t = t
        n = 2 * batch
        self.register_buffer("mask", ~torch.eye(n, dtype=torch.bool))
        self.register_buffer("pairs", torch.cat([torch.arange(batch, n), torch.arange(0, batch)]))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.proj(torch.cat([a, b])), dim=1)
        sim = z @ z.t() / self.t
        negatives = sim[self.mask].view(z.shape[0], -1)
        positives = sim[torch.arange(z.shape[0]), self.pairs]
        return (torch.logsumexp(negatives, 1) - positives).mean()


def test_a_contrastive_loss_indexing_with_a_mask_built_in_init(client, http):
    torch.manual_seed(0)
    result, _, _ = same_both_ways(client, NTXent, torch.randn(4, 5), torch.randn(4, 5))
    assert result.capture == "trace" and result.specialised["sizes"]
    # The service says it too: the graph carries its capture and guards, the result echoes them.
    answer = http.get(f"/jobs/{result.job_id}").json()["result"]
    assert answer["capture"] == "trace" and answer["specialised"]["sizes"] == result.specialised["sizes"]
    assert answer["specialised"]["inputs"] == [{"shape": [4, 5], "dtype": "float32"}] * 2


class HardExampleLoss(nn.Module):
    """Online hard-example mining: the loss averages the examples whose loss is above the batch's mean, rows
    picked by a mask computed in forward (its number of rows depends on the values)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per = F.cross_entropy(self.net(x), y, reduction="none")
        hard = per[per > per.mean()]
        return hard.mean()


def test_rows_picked_by_a_mask_computed_in_forward(client):
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    result, _, _ = same_both_ways(client, HardExampleLoss, x, y)
    assert result.capture == "trace"


# -- Python control flow on a tensor's value, and distributions validating their arguments ------------------------


class ClippedPolicy(nn.Module):
    """A policy-gradient loss: a Categorical over actions and a Normal over a continuous action, both with
    validate_args=True (their checks read tensor values), an entropy bonus only while it is above a floor (an
    `if` on a tensor's value), and the advantage normalised only when the batch's spread is not tiny."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.logits, self.mu = nn.Linear(16, 3), nn.Linear(16, 1)
        self.log_std = nn.Parameter(torch.zeros(1))

    def forward(self, obs: torch.Tensor, act: torch.Tensor, cont: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
        h = self.body(obs)
        pi = torch.distributions.Categorical(logits=self.logits(h), validate_args=True)
        gauss = torch.distributions.Normal(self.mu(h).squeeze(1), self.log_std.exp(), validate_args=True)
        if adv.std() > 1e-3:
            adv = (adv - adv.mean()) / adv.std()
        loss = -((pi.log_prob(act) + gauss.log_prob(cont)) * adv).mean()
        entropy = pi.entropy().mean()
        if entropy > 0.5:
            loss = loss - 0.01 * entropy
        return loss


def test_a_policy_gradient_loss_with_validating_distributions_and_control_flow_on_values(client):
    torch.manual_seed(2)
    args = torch.randn(6, 4), torch.randint(0, 3, (6,)), torch.randn(6), torch.randn(6)
    result, _, _ = same_both_ways(client, ClippedPolicy, *args)
    assert result.capture == "trace"


class GaussianVAE(nn.Module):
    """A VAE's loss with the noise given as an input: the posterior and the prior as validating Normals, the
    KL divergence by torch.distributions, a Bernoulli likelihood with validate_args (its support check reads
    the targets' values)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 4), nn.Linear(2, 6)

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        mu, log_var = self.enc(x).chunk(2, dim=1)
        q = torch.distributions.Normal(mu, (0.5 * log_var).exp(), validate_args=True)
        p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu), validate_args=True)
        z = mu + (0.5 * log_var).exp() * eps
        like = torch.distributions.Bernoulli(logits=self.dec(z), validate_args=True)
        return (torch.distributions.kl_divergence(q, p).sum(1) - like.log_prob(x).sum(1)).mean()


def test_a_vae_loss_with_validating_distributions(client):
    torch.manual_seed(3)
    same_both_ways(client, GaussianVAE, torch.rand(5, 6).round(), torch.randn(5, 2))


# -- state written in forward ---------------------------------------------------------------------------------------


class ActNormFlow(nn.Module):
    """A normalising flow's layer: a batch-norm that keeps the batch statistics it used as attributes assigned in
    forward (for the inverse pass), an EMA codebook held as a plain tensor attribute, and the flow's
    log-likelihood."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.register_buffer("batch_mean", torch.zeros(d))
        self.register_buffer("batch_var", torch.ones(d))
        self.codebook = torch.zeros(d)  # not a buffer: a plain attribute
        self.log_gamma, self.beta = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        mean, var = h.mean(0), h.var(0, unbiased=False) + 1e-5
        self.batch_mean, self.batch_var = mean.detach(), var.detach()
        self.codebook = 0.9 * self.codebook + 0.1 * h.detach().mean(0)
        z = (h - mean) / var.sqrt() * self.log_gamma.exp() + self.beta
        log_det = (self.log_gamma - 0.5 * var.log()).sum() + torch.slogdet(self.lin.weight)[1]
        return (0.5 * (z ** 2).sum(1)).mean() - log_det


def test_attribute_tensors_assigned_in_forward_come_back_like_buffers(client):
    torch.manual_seed(4)
    x = torch.randn(6, 3)
    result, here, there = same_both_ways(client, ActNormFlow, x)
    assert set(result.buffers) >= {"batch_mean", "batch_var", "codebook"}
    for name in ("batch_mean", "batch_var", "codebook"):
        assert torch.allclose(getattr(there, name), getattr(here, name), atol=1e-6), name


def test_an_sgd_loop_with_state_written_in_forward_ends_on_the_local_loops_state(client):
    torch.manual_seed(5)
    here = ActNormFlow()
    there = copy.deepcopy(here)
    opt_here, opt_there = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (here, there))
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(6, 3, generator=gen)
        opt_here.zero_grad()
        here(x).backward()
        opt_here.step()
        result = send(client, there, x)
        opt_there.zero_grad()
        result.set_grads(there)
        opt_there.step()
    for name, t in here.state_dict().items():
        assert torch.allclose(there.state_dict()[name], t, atol=1e-5), name
    assert torch.allclose(there.codebook, here.codebook, atol=1e-5)


# -- a sparse buffer, a complex buffer, a forward that writes its input ---------------------------------------------


class SparseGraphNet(nn.Module):
    """A two-layer GCN whose normalised adjacency is a sparse COO buffer registered in __init__, with a
    spectral filter held as a complex buffer on the node features."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        edges = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4, 4, 0], [1, 0, 2, 1, 3, 2, 4, 3, 0, 4]])
        adj = torch.sparse_coo_tensor(edges, torch.full((10,), 0.5), (5, 5)).coalesce()
        self.register_buffer("adj", adj if layout == torch.sparse_coo else adj.to_sparse_csr())
        self.register_buffer("filter", torch.polar(torch.ones(3), torch.linspace(0, 1, 3)))
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        spec = torch.fft.rfft(x, dim=1) * self.filter
        x = torch.fft.irfft(spec, n=x.shape[1], dim=1)
        h = torch.relu(torch.sparse.mm(self.adj, self.l1(x)))
        return F.cross_entropy(torch.sparse.mm(self.adj, self.l2(h)), y)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_a_gcn_with_a_sparse_adjacency_buffer_and_a_complex_filter(client, layout):
    torch.manual_seed(6)
    same_both_ways(client, lambda: SparseGraphNet(layout), torch.randn(5, 4), torch.randint(0, 2, (5,)))


class TransformerNet(nn.Module):
    """A fast-neural-style network's first layers: the batch scaled to [0, 1] in place (`x.div_(255)`), then
    reflection padding, a convolution and instance normalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.pad, self.conv = nn.ReflectionPad2d(1), nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4, affine=True)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = x.div_(255)
        return F.mse_loss(torch.relu(self.norm(self.conv(self.pad(x)))), target)


class LearnedGraphNet(nn.Module):
    """A graph network that learns its edges' weights: a sparse parameter with the edges' pattern (COO or CSR:
    its gradient is sparse, on the same pattern), and a learned complex spectral filter on the node features."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        edges = torch.tensor([[0, 1, 1, 2, 2, 3, 3, 4, 4, 0], [1, 0, 2, 1, 3, 2, 4, 3, 0, 4]])
        adj = torch.sparse_coo_tensor(edges, torch.rand(10) + 0.5, (5, 5)).coalesce()
        self.adj = nn.Parameter(adj if layout == torch.sparse_coo else adj.to_sparse_csr())
        self.filter = nn.Parameter(torch.polar(torch.ones(3), torch.linspace(0, 1, 3)))
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.fft.irfft(torch.fft.rfft(x, dim=1) * self.filter, n=x.shape[1], dim=1)
        h = torch.tanh(torch.sparse.mm(self.adj, self.l1(x)))
        return F.cross_entropy(torch.sparse.mm(self.adj, self.l2(h)), y)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_sparse_and_complex_parameters_and_an_sgd_loop_on_them(client, layout):
    torch.manual_seed(9)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    result, _, there = same_both_ways(client, lambda: LearnedGraphNet(layout), x, y)
    assert result.gradients["filter"].is_complex()
    checked = client.gradients(there, (x, y), loss="output", numcheck="auto")
    # Finite differences step dense real elements: nothing is checked, and the result says so.
    assert checked.numcheck.passed is None and "'adj'" in checked.numcheck.reason, checked.numcheck.reason
    with pytest.raises(BadOptionError, match="parameter 'adj' is sparse"):  # clipping takes dense gradients
        client.gradients(there, (x, y), loss="output", numcheck="off", clip={"max_norm": 1.0})
    torch.manual_seed(10)
    here = LearnedGraphNet(layout)
    torch.manual_seed(10)
    there = LearnedGraphNet(layout)  # the same weights (a sparse CSR parameter cannot be deep-copied)
    opt_here, opt_there = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (here, there))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 4, generator=gen)
        opt_here.zero_grad()
        here(x, y).backward()
        opt_here.step()
        result = send(client, there, x, y)
        opt_there.zero_grad()
        result.set_grads(there)
        opt_there.step()
    for (name, a), (_, b) in zip(here.named_parameters(), there.named_parameters()):
        assert a.layout == b.layout and torch.allclose(b.to_dense(), a.to_dense(), atol=1e-5), name


class GatedGraphNet(LearnedGraphNet):
    """The same, its hidden layer squashed only when its activations are large (an `if` on a value): recorded."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.fft.irfft(torch.fft.rfft(x, dim=1) * self.filter, n=x.shape[1], dim=1)
        h = torch.sparse.mm(self.adj, self.l1(x))
        if h.abs().mean() > 0.1:
            h = torch.tanh(h)
        return F.cross_entropy(torch.sparse.mm(self.adj, self.l2(h)), y)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_sparse_and_complex_parameters_in_a_recorded_forward(client, layout):
    torch.manual_seed(11)
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    result, _, _ = same_both_ways(client, lambda: GatedGraphNet(layout), x, y)
    assert result.capture == "trace" and result.gradients["adj"].layout == layout


def test_a_forward_that_divides_its_input_in_place(client):
    torch.manual_seed(7)
    x, target = torch.randint(0, 256, (2, 3, 6, 6)).float(), torch.rand(2, 4, 6, 6)
    kept = x.clone()
    same_both_ways(client, TransformerNet, x, target)
    assert torch.equal(x, kept)  # the SDK sent the batch; the caller's tensor is as it was


# -- a specialised capture reused while its guards hold -------------------------------------------------------------


class GatedDepth(nn.Module):
    """Adaptive computation: a second block runs only when the first block's output is large (an `if` on a
    value), and a validating distribution's log-likelihood as the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.stats = torch.zeros(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.stats = h.detach().mean(0)
        if h.abs().mean() > 0.4:
            h = h + torch.tanh(self.b(h))
        with torch.no_grad():
            self.steps += 1
        return -torch.distributions.Normal(h, 1.0, validate_args=True).log_prob(y).mean()


def test_an_adam_loop_reuses_the_recorded_graph_while_its_guards_hold_and_records_again_when_not(client):
    torch.manual_seed(8)
    here = GatedDepth()
    there = copy.deepcopy(here)
    opt_here, opt_there = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (here, there))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=gen) * s, torch.randn(5, 4, generator=gen)) for s in (0.1, 0.1, 3.0)]
    results = []
    for x, y in batches:
        opt_here.zero_grad()
        here(x, y).backward()
        opt_here.step()
        results.append(send(client, there, x, y))
        opt_there.zero_grad()
        results[-1].set_grads(there)
        opt_there.step()
    assert [r.capture for r in results] == ["trace"] * 3
    taken = [r.specialised["values"] for r in results]
    assert taken[0] == taken[1] != taken[2]  # the third batch took the other branch: recorded again
    assert results[0].graph_ref == results[1].graph_ref != results[2].graph_ref
    for name, t in here.state_dict().items():
        assert torch.allclose(there.state_dict()[name], t, atol=1e-5), name
    assert int(there.steps) == 3 and torch.allclose(there.stats, here.stats, atol=1e-6)


# -- keyword inputs, and a loss with a gradient inside it, through the recording ---------------------------------


class KeywordLM(nn.Module):
    """Called as Hugging Face models are, model(input_ids=..., attention_mask=..., labels=...), with a branch on a
    value that sends it to the recording."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)  # (batch, seq, 8)
        if float(attention_mask.sum()) < attention_mask.numel():  # padding present: a value read
            h = h / attention_mask.sum(1, keepdim=True).unsqueeze(-1)
        logits = self.head(h)  # (batch, seq, vocab): the loss over every position
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


@pytest.mark.parametrize("padded", [False, True])
def test_a_model_called_with_keyword_inputs_is_recorded_with_their_names(client, padded):
    torch.manual_seed(0)
    model = KeywordLM()
    ids, labels = torch.randint(0, 20, (3, 5)), torch.randint(0, 20, (3, 5))
    mask = torch.ones(3, 5)
    if padded:
        mask[1, 3:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss = model(**inputs)["loss"]
    params = dict(model.named_parameters())
    want = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    result = client.gradients(model, inputs, loss="output", numcheck="off")
    assert result.capture == "trace"
    assert_same(result, float(loss), want)


class GradientPenaltyCritic(nn.Module):
    """A WGAN-GP critic step: the penalty on the input gradient at interpolates, taken with create_graph=True."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 1))

    def forward(self, real, fake, alpha):
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(self.net(mixed).sum(), mixed, create_graph=True)
        return self.net(fake).mean() - self.net(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()


def test_a_gradient_penalty_through_tanh_and_sigmoid_equals_local_autograd_and_is_checked(client):
    torch.manual_seed(0)
    real, fake, alpha = torch.randn(8, 4), torch.randn(8, 4) + 1, torch.rand(8, 1)
    result, _, _ = same_both_ways(client, GradientPenaltyCritic, real, fake, alpha)
    assert result.capture == "trace"
    checked = client.gradients(GradientPenaltyCritic().double(), (real.double(), fake.double(), alpha.double()),
                               loss="output", numcheck="exact")
    assert checked.numcheck.passed is True, checked.numcheck.reason


class NumpyMixing(nn.Module):
    """A WGAN-GP critic drawing its interpolation weights with numpy's generator inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, real, fake):
        import numpy as np

        alpha = torch.from_numpy(np.random.rand(real.shape[0], 1).astype(np.float32))  # this call's draws
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(self.net(mixed).sum(), mixed, create_graph=True)
        return self.net(fake).mean() - self.net(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()


def test_a_forward_drawing_with_numpy_is_recorded_with_this_calls_draws_and_not_refused_by_the_verification(client):
    torch.manual_seed(0)
    real, fake = torch.randn(6, 4), torch.randn(6, 4) + 1
    result = client.gradients(NumpyMixing(), (real, fake), loss="output", numcheck="exact")
    assert result.capture == "trace" and result.specialised["constants"]
    assert result.numcheck.passed is True, result.numcheck.reason
