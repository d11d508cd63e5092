"""The OpenAPI 3.1 document for GET /schema, generated from the wire Structs (the one definition)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from gradsvc import __version__, wire
from gradsvc.engine.session_state import ARGUMENTS as OPTIMIZER_ARGUMENTS
from gradsvc.engine.tensors import FLOAT_DTYPES
from gradsvc.wire import (MAX_RELEASED, RELEASE_HEADER, RUN_NAME_PATTERN, ErrorBody, Estimate, GradientRequest,
                          GradientResult, JobAccepted, JobInfo, LayerInfo, RunInfo, RunSummary, SessionBatch,
                          SessionCreate, SessionCreated, SessionInfo, SessionOptimStep, SessionStepResult)

# Real answers of a stack to EXAMPLE_REQUEST and to a few wrong ones, shown by /docs and generated clients
# (tests/service/test_openapi.py checks them against the schema and torch.autograd).
EXAMPLES = msgspec.json.decode(Path(__file__).with_name("openapi_examples.json").read_bytes())

_REF = "#/components/schemas/{name}"
# The first request of the README: the 6-8-3 tanh net, float64, the exact numerical check.
EXAMPLE_REQUEST = {
    "model": {"layers": [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
                         {"type": "Linear", "in_features": 8, "out_features": 3}], "dtype": "float64", "seed": 0},
    "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
    "loss": "cross_entropy", "options": {"numcheck": "exact"},
}
# A queued job's id leads to its state and its cancel (clients and schemathesis's stateful phase follow these).
_JOB_LINKS = {"getJob": {"operationId": "getJob", "parameters": {"job_id": "$response.body#/job_id"}},
              "cancelJob": {"operationId": "cancelJob", "parameters": {"job_id": "$response.body#/job_id"}}}
_INPUTS = [GradientRequest, SessionCreate, SessionBatch, SessionOptimStep]
_OUTPUTS = [GradientResult, JobInfo, JobAccepted, ErrorBody, Estimate, LayerInfo, RunSummary, RunInfo, SessionCreated,
            SessionStepResult, SessionInfo]
TAGS = [{"name": "gradients", "description": "Submit a model and a batch; read gradients, the check, memory"},
        {"name": "jobs", "description": "A submitted job: its state and result, or its cancel"},
        {"name": "tensors", "description": "Large tensors uploaded once in pieces, then sent by reference"},
        {"name": "runs", "description": "Training runs: each finished step of a request's `run`, read back"},
        {"name": "sessions", "description": "Training sessions: the weights and optimizer stay on a worker, each "
                                            "step sends a batch (docs/sessions.md)"},
        {"name": "service", "description": "The layer table, the probes and the metrics"}]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict, example: Any = None) -> dict:
    media = {"schema": schema}
    if example is not None:
        media["example"] = example
    return {"application/json": media}


def _errors(*statuses: int) -> dict[str, Any]:
    """Each status's answer: the error body, with a real one of that status as its example where there is one."""
    return {str(s): {"description": _STATUS_MEANING.get(s, "error"),
                     "content": _json(_ref("ErrorBody"), EXAMPLES["errors"].get(str(s)))} for s in statuses}


_STATUS_MEANING = {400: "malformed body, query or header", 401: "missing or unknown API key",
                   404: "no such job for this API key", 409: "the job was canceled", 410: "gone for good",
                   413: "over a size limit",
                   415: "neither JSON nor MessagePack", 422: "a valid body the model or the engine refuses",
                   429: "rate limited; see Retry-After", 503: "Redis unreachable, or no live worker",
                   504: "the job ran past GRADSVC_JOB_TIMEOUT_S", 507: "the device ran out of memory"}


_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def _declare_rules(schemas: dict[str, Any]) -> None:
    """What the API refuses that msgspec's schema cannot say, said in JSON Schema so that a generator makes no
    request the API must refuse for it: a layer is an object with a string `type` (and its constructor arguments),
    exactly one model form, `loss` or `losses` but not both, `targets` by loss, each optimizer's own arguments.
    What JSON Schema cannot say (a piece's bytes hashing to the digest its path names, a layer type from the
    allow-list with arguments that chain) is in docs/api.md and answered 422."""
    layers = next(s for s in schemas["ModelSpec"]["properties"]["layers"]["anyOf"] if s.get("type") == "array")
    layers["items"] = {"type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
                       "additionalProperties": True,
                       "description": "a layer: `type` from GET /layers, the other keys its constructor arguments"}
    _declare_one_model_form(schemas["ModelSpec"])
    schemas["ModelSpec"]["properties"]["dtype"]["enum"] = list(FLOAT_DTYPES)
    graph = schemas["GraphSpec"]["properties"]
    graph["outputs"]["minItems"] = 1  # the loss applies to the first
    graph["inputs"]["contains"] = {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "input"}}}
    ref = next(s for s in schemas["ModelSpec"]["properties"]["graph_ref"]["anyOf"] if s.get("type") == "string")
    ref["pattern"] = "^[0-9a-f]{64}$"  # a result's graph_ref: a sha256
    for name in ("GradientRequest", "SessionBatch"):
        _declare_targets(schemas[name])
        _declare_loss_or_losses(schemas[name])
    _declare_optimizer_arguments(schemas["OptimizerSpec"])


_NOT_NULL = {"not": {"type": "null"}}
_MODEL_FORMS = ("layers", "graph", "graph_ref")


def _declare_one_model_form(model: dict[str, Any]) -> None:
    """Exactly one of layers / graph / graph_ref not null (gradsvc/engine/prepare.py's model_dtype): an anyOf of
    three branches that exclude each other, each requiring its form and nulling the other two (a oneOf of bare
    `required` lists would leave generators rejecting most of what they draw)."""
    model["anyOf"] = [{"required": [form], "properties": {
        other: (_NOT_NULL if other == form else {"type": "null"}) for other in _MODEL_FORMS}} for form in _MODEL_FORMS]


def _declare_loss_or_losses(request: dict[str, Any]) -> None:
    """`loss` or `losses`, not both (gradsvc/engine/decode.py's loss_terms); a null one counts as absent. The
    model's own loss stands alone: given as `loss`, never among `losses`."""
    request["not"] = {"required": ["loss", "losses"], "properties": {"loss": _NOT_NULL, "losses": _NOT_NULL}}
    losses = next(s for s in request["properties"]["losses"]["anyOf"] if s.get("type") == "array")
    losses["items"] = {"allOf": [losses["items"], {"not": _OWN_LOSS}]}


def _declare_optimizer_arguments(optimizer: dict[str, Any]) -> None:
    """Each optimizer type's own arguments (gradsvc/engine/session_state.py's ARGUMENTS): one that the type does
    not take must be absent or null, as torch.optim's constructor would refuse it."""
    every = [name for name in optimizer["properties"] if name != "type"]
    optimizer["allOf"] = [
        {"if": {"properties": {"type": {"const": kind}}},
         "then": {"properties": {name: {"type": "null"} for name in every if name not in taken}}}
        for kind, taken in OPTIMIZER_ARGUMENTS.items()]


def _declare_base64(schemas: dict[str, Any]) -> None:
    """Tensor bytes in JSON are base64, in requests and in answers."""
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




def _each_schema(schema: Any):
    """Every schema object nested in `schema` (properties, items, anyOf, ...), `schema` first."""
    if isinstance(schema, dict):
        yield schema
        for value in schema.values():
            yield from _each_schema(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _each_schema(value)


def _give_arrays_items(schema: dict[str, Any]) -> None:
    """An untyped list (nested tensor data, a graph node's arguments) says its items may be anything: generators
    (openapi-python-client) refuse an array without `items`. A tuple of one type (a session's Adam `betas`) is
    that type's array of its length: openapi-python-client refuses msgspec's `items: false` after `prefixItems`."""
    for sub in _each_schema(schema):
        if sub.get("type") != "array":
            continue
        prefix = sub.get("prefixItems")
        if prefix and sub.get("items") is False and all(p == prefix[0] for p in prefix):
            sub["items"] = sub.pop("prefixItems")[0]
        elif "items" not in sub and prefix is None:
            sub["items"] = {}


def _as_input(schema: dict[str, Any]) -> None:
    """A request Struct: a field with a default is optional, and says its default in words. A `default`
    keyword would make openapi-typescript type the field as required (its defaultNonNullable)."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required or "default" not in prop:
            continue
        default = prop.pop("default")
        if default not in (None, [], {}):
            said = f"Default: `{msgspec.json.encode(default).decode()}`."
            prop["description"] = f"{prop['description']} {said}" if "description" in prop else said


def _as_output(name: str, schema: dict[str, Any]) -> None:
    """A response Struct: every field it always writes is required (msgspec writes defaults too); a Struct
    that omits defaults (Tensor's b64 and refs, ErrorBody's job_id) has them optional, with no `default`."""
    struct = getattr(wire, name)
    if struct.__struct_config__.omit_defaults:
        for prop in schema.get("properties", {}).values():
            prop.pop("default", None)
    elif "properties" in schema:
        schema["required"] = list(schema["properties"])


def _renamed(schemas: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`schemas` with each name in `names` (and each $ref to it) renamed."""
    text = msgspec.json.encode(schemas).decode()
    for old, new in names.items():
        text = text.replace(f'"{_REF.format(name=old)}"', f'"{_REF.format(name=new)}"')
    return {names.get(k, k): v for k, v in msgspec.json.decode(text).items()}


def components() -> dict[str, Any]:
    """The wire Structs as schemas, the request side apart from the response side: a Struct on both sides
    whose two schemas differ is named `<Name>-Input` and `<Name>-Output`, as FastAPI names them."""
    _, inputs = msgspec.json.schema_components(_INPUTS, ref_template=_REF)
    _, outputs = msgspec.json.schema_components(_OUTPUTS, ref_template=_REF)
    _declare_rules(inputs)
    _declare_optimizer_arguments(outputs["OptimizerSpec"])  # true of an answer's optimizer too: one schema
    _declare_base64(inputs)
    _declare_base64(outputs)
    for name, schema in inputs.items():
        _give_arrays_items(schema)
        _as_input(schema)
    for name, schema in outputs.items():
        _give_arrays_items(schema)
        _as_output(name, schema)
    for name in set(inputs) & set(outputs):
        if inputs[name] == outputs[name]:
            del outputs[name]
    split = set(inputs) & set(outputs)
    inputs = _renamed(inputs, {n: f"{n}-Input" for n in split})
    outputs = _renamed(outputs, {n: f"{n}-Output" for n in split})
    return {**inputs, **outputs}


_UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_HEADERS = [
    {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {
        "type": "string", "minLength": 1, "maxLength": 255, "pattern": "^[ -~]+$"},
     "description": "one random key (a UUID) per request: the same key with the same body within "
                    "GRADSVC_IDEMPOTENCY_TTL_S answers the job the first request created instead of another"},
    {"name": RELEASE_HEADER, "in": "header", "required": False, "schema": {
        "type": "string", "pattern": f"^ *(?:{_UUID}(?: *, *{_UUID}){{0,{MAX_RELEASED - 1}}})? *$"},
     "description": f"up to {MAX_RELEASED} comma-separated ids of this key's finished jobs whose results the "
                    "client holds: the service drops them now rather than keep them GRADSVC_RESULT_TTL_S"}]
_MSGPACK_TOO = ("JSON, or the same body as MessagePack (Content-Type: application/msgpack, tensors' raw bytes in "
                "`data`); an answer comes as MessagePack under Accept: application/msgpack")
_LOCATION = {"Location": {"description": "the job: GET it for its state", "schema": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds until the next window", "schema": {"type": "integer"}}}


def _operation(tag: str, operation_id: str, summary: str, responses: dict, **more: Any) -> dict[str, Any]:
    return {"tags": [tag], "operationId": operation_id, "summary": summary, **more, "responses": responses}


def _gradient_paths(max_wait_s: float) -> dict[str, Any]:
    wait = {"name": "wait", "in": "query", "required": False,
            "description": f"seconds to wait for the result before answering 202 (default GRADSVC_DEFAULT_WAIT_S; "
                           f"values above GRADSVC_MAX_WAIT_S, here {max_wait_s:g}, are clamped to it)",
            "schema": {"type": "number", "minimum": 0}}
    # MessagePack (the SDK's transport) is said in words, not as a second media type: client generators
    # cannot encode it, and openapi-python-client then sends JSON labelled as MessagePack.
    body = {"required": True, "description": _MSGPACK_TOO,
            "content": {"application/json": {"schema": _ref("GradientRequest"), "example": EXAMPLE_REQUEST}}}
    common = (400, 401, 413, 422, 429, 503)
    accepted = {"description": "queued or running after `wait` seconds; poll Location", "links": _JOB_LINKS,
                "headers": _LOCATION, "content": _json(_ref("JobAccepted"), EXAMPLES["accepted"])}
    errors = _errors(*common, 409, 415, 504, 507)
    errors["429"]["headers"] = _RETRY_AFTER
    return {
        "/gradients": {"post": _operation(
            "gradients", "postGradients", "Compute gradients, the numerical check, memory and timings",
            {"200": {"description": "the result", "content": _json(_ref("GradientResult"), EXAMPLES["result"])},
             "202": accepted, **errors},
            description="Queues a job and waits up to `wait` seconds for its result.",
            parameters=[wait, *_HEADERS], requestBody=body)},
        "/estimate": {"post": _operation(
            "gradients", "postEstimate", "Predict parameter count and activation memory, without the queue",
            {"200": {"description": "predicted memory", "content": _json(_ref("Estimate"), EXAMPLES["estimate"])},
             **_errors(*common, 415)}, requestBody=body)},
    }


def _job_paths() -> dict[str, Any]:
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
    job = {"description": "the job", "content": _json(_ref("JobInfo"), EXAMPLES["job"])}
    return {
        "/jobs/{job_id}": {"get": _operation(
            "jobs", "getJob", "Read a job: its status, progress, error and result",
            {"200": job, **_errors(401, 404, 503)}, parameters=[job_id])},
        "/jobs/{job_id}/cancel": {"post": _operation(
            "jobs", "cancelJob", "Cancel a job: a queued one at once, a running one within its next step",
            {"200": {**job, "description": "the job after the cancel (an ended job is left as it was)"},
             **_errors(401, 404, 503)}, parameters=[job_id],
            description="The job stays readable (status `canceled`) until GRADSVC_FAILURE_TTL_S.")},
    }


def _tensor_paths() -> dict[str, Any]:
    piece = {"type": "object", "required": ["ref", "bytes", "evicted"], "properties": {
        "ref": {"type": "string"}, "bytes": {"type": "integer"}, "evicted": {"type": "integer"}}}
    missing = {"type": "object", "required": ["missing"],
               "properties": {"missing": {"type": "array", "items": {"type": "string"}}}}
    return {
        "/tensors/{ref}": {"put": _operation(
            "tensors", "putTensorPiece", "Upload one piece of a tensor's raw bytes",
            {"201": {"description": "stored", "content": _json(piece, EXAMPLES["piece"])},
             **_errors(400, 401, 413, 422, 503)},
            description="Stored for this API key under its sha256; a request's tensors then name it in `refs`.",
            parameters=[{"name": "ref", "in": "path", "required": True,
                         "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}}],
            requestBody={"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}})},
        "/tensors/missing": {"post": _operation(
            "tensors", "postTensorsMissing", "Ask which uploaded pieces the service does not hold",
            {"200": {"description": "the refs this API key does not hold",
                     "content": _json(missing, EXAMPLES["missing"])},
             **_errors(400, 401, 413, 415, 503)},
            requestBody={"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False,
                "properties": {"refs": {"type": "array", "items": {"type": "string"}}}}}}})},
    }


def _run_paths() -> dict[str, Any]:
    """GET /runs, GET and DELETE /runs/{name} (docs/runs.md)."""
    name = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": RUN_NAME_PATTERN}}
    fmt = {"name": "format", "in": "query", "required": False, "description": "csv: one row a step, modules as "
           "columns; absent: JSON", "schema": {"type": "string", "enum": ["json", "csv"]}}
    deleted = {"type": "object", "required": ["deleted"], "properties": {"deleted": {"type": "string"}}}
    return {
        "/runs": {"get": _operation(
            "runs", "getRuns", "List this key's training runs, most recently stepped first",
            {"200": {"description": "the runs", "content": _json({"type": "array", "items": _ref("RunSummary")})},
             **_errors(401, 503)})},
        "/runs/{name}": {
            "get": _operation(
                "runs", "getRun", "Read a run's recorded steps (JSON, or CSV with format=csv)",
                {"200": {"description": "the run's steps", "content": {
                    **_json(_ref("RunInfo")), "text/csv": {"schema": {"type": "string"}}}},
                 **_errors(400, 401, 404, 503)}, parameters=[name, fmt]),
            "delete": _operation(
                "runs", "deleteRun", "Delete a run and everything recorded of it",
                {"200": {"description": "deleted", "content": _json(deleted)}, **_errors(401, 404, 503)},
                parameters=[name])},
    }


_SESSION_LINKS = {op: {"operationId": op, "parameters": {"session_id": "$response.body#/session_id"}}
                  for op in ("getSession", "postSessionStep", "getSessionWeights", "deleteSession")}


def _session_paths() -> dict[str, Any]:
    """POST /sessions and its session's routes (docs/sessions.md)."""
    sid = {"name": "session_id", "in": "path", "required": True,
           "schema": {"type": "string", "minLength": 1, "maxLength": 64}}
    key = {"name": "Idempotency-Key", "in": "header", "required": False, "schema": _HEADERS[0]["schema"],
           "description": "one random key per call: a retry under it is answered again, never applied twice"}
    wait = {"name": "wait", "in": "query", "required": False, "schema": {"type": "number", "minimum": 0},
            "description": "seconds to wait for the worker (default GRADSVC_DEFAULT_WAIT_S, at most "
                           "GRADSVC_MAX_WAIT_S)"}

    def body(name: str) -> dict:
        return {"required": True, "description": _MSGPACK_TOO, "content": _json(_ref(name))}

    answer = {"200": {"description": "the session after the call", "content": _json(_ref("SessionStepResult"))},
              "202": {"description": "still running after `wait`: send the call again with the same Idempotency-Key",
                      "content": _json(_ref("JobAccepted"))},
              **_errors(400, 401, 404, 409, 410, 413, 415, 422, 503, 504, 507)}
    tensors = {"type": "object", "additionalProperties": _ref("Tensor")}
    deleted = {"type": "object", "required": ["deleted"], "properties": {"deleted": {"type": "string"}}}

    def operation(op: str, summary: str, name: str) -> dict:
        return {"post": _operation("sessions", op, summary, answer, parameters=[sid, wait, key],
                                   requestBody=body(name))}
    return {
        "/sessions": {"post": _operation(
            "sessions", "postSession", "Create a training session: a model, an optimizer, optionally a run",
            {"201": {"description": "created", "links": _SESSION_LINKS, "content": _json(_ref("SessionCreated")),
                     "headers": {"Location": {"description": "the session", "schema": {"type": "string"}}}},
             **_errors(400, 401, 413, 415, 422, 429, 503)},
            parameters=[wait, key], requestBody=body("SessionCreate"))},
        "/sessions/{session_id}": {
            "get": _operation("sessions", "getSession", "Read where a session stands",
                              {"200": {"description": "the session", "content": _json(_ref("SessionInfo"))},
                               **_errors(401, 404, 503)}, parameters=[sid]),
            "delete": _operation("sessions", "deleteSession", "Delete a session and its checkpoint",
                                 {"200": {"description": "deleted", "content": _json(deleted)},
                                  **_errors(401, 404, 503)}, parameters=[sid])},
        "/sessions/{session_id}/step": operation(
            "postSessionStep", "Forward, backward, clip and the optimizer step over one batch", "SessionBatch"),
        "/sessions/{session_id}/forward_backward": operation(
            "postSessionForwardBackward", "Forward and backward; the gradients wait for optim_step", "SessionBatch"),
        "/sessions/{session_id}/forward": operation(
            "postSessionForward", "The forward alone: loss, log-probabilities, outputs; nothing changes",
            "SessionBatch"),
        "/sessions/{session_id}/optim_step": operation(
            "postSessionOptimStep", "Clip and apply the accumulated gradients", "SessionOptimStep"),
        "/sessions/{session_id}/weights": {"get": _operation(
            "sessions", "getSessionWeights", "Read the weights and buffers (safetensors with Accept: "
            "application/octet-stream)",
            {"200": {"description": "the weights and buffers by name", "content": {
                **_json(tensors), "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
             **_errors(401, 404, 410, 503)}, parameters=[sid])},
    }


def _service_paths() -> dict[str, Any]:
    alive = {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}}
    ready = {"type": "object", "required": ["status", "workers"],
             "properties": {"status": {"const": "ready"}, "workers": {"type": "integer", "minimum": 1}}}
    layers = {"type": "array", "items": _ref("LayerInfo")}
    return {
        "/layers": {"get": _operation(
            "service", "getLayers", "List the layer types a model may use, with their arguments",
            {"200": {"description": "allowed layer types", "content": _json(layers, EXAMPLES["layers"])},
             **_errors(401)})},
        "/healthz": {"get": _operation("service", "healthz", "Liveness probe: the API answers", {
            "200": {"description": "alive", "content": _json(alive, {"status": "ok"})}})},
        "/readyz": {"get": _operation("service", "readyz", "Readiness probe: Redis reachable and a worker alive", {
            "200": {"description": "ready", "content": _json(ready, {"status": "ready", "workers": 1})},
            **_errors(503)})},
        "/metrics": {"get": _operation("service", "metrics", "Prometheus metrics of this API process", {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {
                "type": "string"}}}}, **_errors(401)})},
    }


def build(max_wait_s: float, keys_required: bool = False, metrics_require_key: bool = False) -> dict[str, Any]:
    """`keys_required`: GRADSVC_API_KEYS is set, so every route but the probes (and /metrics unless
    `metrics_require_key`) declares the Bearer key: /docs's Authorize button sends it."""
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "gradsvc", "version": __version__,
                 "description": "Gradients, a float64 finite-difference check, activation memory and timings."},
        "tags": TAGS,
        "paths": {**_gradient_paths(max_wait_s), **_job_paths(), **_tensor_paths(), **_run_paths(),
                  **_session_paths(), **_service_paths()},
        "components": {"schemas": components()},
    }
    if keys_required:
        doc["components"]["securitySchemes"] = {"apiKey": {
            "type": "http", "scheme": "bearer", "description": "one of GRADSVC_API_KEYS"}}
        doc["security"] = [{"apiKey": []}]
        open_routes = ["/healthz", "/readyz"] + ([] if metrics_require_key else ["/metrics"])
        for path in open_routes:
            doc["paths"][path]["get"]["security"] = []
    return doc
