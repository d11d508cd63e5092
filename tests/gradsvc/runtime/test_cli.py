"""The `gradsvc` command names the API's and the worker's entry points by dotted path (it imports nothing of
service/ or workers/): each path names the function it is meant to, taking the Settings first."""

from __future__ import annotations

import inspect
import subprocess
import sys

from gradsvc.runtime import cli


def test_each_entry_point_names_its_function():
    from service.http_server import serve
    from workers.main import run

    assert cli.entry_point("serve") is serve
    assert cli.entry_point("worker") is run
    for command in cli.ENTRY_POINTS:
        assert next(iter(inspect.signature(cli.entry_point(command)).parameters)) == "settings"
    assert {"index", "burst"} <= set(inspect.signature(run).parameters)


def test_the_command_imports_neither_the_api_nor_the_worker_until_it_runs_one():
    code = ("import sys; from gradsvc.runtime import cli; cli.parser().parse_args(['serve']); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'service', 'workers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
