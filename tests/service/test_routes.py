"""A route handler is a module-level function that finds the API's parts in Litestar's app state
(service/api_state.py): it runs in an app of its own, with stand-ins for what it reads, and create_app
registers every one of them."""

from __future__ import annotations

from litestar import Litestar
from litestar.testing import TestClient

from service import app as app_module
from service import probe_routes
from service.api_state import ApiState
from service.error_responses import handle_exception


class _Epochs:
    def refresh(self) -> str:
        return "0000abcd"


class _Reader:
    """What /readyz reads of service.job_reader.JobReader, without a Redis."""

    def __init__(self, workers: int) -> None:
        self.epochs, self.n = _Epochs(), workers

    def ping(self) -> bool:
        return True

    def probe_write(self) -> None:
        pass

    def workers(self) -> list[object]:
        return [object()] * self.n


def _readyz(workers: int):
    app = Litestar([probe_routes.readyz], exception_handlers={Exception: handle_exception},
                   state=ApiState({"reader": _Reader(workers)}))
    with TestClient(app) as client:
        return client.get("/readyz")


def test_readyz_alone_answers_ready_with_the_worker_count_and_503_not_ready_without_one():
    r = _readyz(2)
    assert r.status_code == 200 and r.json() == {"status": "ready", "workers": 2}
    r = _readyz(0)
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


def test_create_app_registers_every_module_level_handler():
    paths = {(route.path, method) for route in app_module.create_app().routes for method in route.methods}
    for handler in app_module.ROUTES:
        for path in handler.paths:
            assert all((path, m) in paths for m in handler.http_methods), (path, handler.http_methods)
