"""A bounded load through the SDK (several clients, one Idempotency-Key per call, as the SDK sends it) and
its accounting against what Redis holds at the end: every call finished once or failed with a code its
client saw; no job lost, none run twice. For the fault tests (Sentinel failover, chaos)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gradclient import Client, GradientClientError
from gradsvc.broker import keys

from ..support.nets import SEED_A_LAYERS


@dataclass
class Outcome:
    call: int
    job_id: str | None  # the job the call's answer named (its result's, or its error's)
    code: str  # "finished", or the error code the client saw


def call_inputs(call: int) -> list[list[float]]:
    """Each call's own inputs: a job run for one call is told from another's by its body."""
    return [[(call % 997) / 1000.0, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, call / 100_000.0]]


def run_load(base_url: str, clients: int, calls_per_client: int, done: threading.Event | None = None,
             retry_for_s: float = 30.0, pace_s: float = 0.0) -> list[Outcome]:
    """`clients` threads, each with its own SDK Client making `calls_per_client` gradients() calls in turn,
    `pace_s` apart (so that a load lasts as long on a quiet machine as its faults need)."""
    model = {"layers": SEED_A_LAYERS, "dtype": "float64"}

    def client_loop(index: int) -> list[Outcome]:
        out = []
        with Client(base_url, wire_format="json", retry_for_s=retry_for_s, timeout=30) as client:
            for k in range(calls_per_client):
                if k and pace_s:
                    time.sleep(pace_s)
                call = index * calls_per_client + k
                try:
                    result = client.gradients(model, call_inputs(call), [0, 2], seed=0, numcheck="off",
                                              memory=False, timeout=90)
                    out.append(Outcome(call, result.job_id, "finished"))
                except GradientClientError as exc:
                    out.append(Outcome(call, exc.job_id, exc.code))
        return out

    with ThreadPoolExecutor(clients) as pool:
        results = [o for part in pool.map(client_loop, range(clients)) for o in part]
    if done is not None:
        done.set()
    return results


def job_ids(redis) -> set[str]:
    """The ids of the job records Redis holds."""
    return {k.decode().rsplit(":", 1)[1] for k in redis.scan_iter("rq:job:*") if redis.type(k) == b"hash"}


def account(outcomes: list[Outcome], redis, before: set[str] = frozenset()) -> dict:
    """What happened to every call, checked against Redis's records (read with `redis`, at the end; `before`:
    the jobs it held before the load): the figures, asserting that no job was lost or run twice."""
    seen = [o.job_id for o in outcomes if o.job_id]
    dup_ids = [j for j, n in Counter(seen).items() if n > 1]
    assert not dup_ids, f"two calls were answered with one job: {dup_ids}"
    stored = job_ids(redis) - before
    orphans = sorted(stored - set(seen))
    # Each execution appends its end (finished or failed) to the job's RQ results stream.
    runs = {j: redis.xlen(keys.rq_results_stream(j)) for j in stored}
    twice = {j: n for j, n in runs.items() if n > 1}
    finished = [o for o in outcomes if o.code == "finished"]
    figures = {"calls": len(outcomes), "finished": len(finished),
               "failed": dict(Counter(o.code for o in outcomes if o.code != "finished")),
               "jobs_in_redis": len(stored), "orphan_jobs": len(orphans), "run_twice": len(twice),
               # failed calls whose answer named a job Redis has no record of (it lost it: job_lost)
               "records_lost": sum(1 for o in outcomes if o.job_id and o.job_id not in stored)}
    assert not twice, f"jobs run more than once: {twice}"
    assert not orphans, f"jobs no call was told of (a retry made a second job, or a lost answer): {orphans}"
    for o in finished:  # a finished call's job ran exactly once
        assert runs.get(o.job_id) == 1, (o, runs.get(o.job_id))
    assert all(o.code for o in outcomes)
    return figures
