"""The API's metrics module alone: workers by state and queue depth as read at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rq.worker import WorkerStatus

from service.api_metrics import ApiMetrics


class _Worker:
    def __init__(self, state: WorkerStatus) -> None:
        self.state = state

    def get_state(self) -> WorkerStatus:
        return self.state


class _Store:
    """What the collector reads from service.job_reader.JobReader, without a Redis."""

    def __init__(self, states=(), depths=None, down: bool = False) -> None:
        self.states, self.depths, self.down = states, depths or {}, down

    def queue_depths(self) -> dict[str, int]:
        if self.down:
            raise ConnectionError("redis is down")
        return self.depths

    def workers(self) -> list[_Worker]:
        return [_Worker(s) for s in self.states]


def scrape(store: _Store) -> dict[tuple[str, tuple], float]:
    text = generate_latest(ApiMetrics(store).registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_booting_worker_counts_as_idle_and_a_running_one_as_busy():
    got = scrape(_Store(states=[WorkerStatus.STARTED, WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.SUSPENDED]))
    assert got[("gradsvc_workers", (("state", "idle"),))] == 2
    assert got[("gradsvc_workers", (("state", "busy"),))] == 1
    assert got[("gradsvc_workers", (("state", "suspended"),))] == 1


def test_queue_depth_is_exported_per_queue():
    got = scrape(_Store(depths={"gradsvc": 3, "gradsvc-cpu": 0, "gradsvc-cuda": 7}))
    assert got[("gradsvc_queue_depth", (("queue", "gradsvc"),))] == 3
    assert got[("gradsvc_queue_depth", (("queue", "gradsvc-cuda"),))] == 7


def test_a_scrape_with_redis_down_still_answers_with_the_request_metrics():
    got = scrape(_Store(down=True))
    assert not any(name in ("gradsvc_queue_depth", "gradsvc_workers") for name, _ in got)
    assert ("gradsvc_jobs_submitted_total", ()) in got
