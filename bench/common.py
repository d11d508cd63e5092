"""What every bench shares: the repo on sys.path, the reference nets and a private stack (from the test
support, tests/support/), timing helpers and the table printer."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import stack  # noqa: E402
from tests.support.nets import SEED_A_LAYERS, seed_a_body, wide_stack_layers  # noqa: E402,F401  (the benches' nets)
from tests.support.stack import Stack  # noqa: E402,F401


def start_stack(workers: int = 1, **kwargs) -> Stack:
    """A private stack (tests/support/stack.py) as `gradsvc up` configures it: large payloads handed over in
    a per-stack dir under /dev/shm (gradsvc/broker/handoff.py) unless the environment sets GRADSVC_HANDOFF_DIR
    (GRADSVC_HANDOFF_DIR= for the path through Redis alone)."""
    return stack.start_stack(workers, **{"handoff": True, **kwargs})


def raw_tensor(t) -> dict:
    """A torch tensor as a wire tensor with raw bytes (the MessagePack transport's form)."""
    t = t.contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": t.numpy().tobytes()}


def concurrent_posts(base_url: str, content: bytes, clients: int, per_client: int,
                     headers: dict[str, str] | None = None, light: bool = False) -> dict[str, float]:
    """`clients` threads, each POST /gradients?wait=30 `per_client` times one after another, started
    together: requests/s over the wall time, p50 and p99 latency (ms). Each thread keeps one keep-alive
    connection: an httpx.Client, or with `light` a bare http.client.HTTPConnection (about a fifth of httpx's
    CPU per request: on a 2-core machine the load generator then takes less of the cores it measures)."""
    import threading

    lat: list[float] = []
    errors: list[str] = []
    combined = [0]  # answers with `combined` set: computed together with others of a worker's take
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    post = _light_poster if light else _httpx_poster

    def client():
        mine, together = [], 0
        with post(base_url, {"Content-Type": "application/json", **(headers or {})}) as send:
            send(None)  # GET /healthz: the connection made before the clock starts
            start.wait()
            for _ in range(per_client):
                t0 = time.perf_counter()
                status, answer = send(content)
                mine.append(1e3 * (time.perf_counter() - t0))
                if status != 200:
                    errors.append(answer[:200].decode(errors="replace"))
                elif b'"combined":null' not in answer:
                    together += 1
        with lock:
            lat.extend(mine)
            combined[0] += together

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, errors[:3]
    return {"rps": len(lat) / wall, "p50": median(lat), "p99": percentile(lat, 99), "combined": combined[0] / len(lat)}


@contextlib.contextmanager
def _httpx_poster(base_url: str, headers: dict[str, str]):
    """send(body) -> (status, content): POST /gradients?wait=30 (GET /healthz for None) on one httpx.Client."""
    import httpx

    with httpx.Client(base_url=base_url, timeout=60, headers=headers) as c:
        def send(body):
            r = c.get("/healthz") if body is None else c.post("/gradients", params={"wait": 30}, content=body)
            return r.status_code, r.content

        yield send


@contextlib.contextmanager
def _light_poster(base_url: str, headers: dict[str, str]):
    """As _httpx_poster, on one keep-alive http.client.HTTPConnection."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        def send(body):
            if body is None:
                conn.request("GET", "/healthz", headers=headers)
            else:
                conn.request("POST", "/gradients?wait=30", body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.read()

        yield send
    finally:
        conn.close()


def timed(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds per call, `warmup` untimed calls first."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def sync(device) -> None:
    """Waits for the device's queued work (CUDA), so that a clock read after it counts that work; nothing on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def median(xs) -> float:
    return statistics.median(xs)


def percentile(xs, q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} cores"


def header(title: str, what: str) -> float:
    print(f"\n## {title}\n")
    print(what.strip())
    print(f"\nstart: {load()}\n")
    return time.perf_counter()


def footer(started: float) -> None:
    print(f"\nend: {load()}; took {time.perf_counter() - started:.1f} s")


def table(head: list[str], rows: list[list]) -> None:
    """A Markdown table; floats to 3 significant figures where that reads well."""

    def fmt(v) -> str:
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 100:
                return f"{v:.0f}"
            if abs(v) >= 1:
                return f"{v:.2f}"
            return f"{v:.3g}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(head)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def verdict(value: float, goal: float, *, at_most: bool = True) -> str:
    ok = value <= goal if at_most else value >= goal
    return "met" if ok else "NOT met"
