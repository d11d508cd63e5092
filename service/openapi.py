"""The OpenAPI 3.1 document for GET /schema, generated from the wire Structs (the one definition)."""

from __future__ import annotations

from typing import Any

import msgspec

from gradsvc import __version__
from gradsvc.wire import ErrorBody, Estimate, GradientRequest, GradientResult, JobAccepted, JobInfo, LayerInfo

_REF = "#/components/schemas/{name}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "error", "content": _json(_ref("ErrorBody"))} for s in statuses}


def build(max_wait_s: float) -> dict[str, Any]:
    (_, _, _, _, _, _, _), components = msgspec.json.schema_components(
        [GradientRequest, GradientResult, JobInfo, JobAccepted, ErrorBody, Estimate, LayerInfo], ref_template=_REF)
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    wait = {"name": "wait", "in": "query", "required": False,
            "description": "seconds to wait for the result before answering 202",
            "schema": {"type": "number", "minimum": 0, "maximum": max_wait_s}}
    body = {"required": True, "content": {**_json(_ref("GradientRequest")),
                                          "application/msgpack": {"schema": _ref("GradientRequest")}}}
    common = (400, 401, 413, 422, 429, 503)
    return {
        "openapi": "3.1.0",
        "info": {"title": "gradsvc", "version": __version__,
                 "description": "Gradients, a float64 finite-difference check, activation memory and timings."},
        "paths": {
            "/gradients": {"post": {
                "operationId": "postGradients", "parameters": [wait], "requestBody": body,
                "responses": {"200": {"description": "the result", "content": _json(_ref("GradientResult"))},
                              "202": {"description": "queued; poll Location",
                                      "content": _json(_ref("JobAccepted"))},
                              **_errors(*common, 409, 504, 507)}}},
            "/estimate": {"post": {
                "operationId": "postEstimate", "requestBody": body,
                "responses": {"200": {"description": "predicted memory", "content": _json(_ref("Estimate"))},
                              **_errors(*common)}}},
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
            "/healthz": {"get": {"operationId": "healthz", "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"operationId": "readyz", "responses": {
                "200": {"description": "Redis reachable and a worker alive"}, **_errors(401, 503)}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {
                    "type": "string"}}}}, **_errors(401)}}},
        },
        "components": {"schemas": components},
    }
