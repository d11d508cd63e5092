"""The OpenAPI 3.1 document for GET /schema, generated from the wire Structs (the one definition)."""

from __future__ import annotations

from typing import Any

import msgspec

from gradsvc import __version__
from gradsvc.wire import ErrorBody, Estimate, GradientRequest, GradientResult, JobAccepted, JobInfo, LayerInfo

_REF = "#/components/schemas/{name}"
# The README's first request (seed 003 [A]'s 6-8-3 tanh net), with the check off: a body the API accepts.
EXAMPLE_REQUEST = {
    "model": {"layers": [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
                         {"type": "Linear", "in_features": 8, "out_features": 3}], "dtype": "float64", "seed": 0},
    "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
    "loss": "cross_entropy", "options": {"numcheck": "off"},
}
# A queued job's id leads to its state (clients and schemathesis's stateful phase follow this). No link to
# cancelJob: DELETE cancels, it does not delete; the job stays readable (status canceled) until its TTL.
_JOB_LINKS = {"getJob": {"operationId": "getJob", "parameters": {"job_id": "$response.body#/job_id"}}}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "error", "content": _json(_ref("ErrorBody"))} for s in statuses}


_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def _declare_rules(schemas: dict[str, Any]) -> None:
    """What the API refuses that msgspec's schema cannot say: a layer is an object with a string `type`, and
    tensor bytes in JSON are base64. (Exactly one of model.layers / graph / graph_ref stays in ModelSpec's
    description: a oneOf there stops schemathesis from generating bodies at all.)"""
    layers = next(s for s in schemas["ModelSpec"]["properties"]["layers"]["anyOf"] if s.get("type") == "array")
    layers["items"] = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
                       "description": "a layer: `type` from GET /layers, the other keys its constructor arguments"}
    _declare_targets(schemas["GradientRequest"])
    tensor = schemas["Tensor"]["properties"]
    for option in tensor["data"]["anyOf"]:
        if option.get("type") == "string":
            option["pattern"] = _BASE64
    for option in tensor["b64"]["anyOf"]:
        if option.get("type") == "string":
            option.update(contentEncoding="base64", pattern=_BASE64)


_OWN_LOSS = {"anyOf": [{"const": "output"},
                       {"type": "object", "required": ["type"], "properties": {"type": {"const": "output"}}},
                       {"type": "object", "required": ["output"], "properties": {"output": {"not": {"type": "null"}}}}]}


def _declare_targets(request: dict[str, Any]) -> None:
    """`targets` as the engine reads it (gradsvc/engine/prepare.py): the model's own loss ("output") takes
    none, every other loss (cross_entropy when `loss` is absent or null) needs them. Said as if/then/else,
    so a generated request with `targets: null` and cross_entropy is invalid, as the API answers (422)."""
    request["properties"]["targets"]["description"] = (
        "a tensor ({dtype, shape, data|b64} or a bare nested list), or an object of named targets (a loss's "
        "`target`); required by every loss but the model's own (`output`), which takes none")
    request["if"] = {"anyOf": [
        {"required": ["loss"], "properties": {"loss": _OWN_LOSS}},
        {"required": ["losses"], "properties": {"losses": {"type": "array", "contains": _OWN_LOSS}}}]}
    request["then"] = {"properties": {"targets": {"type": "null"}}}
    request["else"] = {"required": ["targets"], "properties": {"targets": {"not": {"type": "null"}}}}


def build(max_wait_s: float, keys_required: bool = False, metrics_require_key: bool = False) -> dict[str, Any]:
    """`keys_required`: GRADSVC_API_KEYS is set, so every route but the probes (and /metrics unless
    `metrics_require_key`) declares the Bearer key: /docs's Authorize button sends it."""
    (_, _, _, _, _, _, _), components = msgspec.json.schema_components(
        [GradientRequest, GradientResult, JobInfo, JobAccepted, ErrorBody, Estimate, LayerInfo], ref_template=_REF)
    _declare_rules(components)
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    wait = {"name": "wait", "in": "query", "required": False,
            "description": f"seconds to wait for the result before answering 202 (default GRADSVC_DEFAULT_WAIT_S; "
                           f"values above GRADSVC_MAX_WAIT_S, here {max_wait_s:g}, are clamped to it)",
            "schema": {"type": "number", "minimum": 0}}
    json_body = {"schema": _ref("GradientRequest"), "example": EXAMPLE_REQUEST}
    body = {"required": True, "content": {"application/json": json_body,
                                          "application/msgpack": {"schema": _ref("GradientRequest")}}}
    common = (400, 401, 413, 422, 429, 503)
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "gradsvc", "version": __version__,
                 "description": "Gradients, a float64 finite-difference check, activation memory and timings."},
        "paths": {
            "/gradients": {"post": {
                "operationId": "postGradients", "parameters": [wait], "requestBody": body,
                "responses": {"200": {"description": "the result", "content": _json(_ref("GradientResult"))},
                              "202": {"description": "queued; poll Location",
                                      "content": _json(_ref("JobAccepted")), "links": _JOB_LINKS},
                              **_errors(*common, 409, 415, 504, 507)}}},
            "/estimate": {"post": {
                "operationId": "postEstimate", "requestBody": body,
                "responses": {"200": {"description": "predicted memory", "content": _json(_ref("Estimate"))},
                              **_errors(*common, 415)}}},
            "/jobs/{job_id}": {
                "get": {"operationId": "getJob", "parameters": [job_id],
                        "responses": {"200": {"description": "the job", "content": _json(_ref("JobInfo"))},
                                      **_errors(401, 404, 503)}},
                "delete": {"operationId": "cancelJob", "parameters": [job_id],
                           "responses": {"200": {"description": "the job", "content": _json(_ref("JobInfo"))},
                                         **_errors(401, 404, 503)}}},
            "/layers": {"get": {"operationId": "getLayers", "responses": {
                "200": {"description": "allowed layer types",
                        "content": _json({"type": "array", "items": _ref("LayerInfo")})}, **_errors(401)}}},
            "/tensors/{ref}": {"put": {
                "operationId": "putTensorPiece", "description": "one piece of a tensor's raw bytes, stored for this "
                "API key under its sha256; a request's tensors then name it in `refs`",
                "parameters": [{"name": "ref", "in": "path", "required": True,
                                "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}],
                "requestBody": {"required": True, "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}},
                "responses": {"201": {"description": "stored", "content": _json({
                    "type": "object", "required": ["ref", "bytes", "evicted"],
                    "properties": {"ref": {"type": "string"}, "bytes": {"type": "integer"},
                                   "evicted": {"type": "integer"}}})},
                              **_errors(400, 401, 413, 422, 503)}}},
            "/tensors/missing": {"post": {
                "operationId": "postTensorsMissing",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"refs": {"type": "array", "items": {"type": "string"}}}}}}},
                "responses": {"200": {"description": "the refs this API key does not hold", "content": _json({
                    "type": "object", "required": ["missing"],
                    "properties": {"missing": {"type": "array", "items": {"type": "string"}}}})},
                              **_errors(400, 401, 413, 415, 503)}}},
            "/healthz": {"get": {"operationId": "healthz", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"operationId": "readyz", "responses": {
                "200": {"description": "Redis reachable and a worker alive"}, **_errors(503)}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {
                    "type": "string"}}}}, **_errors(401)}}},
        },
        "components": {"schemas": components},
    }
    if keys_required:
        doc["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer", "description": "one of GRADSVC_API_KEYS"}}
        doc["security"] = [{"apiKey": []}]
        open_routes = ["/healthz", "/readyz"] + ([] if metrics_require_key else ["/metrics"])
        for path in open_routes:
            doc["paths"][path]["get"]["security"] = []
    return doc
