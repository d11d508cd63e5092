"""The conformance run over five public zoos: every architecture each library builds at a tiny size from its own
code (nothing downloaded), in train mode, sent through the SDK to a live stack, its gradients compared with local
float32 and float64 autograd and its buffers with the local forward's, once with default options and once with
`numcheck` off. It prints the pass rate per zoo and every failure grouped by cause.

    make zoo                                     # the whole run, in its own venv (.venv-zoo/: torch 2.14.1 and
                                                 # torchvision 0.29.1, which timm needs here; docs/models.md)
    python bench/zoo.py --zoo transformers --limit 5 --json out.json

The stack's API and worker run on the server's venv (`--server-python`, default .venv/bin/python: the pinned
torch), the zoo's libraries and the SDK on this interpreter: a client on another torch release than its server,
as users run it.

Rule for a gradient (per parameter): |service - float64| <= 10 x |float32 - float64| + 1e-6 x max|float64|, the
float32 local run's own error being what float32 arithmetic allows (a gradient that is zero in exact arithmetic
is rounding noise). Dropout is set to 0 (two generators draw different masks; dropout itself is replayed from the
job's seed and tested apart); BatchNorm and every other train-mode behaviour stay.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import io
import json
import math
import re
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ZOOS = ("timm", "transformers", "torchvision", "torch_geometric", "diffusers")
# The largest model the run builds (its smallest variant for timm): a 2-core CPU runs a model of this size, its
# float64 copy and the check in about a minute; larger ones are counted as not built, with their size.
MAX_PARAMETERS = 30_000_000


class TooLargeError(Exception):
    """The zoo's smallest variant is over MAX_PARAMETERS: not built here."""


def _within_size(count: int, name: str) -> None:
    if count > MAX_PARAMETERS:
        raise TooLargeError(f"{name} has {count / 1e6:.0f}M parameters, over the run's {MAX_PARAMETERS / 1e6:.0f}M")


class Case(NamedTuple):
    """One model of a zoo: `build()` gives (module, inputs, targets, loss) as the SDK takes them."""

    zoo: str
    name: str
    build: Callable[[], tuple]


class Outcome(NamedTuple):
    zoo: str
    name: str
    options: str  # "default" or "numcheck_off"
    passed: bool
    cause: str = ""
    seconds: float = 0.0
    detail: str = ""


# ---- common ------------------------------------------------------------------------------------------------------
def no_dropout(model: nn.Module) -> nn.Module:
    """Every draw that drops something set to 0 (dropout, drop path, a DiT's class-label dropout for guidance):
    two generators draw other masks, so the local answer key and the service would differ by their draws."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ in ("DropPath", "StochasticDepth"):
            if hasattr(m, "p"):
                m.p = 0.0
        for name in ("drop_prob", "dropout_prob"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model.train()


def _to(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, dtype) for v in value)
    return value


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _loss_of(out: Any, targets: Any, loss: str) -> torch.Tensor:
    if loss == "output":
        if isinstance(out, torch.Tensor):
            return out
        return out["loss"] if isinstance(out, dict) else out.loss
    logits = out if isinstance(out, torch.Tensor) else (out["logits"] if isinstance(out, dict) else out[0])
    return {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}[loss](logits, targets)


def local_run(model: nn.Module, inputs: Any, targets: Any, loss: str, dtype: torch.dtype):
    """(gradients by parameter name, buffers after the forward) of a copy of `model` in `dtype`."""
    m = copy.deepcopy(model).to(dtype)
    torch.manual_seed(0)
    value = _loss_of(_call(m, _to(inputs, dtype)), _to(targets, dtype), loss)
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)  # None: unused, as eager leaves it
    return dict(zip(params, grads)), {n: b.detach().clone() for n, b in m.named_buffers()}


def compare(result, g32: dict, g64: dict | None, buffers: dict, model: nn.Module) -> str:
    """"" when the answer holds, else what differs. Without a float64 answer key, float32's to 1e-4 of its scale."""
    for name, own in g32.items():
        got = result.gradients.get(name)
        if own is None:  # a parameter the loss does not use: eager leaves its .grad None, the service too (or 0)
            if got is not None and float(torch.as_tensor(got).to_dense().abs().max()) != 0.0:
                return f"gradient of the unused {name} is not zero"
            continue
        if got is None:
            return f"gradient of {name} missing"
        got, own = torch.as_tensor(got).to_dense().double(), own.to_dense().double()
        if g64 is None:
            ref, allowed = own, 1e-4 * float(own.abs().max()) + 1e-12
        else:
            ref = g64[name].to_dense().double()
            allowed = 10 * float((own - ref).abs().max()) + 1e-6 * float(ref.abs().max())
        err = float((got - ref).abs().max())
        if not err <= allowed:
            return f"wrong gradient: {name} off by {err:.3g}, allowed {allowed:.3g}"
    for name, want in buffers.items():
        if not want.is_floating_point():
            continue
        got = dict(model.named_buffers()).get(name)
        if got is not None and not torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-6):
            return f"buffer {name} differs from the local forward's"
    return ""


def cause_of(exc: BaseException) -> str:
    """An error's cause as a group key: its code (or class) and its message with names and numbers taken out."""
    code = getattr(exc, "code", None) or type(exc).__name__
    message = str(exc).splitlines()[0] if str(exc) else ""
    op = re.search(r"aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+|[a-z_]+::[A-Za-z0-9_]+", message)
    if op:
        return f"{code}: {op[0]}"
    message = re.sub(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?(e-?\d+)?", "_", message)
    return f"{code}: {message[:110]}"


def run_case(client, case: Case, numcheck: str) -> Outcome:
    started = time.perf_counter()
    options = "default" if numcheck == "auto" else "numcheck_off"
    try:
        model, inputs, targets, loss = case.build()
    except Exception as exc:  # noqa: BLE001  (the library could not build it: not the service's failure)
        return Outcome(case.zoo, case.name, options, False, "not built: " + cause_of(exc), detail=str(exc)[:300])
    try:
        g32, buffers = local_run(model, inputs, targets, loss, torch.float32)
    except Exception as exc:  # noqa: BLE001  (it does not run locally either)
        return Outcome(case.zoo, case.name, options, False, "not run locally: " + cause_of(exc), detail=str(exc)[:300])
    try:
        g64, _ = local_run(model, inputs, targets, loss, torch.float64)
    except Exception:  # noqa: BLE001  (a kernel without float64 here, torch._grouped_mm's: float32 is the key)
        g64 = None
    try:
        torch.manual_seed(0)
        result = client.gradients(model, inputs, targets, loss=loss, numcheck=numcheck, timeout=900)
    except Exception as exc:  # noqa: BLE001  (what the service or the SDK answered: the run's subject)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        cause = ("500 " if status is not None and status >= 500 and status != 503 else "") + cause_of(exc)
        return Outcome(case.zoo, case.name, options, False, cause, time.perf_counter() - started,
                       "".join(traceback.format_exception_only(exc))[:600])
    wrong = compare(result, g32, g64, buffers, model)
    note = "" if g64 is not None else "answer key float32 (no float64 run locally)"
    if not wrong and numcheck == "auto" and result.numcheck.passed is False:
        wrong = f"numcheck failed a right gradient ({result.numcheck.max_rel_error:.3g})"
    return Outcome(case.zoo, case.name, options, not wrong, wrong, time.perf_counter() - started, note)


# ---- transformers ------------------------------------------------------------------------------------------------
_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 36, "vocab_size": 99, "max_position_embeddings": 64, "head_dim": 8, "n_embd": 32,
          "n_layer": 2, "n_layers": 2, "n_head": 4, "n_heads": 4, "d_model": 32, "d_ff": 36, "d_kv": 8,
          "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
          "decoder_attention_heads": 4, "encoder_ffn_dim": 36, "decoder_ffn_dim": 36, "num_experts": 4,
          "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "shared_expert_intermediate_size": 16, "image_size": 32, "patch_size": 8, "embed_dim": 32,
          "projection_dim": 32, "num_channels": 3, "ffn_dim": 36, "kv_lora_rank": 16, "q_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "state_size": 8, "ssm_state_size": 8,
          "conv_kernel": 4, "time_step_rank": 8, "expand": 2, "n_positions": 64, "n_ctx": 64, "hidden_dim": 36,
          "num_key_value_groups": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 8, "attention_window": 8,
          "sliding_window": 16, "codebook_size": 32, "num_codebooks": 2, "max_window_layers": 2,
          "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "num_labels": 3}
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder", "speech_config",
                "backbone_config", "qformer_config")
_VOCAB = 99


def shrink(config, seen: set | None = None) -> None:
    """`config` made tiny in place the way the library's own tests make theirs: every size field that is larger
    than the test size set to it, list-valued depths and widths cut, every sub-config likewise, dropout off."""
    seen = seen if seen is not None else set()
    if id(config) in seen:
        return
    seen.add(id(config))
    for key, value in list(vars(config).items()):
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool) and value > _SIZES[key]:
            setattr(config, key, _SIZES[key])
        elif ("dropout" in key or key.endswith("drop_rate") or "drop_path" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
        elif key in ("depths", "num_layers_per_stage") and isinstance(value, (list, tuple)):
            setattr(config, key, [1] * len(value))
        elif key in ("hidden_sizes", "embed_dims", "dims") and isinstance(value, (list, tuple)):
            setattr(config, key, [8 * 2 ** i for i in range(len(value))])
        elif key == "num_heads" and isinstance(value, (list, tuple)):
            setattr(config, key, [1, 1, 2, 4, 8, 8][:len(value)])
        elif key == "layer_types" and isinstance(value, (list, tuple)):
            setattr(config, key, list(value)[:max(2, getattr(config, "num_hidden_layers", 2))])
        elif key.endswith("token_id") and isinstance(value, int) and value >= _VOCAB:
            setattr(config, key, 1)
    if getattr(config, "num_key_value_heads", None) and getattr(config, "num_attention_heads", None):
        if config.num_attention_heads % config.num_key_value_heads:
            config.num_key_value_heads = config.num_attention_heads
    for key in _SUB_CONFIGS:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink(sub, seen)
    if getattr(config, "pad_token_id", None) is None:
        with contextlib.suppress(Exception):
            config.pad_token_id = 0


_HEADS = {"causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
          "sequence_classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
          "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
          "speech": "MODEL_FOR_CTC_MAPPING_NAMES"}


def transformers_cases() -> list[Case]:
    import transformers
    from transformers.models.auto import modeling_auto

    cases = []
    for head, mapping in _HEADS.items():
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
            cases.append(Case("transformers", f"{head}/{model_type}",
                              lambda head=head, t=model_type, c=class_name: _hf_build(transformers, head, t, c)))
    return cases


def _hf_build(transformers, head: str, model_type: str, class_name: str) -> tuple:
    config = transformers.AutoConfig.for_model(model_type)
    shrink(config)
    config.num_labels = 3
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = no_dropout(getattr(transformers, class_name)(config))
    g = torch.Generator().manual_seed(0)
    if head == "image_classification":
        size = getattr(getattr(config, "vision_config", config), "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        return model, {"pixel_values": torch.randn(2, channels, size, size, generator=g),
                       "labels": torch.tensor([0, 2])}, None, "output"
    if head == "speech":
        return model, {"input_values": torch.randn(2, 3200, generator=g),
                       "labels": torch.randint(1, min(_VOCAB, config.vocab_size), (2, 3), generator=g)}, None, "output"
    vocab = min(_VOCAB, getattr(config, "vocab_size", _VOCAB))
    ids = torch.randint(3, vocab, (2, 8), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["labels"] = torch.tensor([0, 2]) if head == "sequence_classification" else ids.clone()
    return model, inputs, None, "output"


# ---- timm --------------------------------------------------------------------------------------------------------
_SMALL = ("test_", "atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "s_", "lite", "b0", "_s", "mini")


def timm_cases() -> list[Case]:
    import timm

    return [Case("timm", module, lambda m=module: _timm_build(timm, _smallest(timm, m)))
            for module in sorted(timm.list_modules()) if timm.list_models(module=module)]


def _smallest(timm, module: str) -> str:
    """The architecture module's model with the fewest parameters (each built on the meta device: no memory)."""
    names = timm.list_models(module=module)
    tests = [n for n in names if n.startswith("test_")]
    sized = []
    for name in tests or names:
        with contextlib.suppress(Exception), warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            sized.append((sum(p.numel() for p in timm.create_model(name, pretrained=False).parameters()), name))
    if not sized:
        return sorted(names, key=len)[0]
    count, name = min(sized)
    _within_size(count, name)
    return name


def _timm_build(timm, name: str) -> tuple:
    print(f"  timm model: {name}", flush=True)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = no_dropout(timm.create_model(name, pretrained=False, num_classes=5))
    size = model.pretrained_cfg.get("input_size", (3, 224, 224)) if hasattr(model, "pretrained_cfg") else (3, 224, 224)
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(2, *size, generator=g), torch.tensor([0, 3]), "cross_entropy"


# ---- torchvision -------------------------------------------------------------------------------------------------
class _Segmentation(nn.Module):
    """A segmentation model's output under the loss over every pixel."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images, masks):
        out = self.model(images)
        return F.cross_entropy(out["out"], masks)


class _Detection(nn.Module):
    """A detection model in train mode: its own losses (a dict), summed as its reference script sums them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images, boxes, labels):
        targets = [{"boxes": b, "labels": l} for b, l in zip(boxes, labels)]
        return sum(self.model(list(images), targets).values())


def torchvision_cases() -> list[Case]:
    import torchvision

    cases = [Case("torchvision", f"classification/{n}", lambda n=n: _tv_classification(torchvision, n))
             for n in torchvision.models.list_models(module=torchvision.models)]
    cases += [Case("torchvision", f"segmentation/{n}", lambda n=n: _tv_segmentation(torchvision, n))
              for n in torchvision.models.list_models(module=torchvision.models.segmentation)]
    cases += [Case("torchvision", f"detection/{n}", lambda n=n: _tv_detection(torchvision, n))
              for n in torchvision.models.list_models(module=torchvision.models.detection)]
    return cases


def _tv_classification(torchvision, name: str) -> tuple:
    torch.manual_seed(0)
    kwargs = {"num_classes": 5}
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=False)
    with torch.device("meta"):
        _within_size(sum(p.numel() for p in torchvision.models.get_model(name, weights=None, **kwargs).parameters()),
                     name)
    model = no_dropout(torchvision.models.get_model(name, weights=None, **kwargs))
    size = 299 if name == "inception_v3" else 224 if name.startswith(("vit", "swin", "maxvit")) else 64
    g = torch.Generator().manual_seed(0)
    return model, torch.randn(2, 3, size, size, generator=g), torch.tensor([0, 3]), "cross_entropy"


def _tv_segmentation(torchvision, name: str) -> tuple:
    torch.manual_seed(0)
    model = no_dropout(torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=4,
                                                    aux_loss=False))
    g = torch.Generator().manual_seed(0)
    return (_Segmentation(model).train(), (torch.randn(2, 3, 64, 64, generator=g),
                                           torch.randint(0, 4, (2, 64, 64), generator=g)), None, "output")


def _tv_detection(torchvision, name: str) -> tuple:
    torch.manual_seed(0)
    model = no_dropout(torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=3,
                                                    min_size=64, max_size=96))
    g = torch.Generator().manual_seed(0)
    boxes = torch.tensor([[[4.0, 4.0, 30.0, 40.0]], [[10.0, 8.0, 50.0, 60.0]]])  # (images, 1, 4)
    return (_Detection(model).train(), (torch.rand(2, 3, 64, 64, generator=g), boxes, torch.tensor([[1], [2]])),
            None, "output")


# ---- torch_geometric ---------------------------------------------------------------------------------------------
class _TwoLayers(nn.Module):
    """conv(8 -> 16), ReLU, conv(16 -> 3): node classification on one graph."""

    def __init__(self, conv1: nn.Module, conv2: nn.Module) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv1, conv2

    def forward(self, x, edge_index):
        return self.conv2(F.relu(self.conv1(x, edge_index)), edge_index)


def torch_geometric_cases() -> list[Case]:
    import torch_geometric.nn.conv as conv

    cases = []
    for name in sorted(getattr(conv, "__all__", [])):
        cls = getattr(conv, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and name.endswith("Conv"):
            cases.append(Case("torch_geometric", name, lambda cls=cls: _pyg_build(cls)))
    return cases


def _pyg_build(cls) -> tuple:
    torch.manual_seed(0)
    model = no_dropout(_TwoLayers(cls(8, 16), cls(16, 3)))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g)  # (nodes, features)
    edge_index = torch.randint(0, 10, (2, 30), generator=g)  # (2, edges)
    with torch.no_grad():
        model(x, edge_index)  # fails here, not in the service, for a layer two channel counts cannot build
    return model, (x, edge_index), torch.randint(0, 3, (10,), generator=g), "cross_entropy"


# ---- diffusers ---------------------------------------------------------------------------------------------------
class _NoisePrediction(nn.Module):
    """DDPM's training loss: the noise added at step t predicted from the noisy sample (mean squared error)."""

    def __init__(self, model: nn.Module, conditioned: str = "") -> None:
        super().__init__()
        self.model, self.conditioned = model, conditioned
        self.register_buffer("alphas", torch.cumprod(1 - torch.linspace(1e-4, 0.02, 1000), 0))

    def forward(self, x0, noise, t, cond=None):
        a = self.alphas[t].view(-1, 1, 1, 1)
        noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
        if self.conditioned == "text":
            pred = self.model(noisy, t, encoder_hidden_states=cond).sample
        elif self.conditioned == "class":
            pred = self.model(noisy, timestep=t, class_labels=cond).sample
        else:
            pred = self.model(noisy, t).sample
        return F.mse_loss(pred, noise)


class _Autoencoder(nn.Module):
    """A VAE's loss: reconstruction plus a small KL term, the posterior sampled with the noise given."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, eps):
        posterior = self.model.encode(x).latent_dist
        z = posterior.mean + posterior.std * eps
        return F.mse_loss(self.model.decode(z).sample, x) + 1e-3 * posterior.kl().mean()


def diffusers_cases() -> list[Case]:
    import diffusers

    return [Case("diffusers", n, lambda n=n: _diffusers_build(diffusers, n))
            for n in ("UNet2DModel", "UNet2DConditionModel", "AutoencoderKL", "DiTTransformer2DModel")]


def _diffusers_build(diffusers, name: str) -> tuple:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    t = torch.tensor([10, 500])
    if name == "UNet2DModel":
        model = diffusers.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                                      block_out_channels=(16, 32), norm_num_groups=8,
                                      down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                      up_block_types=("AttnUpBlock2D", "UpBlock2D"))
        x0 = torch.randn(2, 3, 16, 16, generator=g)
        return _NoisePrediction(no_dropout(model)).train(), (x0, torch.randn_like(x0), t), None, "output"
    if name == "UNet2DConditionModel":
        model = diffusers.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                               block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=16,
                                               attention_head_dim=8,
                                               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
        x0 = torch.randn(2, 4, 16, 16, generator=g)
        return (_NoisePrediction(no_dropout(model), "text").train(),
                (x0, torch.randn_like(x0), t, torch.randn(2, 5, 16, generator=g)), None, "output")
    if name == "AutoencoderKL":
        model = diffusers.AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
                                        block_out_channels=(16, 32),
                                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))
        return (_Autoencoder(no_dropout(model)).train(),
                (torch.randn(2, 3, 16, 16, generator=g), torch.randn(2, 4, 8, 8, generator=g)), None, "output")
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                            out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                            num_embeds_ada_norm=1000, norm_type="ada_norm_zero")
    x0 = torch.randn(2, 4, 8, 8, generator=g)
    return (_NoisePrediction(no_dropout(model), "class").train(), (x0, torch.randn_like(x0), t, torch.tensor([1, 7])),
            None, "output")


BUILDERS: dict[str, Callable[[], list[Case]]] = {
    "timm": timm_cases, "transformers": transformers_cases, "torchvision": torchvision_cases,
    "torch_geometric": torch_geometric_cases, "diffusers": diffusers_cases}


def cases_of(zoo: str) -> list[Case]:
    """The zoo's cases, or none when its library is not installed here (said by the caller)."""
    try:
        return BUILDERS[zoo]()
    except ImportError:
        return []


# ---- the run -----------------------------------------------------------------------------------------------------
def report(outcomes: list[Outcome]) -> str:
    lines = []
    by_zoo = collections.defaultdict(list)
    for o in outcomes:
        by_zoo[o.zoo].append(o)
    lines.append(f"{'zoo':<16} {'options':<13} {'passed':>7} {'of':>4} {'rate':>7}  {'not built':>9}")
    for zoo, items in by_zoo.items():
        for options in ("default", "numcheck_off"):
            mine = [o for o in items if o.options == options]
            built = [o for o in mine if not o.cause.startswith(("not built", "not run locally"))]  # the library's own
            if not mine:
                continue
            passed = sum(o.passed for o in built)
            rate = 100.0 * passed / len(built) if built else float("nan")
            lines.append(f"{zoo:<16} {options:<13} {passed:>7} {len(built):>4} {rate:>6.1f}%  {len(mine) - len(built):>9}")
    causes = collections.defaultdict(list)
    for o in outcomes:
        if not o.passed:
            causes[(o.zoo, o.cause)].append(f"{o.name} ({o.options})")
    if causes:
        lines.append("\nfailures by cause:")
        for (zoo, cause), names in sorted(causes.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
            lines.append(f"  [{zoo}] {cause} x{len(names)}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default=",".join(ZOOS), help="comma-separated: " + ", ".join(ZOOS))
    ap.add_argument("--limit", type=int, default=0, help="at most this many models a zoo (0: all)")
    ap.add_argument("--match", default="", help="only models whose name contains this")
    ap.add_argument("--sample", type=int, default=0, help="about this many models a zoo, spread evenly (0: all)")
    ap.add_argument("--url", default="", help="a running stack; else one is started")
    ap.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--options", default="default,numcheck_off")
    ap.add_argument("--json", default="", help="write every outcome here")
    args = ap.parse_args(argv)

    from tests.support.stack import start_stack  # the same real stack the tests use

    stack = None
    if args.url:
        from gradclient import Client
        client = Client(args.url, timeout=900)
    else:
        python = args.server_python if Path(args.server_python).exists() else sys.executable
        stack = start_stack(workers=1, python=python, GRADSVC_JOB_TIMEOUT_S="600", GRADSVC_MAX_WAIT_S="600")
        client = stack.sdk_client(timeout=900)
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    try:
        for zoo in args.zoo.split(","):
            cases = [c for c in cases_of(zoo) if args.match in c.name]
            if not cases:
                print(f"{zoo}: not installed here (or nothing matched); skipped", flush=True)
                continue
            if args.sample and len(cases) > args.sample:
                cases = cases[::math.ceil(len(cases) / args.sample)]
            if args.limit:
                cases = cases[:args.limit]
            for case in cases:
                for numcheck in [{"default": "auto", "numcheck_off": "off"}[o] for o in args.options.split(",")]:
                    o = run_case(client, case, numcheck)
                    outcomes.append(o)
                    print(f"{'ok  ' if o.passed else 'FAIL'} {zoo}/{case.name} [{o.options}] {o.seconds:.1f}s "
                          f"{o.cause}", flush=True)
    finally:
        client.close()
        if stack is not None:
            stack.stop()
    print(f"\n{len(outcomes)} runs in {time.perf_counter() - started:.0f} s on torch {torch.__version__}")
    print(report(outcomes))
    if args.json:
        Path(args.json).write_text(json.dumps([o._asdict() for o in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
