"""One table maps every error code to one status; every code the engine or jobs raise is in it."""

from __future__ import annotations

import re
from pathlib import Path

from service.errors import STATUS

ROOT = Path(__file__).resolve().parents[2]


def raised_codes() -> set[str]:
    codes = set()
    for path in [*ROOT.glob("workers/**/*.py"), *ROOT.glob("service/*.py")]:
        text = path.read_text()
        codes |= set(re.findall(r'(?:SpecError|ComputeError|ServiceError|_fail)\(\s*(?:job, ctx, )?"([a-z_]+)"', text))
        codes |= set(re.findall(r'"code": "([a-z_]+)"', text))
    return codes


def test_every_raised_code_has_a_status():
    missing = raised_codes() - set(STATUS)
    assert not missing, f"codes without an HTTP status: {missing}"
    assert len(raised_codes()) > 15


def test_only_503_is_a_5xx_for_input_caused_codes():
    input_codes = ["unknown_layer", "shape_mismatch", "bad_weights", "bad_tensor", "bad_loss", "bad_target",
                   "bad_option", "too_large", "non_finite", "malformed_body", "invalid_body", "body_too_large"]
    assert all(400 <= STATUS[c] < 500 for c in input_codes)
    assert STATUS["queue_unavailable"] == 503
    assert STATUS["out_of_memory"] == 507 and STATUS["timeout"] == 504 and STATUS["worker_lost"] == 503
