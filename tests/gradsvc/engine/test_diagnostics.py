"""options.diagnostics, options.clip and options.curvature through compute(), each against the answer key a
user would otherwise run: BackPACK for variance and second moment, Opacus's definition for per-example
clipping, clip_grad_norm_ for global clipping, exact Hessians and GGNs from torch.func for curvature."""

from __future__ import annotations

import copy

import msgspec
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from gradclient.export import export_graph
from gradclient.tensors import from_wire, to_wire
from gradsvc.engine import EngineConfig, SpecError, compute, prepare
from gradsvc.wire import GradientRequest

F64 = torch.float64
CNN_LAYERS = [{"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3},
              {"type": "ReLU"}, {"type": "Flatten"}, {"type": "Linear", "in_features": 12, "out_features": 3}]


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3)).to(F64)


def cnn_batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 2, 4, 4, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def body(model, x, y, loss, options, weights=None, **extra) -> dict:
    return {"model": {**model, "dtype": str(x.dtype).removeprefix("torch.") if x.is_floating_point() else "float64",
                      "weights": {k: to_wire(v, "msgpack") for k, v in weights.items()}, **extra},
            "inputs": to_wire(x, "msgpack"), "targets": to_wire(y, "msgpack"), "loss": loss,
            "options": {"numcheck": "off", "memory": False, **options}}


def layer_request(module: nn.Module, x, y, loss="cross_entropy", layers=CNN_LAYERS, **options) -> GradientRequest:
    raw = body({"layers": layers}, x, y, loss, options, module.state_dict())
    return msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=GradientRequest)


def graph_request(module: nn.Module, x, y, loss="cross_entropy", **options) -> GradientRequest:
    exported = export_graph(module, (x,))
    raw = body({"graph": exported.graph}, x, y, loss, options, exported.weights)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=GradientRequest)


def loss_fn(loss: str, reduction: str = "mean"):
    return {"cross_entropy": nn.CrossEntropyLoss, "mse": nn.MSELoss}[loss](reduction=reduction)


def params_of(module):
    return {n: p.detach() for n, p in module.named_parameters()}


def per_example_grads(module, x, y, loss="cross_entropy"):
    """Each example's own loss gradient by torch.func, the definition Opacus and the noise scale use."""
    buffers = dict(module.named_buffers())
    fn = loss_fn(loss)

    def one(ps, xi, yi):
        return fn(functional_call(module, {**ps, **buffers}, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params_of(module), x, y)


def batch_grads(module, x, y, loss="cross_entropy", reduction="mean"):
    m = copy.deepcopy(module)
    value = loss_fn(loss, reduction)(m(x), y)
    return dict(zip(dict(m.named_parameters()), torch.autograd.grad(value, list(m.parameters()))))


def decoded(d):
    return {k: from_wire(v) for k, v in d.items()}


def assert_close(got: dict, want: dict, rel: float) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert float((got[k].to(F64) - w.to(F64)).abs().max()) <= rel * max(float(w.abs().max()), 1e-30), k


# --- norms, variance, second moment, noise scale ------------------------------------------------------------

def test_norms_are_those_of_the_batch_gradient_per_parameter_and_per_layer():
    module, (x, y) = cnn(), cnn_batch()
    result = compute(layer_request(module, x, y, diagnostics=["norms"]), EngineConfig())
    want = batch_grads(module, x, y)
    norms = result.diagnostics.norms
    assert norms.global_ == pytest.approx(float(torch.cat([g.reshape(-1) for g in want.values()]).norm()), rel=1e-12)
    assert norms.parameters == pytest.approx({k: float(g.norm()) for k, g in want.items()}, rel=1e-12)
    assert set(norms.modules) == {"0", "3"}
    assert norms.modules["3"] == pytest.approx(float(torch.cat([want["3.weight"].reshape(-1), want["3.bias"]]).norm()))
    assert result.diagnostics.variance is None and result.per_sample is None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_variance_and_second_moment_equal_backpacks(reduction):
    from backpack import backpack, extend
    from backpack.extensions import SumGradSquared, Variance

    module, (x, y) = cnn(), cnn_batch()
    req = layer_request(module, x, y, {"type": "cross_entropy", "reduction": reduction},
                        diagnostics=["variance", "second_moment"])
    result = compute(req, EngineConfig())
    local = extend(copy.deepcopy(module))
    with backpack(Variance(), SumGradSquared()):
        extend(nn.CrossEntropyLoss(reduction=reduction))(local(x), y).backward()
    assert_close(decoded(result.diagnostics.variance), {n: p.variance for n, p in local.named_parameters()}, 1e-10)
    assert_close(decoded(result.diagnostics.second_moment),
                 {n: p.sum_grad_squared for n, p in local.named_parameters()}, 1e-10)


def noise_scale_formula(per_example: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    flat = torch.cat([g.reshape(g.shape[0], -1) for g in per_example.values()], dim=1)  # (batch, P)
    n = flat.shape[0]
    g = flat.mean(0)
    s = float(((flat - g) ** 2).sum()) / (n - 1)
    g2 = float(g @ g) - s / n
    return s / g2, s, g2


def test_noise_scale_follows_mccandlish_b_simple():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    layers = [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
              {"type": "Linear", "in_features": 8, "out_features": 3}]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 6, generator=g, dtype=F64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # learnable labels: the gradient stands above its noise
    result = compute(layer_request(module, x, y, layers=layers, diagnostics=["noise_scale"]), EngineConfig())
    b, s, g2 = noise_scale_formula(per_example_grads(module, x, y))
    got = result.diagnostics.noise_scale
    assert g2 > 0 and got.reason == ""
    assert (got.b_simple, got.trace_covariance, got.gradient_norm_squared) == pytest.approx((b, s, g2), rel=1e-10)


def test_noise_scale_is_null_with_a_reason_for_a_single_example():
    module, (x, y) = cnn(), cnn_batch(1)
    got = compute(layer_request(module, x, y, diagnostics=["noise_scale"]), EngineConfig()).diagnostics.noise_scale
    assert got.b_simple is None and "at least 2" in got.reason


# --- clipping -----------------------------------------------------------------------------------------------

def test_global_clip_scales_the_gradients_as_clip_grad_norm():
    module, (x, y) = cnn(), cnn_batch()
    result = compute(layer_request(module, x, y, diagnostics=["norms"], clip={"max_norm": 0.05}), EngineConfig())
    local = copy.deepcopy(module)
    loss_fn("cross_entropy")(local(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(local.parameters(), 0.05)
    assert_close(decoded(result.gradients), {n: p.grad for n, p in local.named_parameters()}, 1e-12)
    assert result.clip.total_norm == pytest.approx(float(total), rel=1e-12)
    assert result.clip.scale < 1 and result.diagnostics.norms.global_ == pytest.approx(float(total), rel=1e-12)


def opacus_step(per_example: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Opacus's DP-SGD step without noise: factor min(1, C / (|g_n| + 1e-6)) per example, summed, / N."""
    n = next(iter(per_example.values())).shape[0]
    norms = torch.stack([g.reshape(n, -1).norm(dim=1) for g in per_example.values()]).norm(dim=0)
    factor = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.einsum("n,n...->...", factor, g) / n for k, g in per_example.items()}


def test_per_sample_clip_is_opacus_step_and_counts_the_clipped_examples():
    module, (x, y) = cnn(), cnn_batch()
    result = compute(layer_request(module, x, y, clip={"max_norm": 2.2, "per_sample": True}), EngineConfig())
    per_example = per_example_grads(module, x, y)
    assert_close(decoded(result.gradients), opacus_step(per_example, 2.2), 1e-10)
    norms = torch.stack([g.reshape(6, -1).norm(dim=1) for g in per_example.values()]).norm(dim=0)
    assert 0 < result.clip.clipped == int((norms > 2.2).sum()) < 6 and result.clip.examples == 6


def test_per_sample_noise_repeats_per_seed_and_has_the_stated_spread():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)).to(F64)
    layers = [{"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "Tanh"},
              {"type": "Linear", "in_features": 64, "out_features": 2}]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 64, generator=g, dtype=F64), torch.randint(0, 2, (8,), generator=g)

    def run(seed):
        req = layer_request(module, x, y, layers=layers, clip={"max_norm": 0.5, "per_sample": True,
                                                              "noise_multiplier": 2.0})
        req.model.seed = seed
        return decoded(compute(req, EngineConfig()).gradients)

    clean = opacus_step(per_example_grads(module, x, y), 0.5)
    first, again, other = run(1), run(1), run(2)
    assert_close(again, first, 0.0)
    noise = torch.cat([(first[k] - clean[k]).reshape(-1) * 8 for k in clean])  # (P,) noise before the / N
    other_noise = torch.cat([(other[k] - clean[k]).reshape(-1) * 8 for k in clean])
    assert noise.numel() > 4000 and float(noise.std()) == pytest.approx(2.0 * 0.5, rel=0.05)
    assert abs(float(noise.mean())) < 4 * 1.0 / noise.numel() ** 0.5
    assert float((noise - other_noise).abs().max()) > 0.1


# --- curvature ----------------------------------------------------------------------------------------------

def flat_loss(module, x, y, loss="cross_entropy"):
    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for p in module.parameters()]
    buffers = dict(module.named_buffers())

    def unflat(theta):
        out, i = {}, 0
        for n, s in zip(names, shapes):
            k = s.numel()
            out[n] = theta[i:i + k].reshape(s)
            i += k
        return out

    theta = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return theta, unflat, lambda t: loss_fn(loss)(functional_call(module, {**unflat(t), **buffers}, (x,)), y)


def exact_hessian(module, x, y, loss="cross_entropy"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    theta, _, f = flat_loss(module, x, y, loss)
    with sdpa_kernel([SDPBackend.MATH]):  # the fused attention kernels have no second derivative
        return torch.func.hessian(f)(theta)


def differenced_hessian(module, x, y, loss="cross_entropy", eps=1e-5):
    """Central differences of float64 gradients, column by column: the key where torch's own second
    derivatives are not symmetric (torch.func.hessian of nn.TransformerEncoderLayer is off by 5e-3 in its
    LayerNorm weight's rows, while these columns agree with their transpose to 1e-11)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    theta, _, f = flat_loss(module, x, y, loss)
    steps = eps * torch.eye(theta.numel(), dtype=theta.dtype)  # (P, P)
    gradients = vmap(torch.func.grad(f))
    with sdpa_kernel([SDPBackend.MATH]):
        columns = [(gradients(theta + s) - gradients(theta - s)) / (2 * eps) for s in steps.split(128)]
    h = torch.cat(columns).T  # (P, P)
    assert float((h - h.T).abs().max()) < 1e-9
    return (h + h.T) / 2


def exact_ggn(module, x, y, loss="cross_entropy"):
    theta, unflat, _ = flat_loss(module, x, y, loss)
    buffers = dict(module.named_buffers())
    out_fn = lambda t: functional_call(module, {**unflat(t), **buffers}, (x,))  # noqa: E731
    out = out_fn(theta)
    jac = torch.func.jacrev(out_fn)(theta).reshape(out.numel(), -1)  # (outputs, P)
    h_out = torch.func.hessian(lambda o: loss_fn(loss)(o.reshape(out.shape), y))(out.reshape(-1))
    return jac.T @ h_out @ jac


def check_curvature(got, matrix: torch.Tensor, top: int) -> None:
    assert torch.equal(matrix, matrix.T) or float((matrix - matrix.T).abs().max()) < 1e-12  # a sound key
    exact = torch.linalg.eigvalsh(matrix).flip(0)
    assert got.top_eigenvalues == pytest.approx(exact[:top].tolist(), rel=1e-6)
    assert max(got.residuals) < 1e-3  # Lanczos stops on r^2 / gap, so residuals sit near the root of the tolerance
    trace = float(torch.trace(matrix))
    assert abs(got.trace - trace) <= 4 * got.trace_stderr
    weights, nodes = torch.tensor(got.density.weights, dtype=F64), torch.tensor(got.density.eigenvalues, dtype=F64)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)
    assert float(weights @ nodes) == pytest.approx(got.trace / matrix.shape[0], rel=1e-9)


CURVATURE = {"top": 3, "trace": True, "density": True, "probes": 40, "tolerance": 1e-8, "seed": 4}


@pytest.mark.parametrize("matrix", ["hessian", "ggn"])
def test_curvature_of_a_layer_spec_matches_the_exact_matrix(matrix):
    module, (x, y) = cnn(), cnn_batch()
    got = compute(layer_request(module, x, y, curvature={**CURVATURE, "matrix": matrix}), EngineConfig()).curvature
    exact = exact_hessian(module, x, y) if matrix == "hessian" else exact_ggn(module, x, y)
    assert got.matrix == matrix and got.products > 40
    check_curvature(got, exact, 3)


def test_eigenvectors_come_back_gradient_shaped_and_are_eigenvectors():
    module, (x, y) = cnn(), cnn_batch()
    got = compute(layer_request(module, x, y, curvature={"top": 2, "tolerance": 1e-10, "eigenvectors": True}),
                  EngineConfig()).curvature
    hessian = exact_hessian(module, x, y)
    for lam, vec, residual in zip(got.top_eigenvalues, got.eigenvectors, got.residuals):
        v = torch.cat([from_wire(vec[n]).reshape(-1) for n, _ in module.named_parameters()])
        assert float(v.norm()) == pytest.approx(1.0, rel=1e-12)
        assert float((hessian @ v - lam * v).norm()) / abs(lam) == pytest.approx(residual, rel=1e-6)
        assert residual < 1e-4


def test_curvature_leaves_the_gradients_and_the_check_alone():
    module, (x, y) = cnn(), cnn_batch()
    req = layer_request(module, x, y, curvature={"top": 1}, numcheck="exact")
    result = compute(req, EngineConfig())
    assert result.numcheck.passed
    assert_close(decoded(result.gradients), batch_grads(module, x, y), 1e-12)


# --- graph models -------------------------------------------------------------------------------------------

class TinyTransformer(nn.Module):
    """Token ids -> class logits: an embedding, one pre-norm encoder layer, mean-pooled, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))  # (batch, classes)


class BatchNormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))  # (batch, classes)


def graph_cases():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    transformer = TinyTransformer().to(F64).eval()
    ids = torch.randint(0, 10, (6, 5), generator=g)
    bn = BatchNormCNN().to(F64)
    bn.bn.running_mean.uniform_(-0.5, 0.5)
    bn.bn.running_var.uniform_(0.5, 2.0)
    bn.eval()
    images = torch.randn(6, 2, 5, 5, generator=g, dtype=F64)
    labels = torch.randint(0, 3, (6,), generator=g)
    return {"transformer": (transformer, ids, labels), "batchnorm_cnn": (bn, images, labels)}


@pytest.fixture(scope="module", params=["transformer", "batchnorm_cnn"])
def graph_case(request):
    return graph_cases()[request.param]


def test_graph_model_norms_statistics_and_clipping_match_their_definitions(graph_case):
    module, x, y = graph_case
    req = graph_request(module, x, y, diagnostics=["norms", "variance", "second_moment", "noise_scale"],
                        clip={"max_norm": 0.1, "per_sample": True})
    result = compute(req, EngineConfig())
    per_example = per_example_grads(module, x, y)
    want = batch_grads(module, x, y)
    norms = result.diagnostics.norms
    assert norms.parameters == pytest.approx({k: float(g.norm()) for k, g in want.items()}, rel=1e-10)
    n = x.shape[0]
    share = {k: g / n for k, g in per_example.items()}  # BackPACK's BatchGrad under a mean loss
    assert_close(decoded(result.diagnostics.second_moment), {k: (b ** 2).sum(0) for k, b in share.items()}, 1e-10)
    assert_close(decoded(result.diagnostics.variance),
                 {k: (b ** 2).sum(0) / n - (b.sum(0) / n) ** 2 for k, b in share.items()}, 1e-10)
    got = result.diagnostics.noise_scale
    _, s, g2 = noise_scale_formula(per_example)
    assert (got.trace_covariance, got.gradient_norm_squared) == pytest.approx((s, g2), rel=1e-10)
    assert_close(decoded(result.gradients), opacus_step(per_example, 0.1), 1e-10)


# The transformer's differenced Hessian takes the longest of these tests: make test-all runs it, the CNN's covers
# the same path (a graph model's Hessian products) in make test.
@pytest.mark.parametrize("name", [pytest.param("transformer", marks=pytest.mark.slow), "batchnorm_cnn"])
def test_graph_model_curvature_matches_the_exact_hessian(name):
    module, x, y = graph_cases()[name]
    got = compute(graph_request(module, x, y, curvature={**CURVATURE, "probes": 20}), EngineConfig()).curvature
    check_curvature(got, differenced_hessian(module, x, y), 3)


# --- refusals -----------------------------------------------------------------------------------------------

def refused(req: GradientRequest) -> SpecError:
    with pytest.raises(SpecError) as info:
        prepare(req, EngineConfig(), "meta")
    assert info.value.code == "bad_option"
    return info.value


def test_refuses_more_eigenvalues_than_parameters_with_bad_option():
    module, (x, y) = cnn(), cnn_batch()
    err = refused(layer_request(module, x, y, curvature={"top": 200}))
    assert "top=200" in err.message and "at most 96" in err.message


def test_refuses_density_without_probes_with_bad_option():
    module, (x, y) = cnn(), cnn_batch()
    assert "set probes" in refused(layer_request(module, x, y, curvature={"top": 0, "density": True})).message


def test_refuses_per_example_diagnostics_where_batch_norm_mixes_the_examples():
    layers = [{"type": "Linear", "in_features": 6, "out_features": 4}, {"type": "BatchNorm1d", "num_features": 4},
              {"type": "Linear", "in_features": 4, "out_features": 3}]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).to(F64)
    x, y = torch.randn(4, 6, dtype=F64), torch.tensor([0, 1, 2, 0])
    err = refused(layer_request(module, x, y, layers=layers, diagnostics=["norms", "variance"]))
    assert "options.diagnostics 'variance'" in err.message and "layer 1 (BatchNorm1d)" in err.message
    err = refused(layer_request(module, x, y, layers=layers, clip={"max_norm": 1.0, "per_sample": True}))
    assert "options.clip.per_sample" in err.message
    compute(layer_request(module, x, y, layers=layers, diagnostics=["norms"], clip={"max_norm": 1.0}), EngineConfig())


def test_refuses_clipping_a_model_without_trainable_parameters():
    x, y = torch.randn(4, 3, dtype=F64), torch.tensor([0, 1, 2, 0])
    req = layer_request(nn.Sequential(), x, y, layers=[{"type": "Tanh"}], input_grad=True, clip={"max_norm": 1.0})
    assert "no trainable parameter" in refused(req).message


def test_refuses_diagnostics_across_shards():
    module, (x, y) = cnn(), cnn_batch()
    assert "shards=1" in refused(layer_request(module, x, y, diagnostics=["norms"], shards=2)).message


# --- the Krylov basis's bound ----------------------------------------------------------------------------------

WIDE_LAYERS = [{"type": "Linear", "in_features": 200, "out_features": 100}]


def wide_request(**curvature) -> GradientRequest:
    torch.manual_seed(0)
    module = nn.Linear(200, 100).to(F64)
    x, y = torch.randn(4, 200, dtype=F64), torch.randint(0, 100, (4,))
    return layer_request(nn.Sequential(module), x, y, layers=WIDE_LAYERS, curvature=curvature)


def test_a_lanczos_basis_over_max_krylov_bytes_is_a_422_too_large_naming_the_setting_before_the_queue():
    """1e9 iterations of a 20,100-parameter model: a basis of up to P float64 vectors, 3.2 GB, refused on meta."""
    from gradsvc.engine import estimate

    req = wide_request(top=1, iterations=10**9, tolerance=1e-300)
    config = EngineConfig(max_krylov_bytes=64 << 20)
    with pytest.raises(SpecError) as info:
        prepare(req, config, "meta")
    err = info.value
    assert err.code == "too_large" and "GRADSVC_MAX_KRYLOV_BYTES" in err.message
    assert err.detail["setting"] == "GRADSVC_MAX_KRYLOV_BYTES" and err.detail["max_iterations"] < 20_100
    fitting = wide_request(top=1, iterations=err.detail["max_iterations"])
    counted = estimate(fitting, config).krylov_bytes
    assert 0 < counted <= 64 << 20
    assert estimate(wide_request(top=1, iterations=10), config).krylov_bytes == (10 + 2) * 20_100 * 8
    with pytest.raises(SpecError):
        estimate(req, config)


def test_density_probes_count_one_basis_at_a_time():
    from gradsvc.engine import estimate

    got = estimate(wide_request(top=0, density=True, probes=5, iterations=30), EngineConfig()).krylov_bytes
    assert got == (30 + 2) * 20_100 * 8
    assert estimate(wide_request(top=0, trace=True, probes=5), EngineConfig()).krylov_bytes == 0


def test_lanczos_fills_one_basis_and_does_not_restack_it_every_step(monkeypatch):
    """The basis grows in place: a step reads a view of it, so m steps cost O(m P) copies, not O(m^2 P)."""
    from gradsvc.engine.diagnostics import lanczos as module

    stacked = []
    real_stack = torch.stack
    monkeypatch.setattr(module.torch, "stack", lambda *a, **k: stacked.append(1) or real_stack(*a, **k))
    matrix = torch.randn(40, 40, dtype=F64, generator=torch.Generator().manual_seed(0))
    matrix = matrix + matrix.T
    state = module.lanczos(lambda v: matrix @ v, torch.ones(40, dtype=F64), 30)
    assert len(stacked) == 0 and state.basis.shape == (30, 40)
    q = state.basis
    assert torch.allclose(q @ q.T, torch.eye(30, dtype=F64), atol=1e-10)
    values = module.top_ritz(lambda v: matrix @ v, 40, 2, 40, 1e-12, torch.Generator().manual_seed(1))[0]
    assert torch.allclose(values, torch.linalg.eigvalsh(matrix).flip(0)[:2], atol=1e-8)


# --- clipping's noise past the dtype, and noise without per-example clipping --------------------------------

@pytest.mark.parametrize("dtype, max_norm, noise", [(torch.float32, 1.0, 1e39), (torch.float16, 1000.0, 100.0)])
def test_dp_noise_that_overflows_the_returned_dtype_fails_non_finite_not_a_null_gradient(dtype, max_norm, noise):
    """docs/api.md: a gradient that is not finite is a 422 non_finite, after clipping and noise too."""
    from gradsvc.engine import ComputeError

    layers = [{"type": "Linear", "in_features": 3, "out_features": 2}]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2)).to(torch.float32)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    req = layer_request(module, x, y, layers=layers, clip={"max_norm": max_norm, "per_sample": True,
                                                           "noise_multiplier": noise})
    req = msgspec.structs.replace(req, model=msgspec.structs.replace(req.model,
                                                                      dtype=str(dtype).removeprefix("torch.")))
    with pytest.raises(ComputeError) as info:
        compute(req, EngineConfig())
    err = info.value
    assert err.code == "non_finite" and "options.clip" in err.message and "noise_multiplier" in err.message
    assert err.detail["parameter"] in ("0.weight", "0.bias")


def test_noise_multiplier_without_per_sample_is_a_422_bad_option_saying_to_set_per_sample():
    """Noise is part of the per-example DP-SGD step; on a global clip it would be ignored, and a caller who asked
    for noise would get gradients with none."""
    module, (x, y) = cnn(), cnn_batch()
    err = refused(layer_request(module, x, y, clip={"max_norm": 1.0, "noise_multiplier": 1.0}))
    assert err.detail["option"] == "clip.noise_multiplier" and "per_sample" in err.message
    compute(layer_request(module, x, y, clip={"max_norm": 1.0, "noise_multiplier": 0.0}), EngineConfig())


def test_a_curvature_job_reports_its_products_as_progress():
    """GET /jobs/{id} shows {phase, done, total} while a job runs; curvature's products are most of such a job."""
    module, (x, y) = cnn(), cnn_batch()
    seen = []
    compute(layer_request(module, x, y, curvature={"top": 2, "trace": True, "probes": 5}), EngineConfig(),
            progress=lambda phase, done, total: seen.append((phase, done, total)))
    curv = [(d, t) for p, d, t in seen if p == "curvature"]
    assert len(curv) > 5 and all(0 <= d <= t for d, t in curv)
    assert [d for d, _ in curv] == sorted(d for d, _ in curv) and curv[-1][0] == curv[-1][1]
