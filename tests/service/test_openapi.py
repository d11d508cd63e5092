"""GET /schema says what the API accepts: `targets` by loss (issue 25's schemathesis fault), and the Bearer
scheme only where keys are configured."""

from __future__ import annotations

import copy

import jsonschema_rs  # schemathesis 4 (the dev extra) validates with it
import pytest

from service import openapi


def _validator() -> "jsonschema_rs.Draft202012Validator":
    doc = openapi.build(300)
    return jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/GradientRequest",
                                               "components": doc["components"]})


def _body(**changes) -> dict:
    body = copy.deepcopy(openapi.EXAMPLE_REQUEST)
    for k, v in changes.items():
        if v is ...:
            body.pop(k)
        else:
            body[k] = v
    return body


@pytest.mark.parametrize("changes", [{"targets": None}, {"targets": ...}, {"targets": None, "loss": None},
                                     {"targets": ..., "loss": ...}, {"targets": None, "losses": [{"type": "mse"}],
                                                                     "loss": ...}])
def test_a_loss_that_needs_targets_without_them_is_schema_invalid(changes):
    assert not _validator().is_valid(_body(**changes))


@pytest.mark.parametrize("changes", [{}, {"loss": "output", "targets": ...}, {"loss": {"type": "output"}, "targets": None},
                                     {"loss": ..., "losses": [{"type": "output"}], "targets": ...},
                                     {"loss": {"output": 1}, "targets": ...}, {"loss": {"output": "loss"}, "targets": ...}])
def test_the_example_and_the_models_own_loss_without_targets_are_schema_valid(changes):
    assert _validator().is_valid(_body(**changes))


def test_the_models_own_loss_with_targets_is_schema_invalid():
    assert not _validator().is_valid(_body(loss="output"))


def test_the_bearer_scheme_is_declared_only_with_keys_and_never_on_the_probes():
    assert "securitySchemes" not in openapi.build(300)["components"] and "security" not in openapi.build(300)
    doc = openapi.build(300, keys_required=True)
    assert doc["security"] == [{"apiKey": []}] and doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert doc["paths"]["/healthz"]["get"]["security"] == [] and doc["paths"]["/metrics"]["get"]["security"] == []
    assert "security" not in openapi.build(300, keys_required=True, metrics_require_key=True)["paths"]["/metrics"]["get"]
