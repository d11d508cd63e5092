"""The RQ and redis-py internals listed in gradsvc/broker/internals.py are still there, in the shape the
project relies on; and the worker overrides nothing of RQ's that the list does not name."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
from rq.worker import SimpleWorker

from gradsvc.broker.internals import INSTANCE_FIELDS, RELIED_ON
from workers.worker import GradientWorker


def _resolve(dotted: str):
    """The object a dotted name names, read statically (a classmethod stays one): the longest importable
    module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = inspect.getattr_static(obj, name)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted, parameters", RELIED_ON, ids=[name for name, _ in RELIED_ON])
def test_each_relied_on_name_exists_with_the_parameters_listed(dotted, parameters):
    obj = _resolve(dotted)
    if parameters is None:
        return
    function = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
    assert tuple(inspect.signature(function).parameters) == parameters, dotted


@pytest.mark.parametrize("owner, field", INSTANCE_FIELDS, ids=[f"{o}.{f}" for o, f in INSTANCE_FIELDS])
def test_each_relied_on_instance_field_is_still_assigned_by_its_class(owner, field):
    source = "".join(inspect.getsource(cls) for cls in _resolve(owner).__mro__
                     if cls.__module__.split(".")[0] in ("rq", "redis"))
    assert re.search(rf"self\.{field}\b\s*(:[^=\n]*)?=", source), f"{owner} no longer sets self.{field}"


def test_the_worker_overrides_only_the_listed_simpleworker_methods():
    listed = {name.rsplit(".", 1)[1] for name, _ in RELIED_ON if name.startswith("rq.worker.SimpleWorker.")}
    overridden = {name for name, value in vars(GradientWorker).items()
                  if callable(value) and any(name in vars(base) for base in SimpleWorker.__mro__)}
    assert overridden == listed
