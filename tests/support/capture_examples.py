"""Writes service/openapi_examples.json: a live stack's answers to the OpenAPI document's example request and
to a few wrong ones, the examples /docs and generated clients show. Run from the repository root:

    PYTHONPATH=$PWD python -m tests.support.capture_examples
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from service import openapi
from tests.support.stack import start_stack

OUT = Path(openapi.__file__).with_name("openapi_examples.json")


def _wrong_requests() -> dict[str, tuple[dict, dict]]:
    """Status -> (request keywords, what it shows): one real error body per status the document lists."""
    mismatched = copy.deepcopy(openapi.EXAMPLE_REQUEST)
    mismatched["model"]["layers"][2]["in_features"] = 6
    return {"400": {"content": b'{"model": ', "headers": {"Content-Type": "application/json"}},
            "404": {"method": "GET", "url": "/jobs/00000000-0000-4000-8000-000000000000"},
            "415": {"content": b"x", "headers": {"Content-Type": "text/plain"}},
            "422": {"json": mismatched}}


def capture(http) -> dict:
    examples: dict = {}
    r = http.post("/gradients", json=openapi.EXAMPLE_REQUEST, params={"wait": 60})
    examples["result"] = r.raise_for_status().json()
    examples["job"] = http.get(f"/jobs/{examples['result']['job_id']}").json()
    queued = http.post("/gradients", json=openapi.EXAMPLE_REQUEST, params={"wait": 0})
    examples["accepted"] = queued.json()
    examples["estimate"] = http.post("/estimate", json=openapi.EXAMPLE_REQUEST).json()
    examples["layers"] = [e for e in http.get("/layers").json() if e["type"] in ("Linear", "Tanh")]
    piece = b"\0" * 16
    ref = hashlib.sha256(piece).hexdigest()
    examples["piece"] = http.put(f"/tensors/{ref}", content=piece).json()
    examples["missing"] = http.post("/tensors/missing", json={"refs": [ref, "f" * 64]}).json()
    examples["errors"] = {}
    for status, request in _wrong_requests().items():
        method, url = request.pop("method", "POST"), request.pop("url", "/gradients")
        r = http.request(method, url, **request)
        assert str(r.status_code) == status, (status, r.text)
        examples["errors"][status] = r.json()
    return examples


def main() -> None:
    stack = start_stack(workers=1)
    try:
        with stack.http_client() as http:
            examples = capture(http)
    finally:
        stack.stop()
    OUT.write_text(json.dumps(examples, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
