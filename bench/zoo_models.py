"""The five public zoos' models for bench/zoo.py, each built by its own library at a tiny size with nothing downloaded,
in train mode, as (module, inputs, targets, loss) the SDK takes: timm (each architecture module's smallest model),
transformers (every architecture with a causal-LM, masked-LM, sequence-classification, image-classification or
CTC head, its config shrunk to test size), torchvision (the smallest classification and segmentation model of each
family, every detection model, with their own losses), torch_geometric (every message-passing layer in a two-layer
net) and diffusers (two UNets, a VAE, a DiT with the noise-prediction loss)."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

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



# ---- common ------------------------------------------------------------------------------------------------------
def no_dropout(model: nn.Module) -> nn.Module:
    """Every draw that drops something set to 0 (dropout, drop path, a DiT's class-label dropout for guidance):
    two generators draw other masks, so the local answer key and the service would differ by their draws."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ in ("DropPath", "StochasticDepth"):
            if hasattr(m, "p"):
                m.p = 0.0
        for name in ("drop_prob", "dropout_prob", "drop_rate", "dropout_rate", "dropout", "p_drop", "attn_drop_rate"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model.train()


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
          "first_k_dense_replace": 1, "rotary_dim": 8, "n_group": 1, "topk_group": 1, "num_labels": 3}
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
        elif (("dropout" in key or key.endswith(("drop_rate", "pdrop")) or "drop_path" in key or key == "layerdrop"
               or key.startswith("mask_") and key.endswith("_prob")) and isinstance(value, float)):  # every draw off
            setattr(config, key, 0.0)
        elif key in ("depths", "num_layers_per_stage") and isinstance(value, (list, tuple)):
            setattr(config, key, [1] * len(value))
        elif key in ("hidden_sizes", "embed_dims", "dims") and isinstance(value, (list, tuple)):
            setattr(config, key, [8 * 2 ** i for i in range(len(value))])
        elif key == "num_heads" and isinstance(value, (list, tuple)):
            setattr(config, key, [1, 1, 2, 4, 8, 8][:len(value)])
        elif key.endswith("token_id") and isinstance(value, int) and value >= _VOCAB:
            setattr(config, key, 1)
    if "use_cache" in vars(config):  # training keeps no cache of past keys and values
        config.use_cache = False
    if isinstance(vars(config).get("layer_types"), (list, tuple)):  # and mlp_layer_types, ...: the same layers
        keep = _kinds_kept(list(config.layer_types), max(2, getattr(config, "num_hidden_layers", 2)))
        for key, value in list(vars(config).items()):
            if key.endswith("layer_types") and isinstance(value, (list, tuple)) \
                    and len(value) == len(config.layer_types):
                setattr(config, key, [value[i] for i in keep])
        if getattr(config, "num_hidden_layers", None) is not None:
            config.num_hidden_layers = len(keep)
    if getattr(config, "num_key_value_heads", None) and getattr(config, "num_attention_heads", None):
        # grouped queries where the model has them; latent attention (a kv_lora_rank) keeps one key head a query's
        if config.num_attention_heads % config.num_key_value_heads or getattr(config, "kv_lora_rank", None):
            config.num_key_value_heads = config.num_attention_heads
    for sub in list(vars(config).values()):  # every sub-config (text, vision, audio, a patcher's, ...)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            shrink(sub, seen)
    if getattr(config, "pad_token_id", None) is None:
        with contextlib.suppress(Exception):
            config.pad_token_id = 0


def _kinds_kept(layer_types: list, count: int) -> list[int]:
    """Which of the layers to keep, `count` of them or more: every kind the model mixes (a hybrid's attention
    layers and its linear or state-space ones), the first layer of each kind, then the others in order."""
    firsts = [layer_types.index(kind) for kind in dict.fromkeys(layer_types)]
    others = [i for i in range(len(layer_types)) if i not in firsts]
    keep = sorted(firsts + others[:max(count - len(firsts), 0)])
    return keep


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
        try:  # its size first, built on meta
            with torch.device("meta"):
                count = sum(p.numel() for p in getattr(transformers, class_name)(config).parameters())
        except Exception:  # noqa: BLE001  (an init that does not run on meta: built as it is)
            count = 0
        _within_size(count, model_type)
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for small in (True, False):  # 64 x 64 images where the model takes them, else its own input size
            torch.manual_seed(0)
            try:
                model = timm.create_model(name, pretrained=False, num_classes=5, **({"img_size": 64} if small else {}))
            except TypeError:  # no img_size argument: a convolutional net, which takes any size
                model = timm.create_model(name, pretrained=False, num_classes=5)
            size = (3, 64, 64) if small else model.pretrained_cfg.get("input_size", (3, 224, 224))
            x = torch.randn(2, *size, generator=torch.Generator().manual_seed(0))
            try:
                with torch.no_grad():
                    model.eval()(x)
                break
            except Exception:  # noqa: BLE001  (a net fixed to its input size, or downsampling 64 px to nothing)
                if not small:
                    raise
    return no_dropout(model), x, torch.tensor([0, 3]), "cross_entropy"


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

    def __init__(self, model: nn.Module, heads: bool = False) -> None:
        super().__init__()
        self.model, self.heads = model, heads  # heads: a mask or keypoint head, whose targets are made from boxes

    def forward(self, images, boxes, labels):
        targets = [{"boxes": b, "labels": l} for b, l in zip(boxes, labels)]
        h, w = images.shape[-2:]
        for t in targets if self.heads else ():  # what Mask R-CNN's and Keypoint R-CNN's heads train on too
            x0, y0, x1, y1 = t["boxes"][0].long().tolist()
            t["masks"] = torch.zeros(1, h, w, dtype=torch.uint8)  # the box filled
            t["masks"][0, y0:y1, x0:x1] = 1
            t["keypoints"] = torch.tensor([[x0, y0, 1.0], [x1, y1, 1.0]]).repeat(9, 1)[:17].unsqueeze(0)  # its corners
        return sum(self.model(list(images), targets).values())


def torchvision_cases() -> list[Case]:
    """Each classification and segmentation family's smallest model (timm's rule: resnet18 for ResNet, not its
    deeper variants, which repeat its blocks), every detection model (each is its own architecture)."""
    import torchvision

    cases = [Case("torchvision", f"classification/{n}", lambda n=n: _tv_classification(torchvision, n))
             for n in _smallest_of_each_family(torchvision, torchvision.models)]
    cases += [Case("torchvision", f"segmentation/{n}", lambda n=n: _tv_segmentation(torchvision, n))
              for n in _smallest_of_each_family(torchvision, torchvision.models.segmentation)]
    cases += [Case("torchvision", f"detection/{n}", lambda n=n: _tv_detection(torchvision, n))
              for n in torchvision.models.list_models(module=torchvision.models.detection)]
    return cases


_SIZE_TOKEN = re.compile(r"^(\d.*|x\d.*|[tsmlbh]|b\d+|tiny|small|base|large|huge)$")


def tv_family(name: str) -> str:
    """A torchvision builder's family: its name without the size (resnet18 -> resnet, efficientnet_b3 ->
    efficientnet, regnet_y_1_6gf -> regnet_y, shufflenet_v2_x0_5 -> shufflenet_v2, vgg11_bn -> vgg_bn)."""
    tokens = name.split("_")
    while len(tokens) > 1 and _SIZE_TOKEN.match(tokens[-1]):
        tokens.pop()
    return "_".join(t if re.fullmatch(r"v\d+", t) else t.rstrip("0123456789") for t in tokens)


def _smallest_of_each_family(torchvision, module) -> list[str]:
    """The builders of `module` with the fewest parameters in their family, as their weights' metadata counts
    them (nothing downloaded)."""
    def size(name: str) -> int:
        weights = torchvision.models.get_model_weights(name)
        return min(w.meta.get("num_params", 0) for w in weights)

    smallest: dict[str, str] = {}
    for name in torchvision.models.list_models(module=module):
        family = tv_family(name)
        if family not in smallest or size(name) < size(smallest[family]):
            smallest[family] = name
    return sorted(smallest.values())


def _tv_classification(torchvision, name: str) -> tuple:
    torch.manual_seed(0)
    kwargs = {"num_classes": 5}
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=False)
    try:
        with torch.device("meta"):
            meta = torchvision.models.get_model(name, weights=None, **kwargs)
    except NotImplementedError:  # an __init__ that reads a tensor's data (RegNet's widths): counted once built
        meta = None
    if meta is not None:
        _within_size(sum(p.numel() for p in meta.parameters()), name)
    model = no_dropout(torchvision.models.get_model(name, weights=None, **kwargs))
    _within_size(sum(p.numel() for p in model.parameters()), name)
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
    sizes = {} if name.startswith("ssd") else {"min_size": 64, "max_size": 96}  # SSD resizes to its own 300/320
    if "rcnn" in name:  # proposals and sampled boxes scaled to the 64 px image (2,000 and 512 by default), as
        # torchvision's own tests shrink them: its ATen roi_align indexes (boxes, channels, 7, 7, 2, 2) at once
        sizes.update(rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100, rpn_batch_size_per_image=64,
                     box_batch_size_per_image=32)
    model = no_dropout(torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=3, **sizes))
    g = torch.Generator().manual_seed(0)
    boxes = torch.tensor([[[4.0, 4.0, 30.0, 40.0]], [[10.0, 8.0, 50.0, 60.0]]])  # (images, 1, 4)
    return (_Detection(model, heads=name.startswith(("mask", "keypoint"))).train(), (torch.rand(2, 3, 64, 64, generator=g), boxes, torch.tensor([[1], [2]])),
            None, "output")


# ---- torch_geometric ---------------------------------------------------------------------------------------------
class _TwoLayers(nn.Module):
    """conv(8 -> 16), ReLU, conv(16 -> 3): node classification on one graph; `extra` inputs (edge attributes, edge
    types, positions) go to both layers as their forward takes them."""

    def __init__(self, conv1: nn.Module, conv2: nn.Module, extra: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.conv1, self.conv2, self.extra = conv1, conv2, extra

    def forward(self, x, edge_index, *extra):
        named = dict(zip(self.extra, extra))
        if "pos" in named:  # a point cloud's layers take (x, pos, edge_index): edge_index by name
            return self.conv2(F.relu(self.conv1(x, edge_index=edge_index, **named)), edge_index=edge_index, **named)
        return self.conv2(F.relu(self.conv1(x, edge_index, **named)), edge_index, **named)


def _mlp(i: int, o: int) -> nn.Module:
    return nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))


# Layers that take more than two channel counts, built as their documentation shows (in, out) -> module, and the
# inputs their forward takes besides (x, edge_index): edge_attr (edges, 2), edge_type (edges,), pos (nodes, 3).
_PYG_LAYERS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "ChebConv": (lambda c, i, o: c(i, o, K=2), ()),
    "GINConv": (lambda c, i, o: c(_mlp(i, o)), ()),
    "GINEConv": (lambda c, i, o: c(_mlp(i, o), edge_dim=2), ("edge_attr",)),
    "RGCNConv": (lambda c, i, o: c(i, o, num_relations=2), ("edge_type",)),
    "FastRGCNConv": (lambda c, i, o: c(i, o, num_relations=2), ("edge_type",)),
    "RGATConv": (lambda c, i, o: c(i, o, num_relations=2), ("edge_type",)),
    "NNConv": (lambda c, i, o: c(i, o, nn.Linear(2, i * o)), ("edge_attr",)),
    "GMMConv": (lambda c, i, o: c(i, o, dim=2, kernel_size=2), ("edge_attr",)),
    "SplineConv": (lambda c, i, o: c(i, o, dim=2, kernel_size=2), ("edge_attr",)),
    "EdgeConv": (lambda c, i, o: c(_mlp(2 * i, o)), ()),
    "SSGConv": (lambda c, i, o: c(i, o, alpha=0.1), ()),
    "CGConv": (lambda c, i, o: nn.Sequential(nn.Linear(i, o), _Graph(c(o, dim=2))), ("edge_attr",)),
    "PointNetConv": (lambda c, i, o: c(local_nn=_mlp(i + 3, o)), ("pos",)),
    "PPFConv": (lambda c, i, o: c(local_nn=_mlp(i + 4, o)), ("pos", "normal")),
    "PointTransformerConv": (lambda c, i, o: c(i, o), ("pos",)),
    "PointGNNConv": (lambda c, i, o: nn.Sequential(nn.Linear(i, o), _Graph(c(_mlp(o, 3), _mlp(o + 3, o),
                                                                                _mlp(o, o)))), ("pos",)),
    "PDNConv": (lambda c, i, o: c(i, o, edge_dim=2, hidden_channels=8), ("edge_attr",)),
    "PANConv": (lambda c, i, o: c(i, o, filter_size=2), ()),
    "GravNetConv": (lambda c, i, o: c(i, o, space_dimensions=2, propagate_dimensions=4, k=3), ()),
    "HEATConv": (lambda c, i, o: c(i, o, num_node_types=1, num_edge_types=2, edge_type_emb_dim=2, edge_dim=2,
                                   edge_attr_emb_dim=2), ("node_type", "edge_type", "edge_attr")),
    "LGConv": (lambda c, i, o: nn.Sequential(nn.Linear(i, o), _Graph(c())), ()),
    "SimpleConv": (lambda c, i, o: nn.Sequential(nn.Linear(i, o), _Graph(c(aggr="mean"))), ()),
    "EGConv": (lambda c, i, o: c(i, o, num_heads=1, num_bases=2), ()),
    "PNAConv": (lambda c, i, o: c(i, o, aggregators=["mean", "max"], scalers=["identity", "amplification"],
                                  deg=torch.tensor([0, 2, 4, 3, 1])), ()),
}


class _Graph(nn.Module):
    """A layer of (x, edge_index, **extra) after a plain module of x (a layer that keeps its channel count)."""

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x, edge_index, **extra):
        return self.conv(x, edge_index=edge_index, **extra)


def torch_geometric_cases() -> list[Case]:
    from torch_geometric.nn import conv

    cases = []
    for name in sorted(getattr(conv, "__all__", [])):
        cls = getattr(conv, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and name.endswith("Conv"):
            cases.append(Case("torch_geometric", name, lambda cls=cls: _pyg_build(cls)))
    return cases


def _pyg_build(cls) -> tuple:
    torch.manual_seed(0)
    make, extra = _PYG_LAYERS.get(cls.__name__, (lambda c, i, o: c(i, o), ()))
    model = no_dropout(_TwoLayers(_first(make, cls, 8, 16), _first(make, cls, 16, 3), extra))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g)  # (nodes, features)
    edge_index = torch.randint(0, 10, (2, 30), generator=g)  # (2, edges)
    given = {"edge_attr": torch.rand(30, 2, generator=g), "edge_type": torch.randint(0, 2, (30,), generator=g),
             "pos": torch.randn(10, 3, generator=g), "normal": F.normalize(torch.randn(10, 3, generator=g), dim=1),
             "node_type": torch.zeros(10, dtype=torch.long)}
    inputs = (x, edge_index, *(given[e] for e in extra))
    with torch.no_grad():
        model(*inputs)  # fails here, not in the service, for a layer this net cannot build
    return model, inputs, torch.randint(0, 3, (10,), generator=g), "cross_entropy"


def _first(make: Callable, cls, i: int, o: int) -> nn.Module:
    """The layer (i -> o); a Sequential (a projection, then a layer keeping its width) is called as a graph layer."""
    layer = make(cls, i, o)
    return _Chain(layer) if isinstance(layer, nn.Sequential) else layer


class _Chain(nn.Module):
    """nn.Sequential(projection, _Graph(layer)) called as (x, edge_index, **extra)."""

    def __init__(self, seq: nn.Sequential) -> None:
        super().__init__()
        self.proj, self.graph = seq[0], seq[1]

    def forward(self, x, edge_index, **extra):
        return self.graph(self.proj(x), edge_index, **extra)


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
