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
    outcome = zoo.run_case(client, case, "auto")
    assert outcome.passed, (outcome.cause, outcome.detail)
