"""gradsvc: gradients, their numerical check, activation memory and timings, as a service."""

__version__ = "0.1.0"
