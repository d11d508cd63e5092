"""A sample of the public zoos through the SDK, the API, Redis and a real worker, by bench/zoo.py's own rule: each
model built by its library at a tiny size in train mode, its gradients equal to local float64 autograd within what
float32 itself is off, its buffers the local forward's, the check not failing it. transformers (a causal LM over
every position, a Mixture-of-Experts, a masked LM, a classifier), torch_geometric (message passing with an edge
softmax and with a plain sum) and diffusers (a UNet's noise-prediction loss) run here; timm and torchvision need
torch's CUDA build here (their wheels load torchvision's C ops), so their sample runs in `make zoo`'s own venv."""

from __future__ import annotations

import pytest

from bench import zoo

pytestmark = pytest.mark.timeout(900)

SAMPLE = {"transformers": ["causal_lm/llama", "causal_lm/mixtral", "masked_lm/bert", "sequence_classification/gpt2"],
          "torch_geometric": ["GATConv", "GCNConv"],
          "diffusers": ["UNet2DModel"]}
# In `make test-all` only: their ops are covered in `make test` by tests/gradsvc/engine/test_op_classes.py (the
# grouped matmul, the edge softmax's scatter_reduce_) and the Hugging Face models of the graph tests.
SLOW = {"causal_lm/mixtral", "masked_lm/bert", "sequence_classification/gpt2", "GATConv"}


def _cases():
    for name, wanted in SAMPLE.items():
        library = pytest.importorskip(name)
        assert library is not None
        found = {c.name: c for c in zoo.cases_of(name)}
        for model in wanted:
            yield pytest.param(found[model], id=f"{name}/{model}",
                               marks=[pytest.mark.slow] if model in SLOW else [])


@pytest.mark.parametrize("case", list(_cases()))
def test_a_zoo_model_answers_local_autograds_gradients_and_its_check_passes(client, case):
    # As the run sends it: default options, then numcheck off from the same state (the recording reused)
    for outcome in zoo.run_options(client, case, ["auto", "off"]):
        assert outcome.passed, (outcome.options, outcome.cause, outcome.detail)


@pytest.mark.parametrize(("name", "family"), [
    ("resnet18", "resnet"), ("resnext50_32x4d", "resnext"), ("wide_resnet50_2", "wide_resnet"),
    ("mobilenet_v2", "mobilenet_v2"), ("mobilenet_v3_large", "mobilenet_v3"), ("efficientnet_b3", "efficientnet"),
    ("efficientnet_v2_s", "efficientnet_v2"), ("regnet_y_1_6gf", "regnet_y"), ("regnet_x_400mf", "regnet_x"),
    ("shufflenet_v2_x0_5", "shufflenet_v2"), ("vgg11_bn", "vgg_bn"), ("vgg19", "vgg"), ("vit_b_16", "vit"),
    ("swin_v2_t", "swin_v2"), ("convnext_tiny", "convnext"), ("inception_v3", "inception_v3"),
    ("fcn_resnet101", "fcn_resnet"), ("deeplabv3_mobilenet_v3_large", "deeplabv_mobilenet_v3"),
])
def test_torchvision_families_drop_only_the_size(name, family):
    # The run takes each family's smallest model: a size token left in would run every size, one too many taken
    # out would merge two architectures
    from bench.zoo_models import tv_family

    assert tv_family(name) == family
