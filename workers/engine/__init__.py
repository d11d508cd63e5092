"""Pure PyTorch: spec -> nn.Module, losses, gradients, numerical check, memory accounting.

Usable as a library with no server running: `compute(request) -> GradientResult`.
"""

from .compute import compute, estimate, resolve_device
from .errors import ComputeError, EngineError, SpecError
from .prepare import EngineConfig, config_from_settings, prepare
from .spec import Limits, layer_catalogue, warm_up_shape_check

__all__ = ["compute", "estimate", "resolve_device", "EngineError", "SpecError", "ComputeError", "EngineConfig",
           "prepare", "config_from_settings", "Limits", "layer_catalogue", "warm_up_shape_check"]
