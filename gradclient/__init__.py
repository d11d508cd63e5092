"""gradclient: gradients of a local nn.Module (or a spec) from a gradsvc service, in one call.

    from gradclient import Client
    with Client("http://127.0.0.1:8000") as client:
        result = client.gradients(model, x, y, loss="cross_entropy", numcheck="off")
    result.gradients["0.weight"]  # a torch tensor (numpy without torch)

Knows only the wire format (gradsvc.wire); never imports the service or the workers. torch is optional:
Residual, RNN, LSTM, GRU, to_spec and from_spec need it and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from gradsvc.wire import Estimate, LayerInfo, LayerMemory, Memory, Numcheck, ParameterCheck, Timings

from . import errors
from .client import AsyncClient, AsyncJob, Client, Job
from .errors import *  # noqa: F403 - the exception tree is part of the package's surface
from .errors import ERRORS, GradientClientError
from .result import Curvature, Diagnostics, GradientResult, PerSample
from .sessions import AsyncSession, Session, SessionOutput

__version__ = "0.1.0"


_TORCH_NAMES = ("Residual", "RNN", "LSTM", "GRU", "to_spec", "from_spec")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from . import convert

        return getattr(convert, name)
    raise AttributeError(f"module 'gradclient' has no attribute {name!r}")


__all__ = [
    "AsyncClient", "AsyncJob", "Client", "Job", "Session", "AsyncSession", "SessionOutput", "GradientResult", "PerSample", "Diagnostics", "Curvature", "Estimate", "LayerInfo",
    "LayerMemory", "Memory", "Numcheck", "ParameterCheck", "Timings", "GradientClientError", "ERRORS", "errors",
    *_TORCH_NAMES,
    *errors.__all__,
]
