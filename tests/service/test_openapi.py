"""GET /schema says what the API accepts and answers, in a form client generators read: `targets` by loss,
arrays with `items`, layers with their constructor arguments, request fields with defaults optional, response
fields the answer always carries required, operations tagged and summarised with real answers as examples,
the headers declared, and the Bearer scheme only where keys are configured."""

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
                                     {"loss": {"output": 1}, "targets": ...}, {"loss": {"output": "loss"}, "targets": ...},
                                     {"loss": None, "losses": [{"type": "mse"}]}])
def test_the_example_and_the_models_own_loss_without_targets_are_schema_valid(changes):
    assert _validator().is_valid(_body(**changes))


@pytest.mark.parametrize("changes", [
    {"losses": [{"type": "mse"}]},  # loss and losses both
    {"loss": ..., "losses": [{"type": "output"}], "targets": ...},  # the model's own loss stands alone
    {"loss": ..., "losses": [{"output": 0}], "targets": ...},
    {"model": {"seed": 0}},  # no model form
    {"model": {"layers": [{"type": "Tanh"}], "graph_ref": "a" * 64}},  # two
    {"model": {"graph_ref": "not-a-digest"}},
    {"model": {"layers": [{"type": "Tanh"}], "dtype": "int64"}},
])
def test_a_cross_field_rule_the_api_enforces_is_in_the_schema(changes):
    """What the API answers 422 for these (gradsvc/engine/decode.py, prepare.py), the schema says."""
    assert not _validator().is_valid(_body(**changes))


@pytest.mark.parametrize("optimizer, valid", [
    ({"type": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True}, True),
    ({"type": "adamw", "lr": 0.1, "betas": [0.9, 0.99], "amsgrad": True, "momentum": None}, True),
    ({"type": "sgd", "lr": 0.1, "betas": [0.9, 0.99]}, False),
    ({"type": "adam", "momentum": 0.9}, False),
])
def test_an_optimizers_arguments_are_its_types_own_in_the_schema(optimizer, valid):
    doc = openapi.build(300)
    schema = doc["paths"]["/sessions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = {"model": {"layers": [{"type": "Linear", "in_features": 2, "out_features": 2}]}, "optimizer": optimizer}
    assert _schema_validator(schema, doc).is_valid(body) is valid


def test_the_models_own_loss_with_targets_is_schema_invalid():
    assert not _validator().is_valid(_body(loss="output"))


def test_the_bearer_scheme_is_declared_only_with_keys_and_never_on_the_probes():
    assert "securitySchemes" not in openapi.build(300)["components"] and "security" not in openapi.build(300)
    doc = openapi.build(300, keys_required=True)
    assert doc["security"] == [{"apiKey": []}] and doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert doc["paths"]["/healthz"]["get"]["security"] == [] and doc["paths"]["/metrics"]["get"]["security"] == []
    assert "security" not in openapi.build(300, keys_required=True, metrics_require_key=True)["paths"]["/metrics"]["get"]


def _schema_validator(schema: dict, doc: dict | None = None) -> "jsonschema_rs.Draft202012Validator":
    doc = doc or openapi.build(300)
    return jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]})


def test_every_array_in_the_document_has_items():
    doc = openapi.build(300)
    arrays = [s for s in openapi._each_schema(doc) if isinstance(s, dict) and s.get("type") == "array"]
    assert arrays and all("items" in s for s in arrays)


def test_a_layer_item_takes_its_constructor_arguments():
    body = _body()
    body["model"]["layers"][0]["bias"] = False
    assert _validator().is_valid(body)
    layers = openapi.build(300)["components"]["schemas"]["ModelSpec"]["properties"]["layers"]["anyOf"][0]
    assert layers["items"]["additionalProperties"] is True


def test_request_fields_with_a_default_are_optional_and_say_it_in_words_not_a_default_keyword():
    schemas = openapi.build(300)["components"]["schemas"]
    options = schemas["Options"]
    assert not options.get("required")
    assert all("default" not in prop for prop in options["properties"].values())
    assert "Default: `1e-6`." in options["properties"]["numcheck_eps"]["description"]
    assert schemas["GradientRequest"]["required"] == ["model", "inputs"]


def test_response_fields_always_written_are_required_and_those_left_out_are_optional():
    schemas = openapi.build(300)["components"]["schemas"]
    assert set(schemas["GradientResult"]["required"]) == set(schemas["GradientResult"]["properties"])
    assert set(schemas["JobInfo"]["required"]) == set(schemas["JobInfo"]["properties"])
    assert schemas["Tensor"]["required"] == ["dtype", "shape"]
    assert all("default" not in schemas["Tensor"]["properties"][f] for f in ("data", "b64", "refs"))
    assert schemas["ErrorBody"]["required"] == ["error"]
    assert not [name for name in schemas if name.endswith(("-Input", "-Output"))]  # no Struct differs today


def test_every_operation_has_a_tag_a_summary_and_examples_that_fit_their_schemas():
    doc = openapi.build(300)
    tags = {t["name"] for t in doc["tags"]}
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op["summary"] and set(op["tags"]) <= tags, (method, path)
            for status, response in op["responses"].items():
                for media in response.get("content", {}).values():
                    if "example" in media:
                        assert _schema_validator(media["schema"], doc).is_valid(media["example"]), (path, status)
    body = doc["paths"]["/gradients"]["post"]["requestBody"]["content"]["application/json"]
    assert _validator().is_valid(body["example"])


def test_the_example_result_is_the_first_requests_answer_as_torch_autograd_gives_it():
    import torch
    from torch import nn

    from tests.support.models import local_gradients

    torch.manual_seed(0)  # the service's weights for seed 0
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.tensor(openapi.EXAMPLE_REQUEST["inputs"], dtype=torch.float64)
    expected = local_gradients(model, x, torch.tensor(openapi.EXAMPLE_REQUEST["targets"]), "cross_entropy")
    result = openapi.EXAMPLES["result"]
    for name, grad in expected.items():
        got = torch.tensor(result["gradients"][name]["data"], dtype=torch.float64)
        assert torch.allclose(got, grad, rtol=0, atol=1e-12 * grad.abs().max()), name
    assert result["numcheck"]["passed"] and result["numcheck"]["mode"] == "exact"
    assert openapi.EXAMPLES["job"]["result"]["gradients"] == result["gradients"]


def test_the_post_headers_and_the_probes_bodies_are_declared():
    doc = openapi.build(300)
    post = doc["paths"]["/gradients"]["post"]
    headers = {p["name"]: p for p in post["parameters"] if p["in"] == "header"}
    assert set(headers) == {"Idempotency-Key", "Gradsvc-Release-Results"}
    release = jsonschema_rs.Draft202012Validator(headers["Gradsvc-Release-Results"]["schema"])
    ids = [openapi.EXAMPLES["job"]["job_id"], openapi.EXAMPLES["accepted"]["job_id"]]
    assert release.is_valid(", ".join(ids)) and release.is_valid("")
    assert not release.is_valid(",".join(ids * 9)) and not release.is_valid("not-a-job")
    assert post["responses"]["202"]["headers"]["Location"] and post["responses"]["429"]["headers"]["Retry-After"]
    for probe in ("/healthz", "/readyz"):
        assert doc["paths"][probe]["get"]["responses"]["200"]["content"]["application/json"]["schema"]


def test_the_cancel_is_a_post_on_its_own_route_and_no_delete_is_declared_for_jobs():
    doc = openapi.build(300)
    assert doc["paths"]["/jobs/{job_id}/cancel"]["post"]["operationId"] == "cancelJob"
    # A run's and a session's DELETE delete them (docs/runs.md, docs/sessions.md); a job's cancel keeps the job
    # readable, so it is no delete.
    assert [p for p, methods in doc["paths"].items() if "delete" in methods] == ["/runs/{name}",
                                                                               "/sessions/{session_id}"]


def test_the_session_routes_are_declared_with_their_request_and_response_structs():
    doc = openapi.build(300)
    paths = doc["paths"]
    create = paths["/sessions"]["post"]
    assert create["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionCreate")
    assert create["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionCreated")
    assert create["responses"]["429"] and set(create["responses"]["201"]["links"]) >= {"getSession", "deleteSession"}
    for op, body in (("step", "SessionBatch"), ("forward_backward", "SessionBatch"),
                     ("optim_step", "SessionOptimStep")):
        post = paths[f"/sessions/{{session_id}}/{op}"]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(f"/{body}"), op
        assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/SessionStepResult")
        assert {"202", "404", "409", "422"} <= set(post["responses"]), op
    assert paths["/sessions/{session_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/SessionInfo")
    weights = paths["/sessions/{session_id}/weights"]["get"]["responses"]["200"]["content"]
    assert set(weights) == {"application/json", "application/octet-stream"}
    batch = jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/SessionBatch",
                                                "components": doc["components"]})
    assert batch.is_valid({"inputs": [[1.0]], "targets": [0], "return": ["weights"], "lr": 0.1})
    assert not batch.is_valid({"inputs": [[1.0]]})  # cross_entropy needs targets, as for POST /gradients
    assert not batch.is_valid({"inputs": [[1.0]], "targets": [0], "return": ["everything"]})
    schemas = doc["components"]["schemas"]
    assert set(schemas["SessionStepResult"]["required"]) == set(schemas["SessionStepResult"]["properties"])
    # a tuple of one type is an array of that type and length: openapi-python-client refuses `items: false`
    betas = next(s for s in schemas["OptimizerSpec"]["properties"]["betas"]["anyOf"] if s.get("type") == "array")
    assert betas["items"]["type"] == "number" and betas["minItems"] == betas["maxItems"] == 2


def test_a_graph_and_its_result_say_how_it_was_captured_and_its_guards():
    schemas = openapi.build(300)["components"]["schemas"]
    for struct in ("GraphSpec", "GradientResult"):
        props = schemas[struct]["properties"]
        assert "capture" in props and "specialised" in props, struct
        assert {"export", "export_static", "draft", "trace"} <= set(openapi_enum(props["capture"]))
    assert set(schemas["Specialised"]["properties"]) == {"inputs", "values", "sizes", "constants"}


def openapi_enum(schema: dict) -> list:
    """The enum values a (nullable) string schema lists, wherever the generator put them."""
    found = []
    for part in [schema, *schema.get("anyOf", []), *schema.get("oneOf", [])]:
        found += part.get("enum", [])
        if "$ref" in part:
            found.append(part["$ref"])
    return found
