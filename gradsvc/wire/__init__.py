"""The wire format: every request, result and error Struct, shared by the API, the workers and the SDK.

No torch here: the SDK imports this package without PyTorch installed. One module per resource, each name
re-exported here (`from gradsvc.wire import GradientRequest`):

    tensors      a tensor on the wire (Tensor, DTYPES, ITEMSIZE) and its helpers
    graphs       an exported graph as plain data (GraphSpec, GraphInput, OpNode, FunctionSpec, Specialised)
    request      POST /gradients' body (GradientRequest, ModelSpec, LossSpec, Options and its parts)
    result       a job's answer (GradientResult, Numcheck, Memory, Timings, ShardsInfo)
    diagnostics  options.diagnostics, clip and curvature in a result (Diagnostics, ClipResult, Curvature)
    runs         training runs (RunRef on a request; RunStep, RunSummary, RunInfo read back)
    jobs         a job's state (JobInfo, JobAccepted, Progress) and the release header
    errors       the error body (ErrorBody, ErrorInfo) and the one table of codes (ERROR_CODES)
    estimates    POST /estimate's answer (Estimate)
    layers       GET /layers' entries (LayerInfo, LayerArgument)
    sessions     training sessions (SessionCreate, SessionBatch, SessionStepResult, SessionInfo, OptimizerSpec)
    common       the shared decode constraints (NonEmpty, AtLeastOne) and encoders
"""

from gradsvc.wire.common import JSON_ENCODER, MSGPACK_ENCODER, AtLeastOne, NonEmpty
from gradsvc.wire.diagnostics import (DIAGNOSTICS, PER_EXAMPLE_DIAGNOSTICS, ClipResult, Curvature, Density,
                                      Diagnostics, NoiseScale, Norms)
from gradsvc.wire.errors import ERROR_CODES, ErrorBody, ErrorCode, ErrorInfo
from gradsvc.wire.estimates import Estimate, EstimateLimits
from gradsvc.wire.graphs import (Capture, CapturedInput, FunctionSpec, GraphInput, GraphSpec, OpNode,
                                 Specialised)
from gradsvc.wire.jobs import JOB_STATUSES, MAX_RELEASED, RELEASE_HEADER, JobAccepted, JobInfo, Progress
from gradsvc.wire.layers import LayerArgument, LayerInfo
from gradsvc.wire.request import (MAX_SHARDS, MAX_TIMING_REPEAT, ClipOptions, CurvatureOptions, GradientRequest,
                                  HvpOptions, Inputs, LossSpec, ModelSpec, NumcheckMode, Options)
from gradsvc.wire.result import (GradientResult, GraphNode, LayerMemory, Memory, Numcheck, ParameterCheck,
                                 PerSample, QuantityCheck, ShardsInfo, Timings)
from gradsvc.wire.runs import (MAX_RUN_STEP, RUN_NAME_PATTERN, RunCheck, RunInfo, RunName, RunRef, RunStep,
                               RunSummary)
from gradsvc.wire.sessions import (SESSION_RETURNS, IdempotencyKeyField, OptimizerSpec, SessionBatch, SessionCreate,
                                   SessionCreated, SessionId, SessionInfo, SessionOptimStep, SessionOptions,
                                   SessionStepResult, SessionTimings, MemberTimings)
from gradsvc.wire.tensors import (COMPLEX_DTYPES, DTYPES, ITEMSIZE, Tensor, TensorLike, by_reference, is_tensor, owned,
                                  raw_data, refs_only)

__all__ = [
    "AtLeastOne", "COMPLEX_DTYPES", "Capture", "CapturedInput", "ClipOptions", "ClipResult", "Curvature",
    "CurvatureOptions", "DIAGNOSTICS",
    "DTYPES", "Density", "Diagnostics", "ERROR_CODES", "ErrorBody", "ErrorCode", "ErrorInfo", "Estimate",
    "EstimateLimits",
    "FunctionSpec", "GradientRequest", "GradientResult", "GraphInput", "GraphNode", "GraphSpec", "HvpOptions",
    "ITEMSIZE", "Inputs", "JOB_STATUSES", "JSON_ENCODER", "JobAccepted", "JobInfo", "LayerArgument", "LayerInfo",
    "LayerMemory", "LossSpec", "MAX_RELEASED", "MAX_RUN_STEP", "MAX_SHARDS", "MAX_TIMING_REPEAT", "MSGPACK_ENCODER",
    "Memory", "ModelSpec", "NoiseScale", "NonEmpty", "Norms", "Numcheck", "NumcheckMode", "OpNode", "Options",
    "PER_EXAMPLE_DIAGNOSTICS", "ParameterCheck", "PerSample", "Progress", "QuantityCheck", "RELEASE_HEADER",
    "RUN_NAME_PATTERN", "RunCheck", "RunInfo", "RunName", "RunRef", "RunStep", "RunSummary", "SESSION_RETURNS",
    "IdempotencyKeyField", "OptimizerSpec", "SessionBatch", "SessionCreate", "SessionCreated", "SessionId",
    "SessionInfo", "SessionOptimStep", "SessionOptions", "SessionStepResult", "SessionTimings", "MemberTimings",
    "ShardsInfo",
    "Specialised",
    "Tensor", "TensorLike", "Timings", "by_reference", "is_tensor", "owned", "raw_data", "refs_only",
]
