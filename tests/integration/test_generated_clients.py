"""Clients generated from GET /schema work as their generators' users run them: openapi-python-client, and
openapi-typescript + openapi-fetch compiled with `tsc --strict`, each pointed at the live schema of a stack with
API keys on (the schema answers without one), without a warning about it; each sends the first request (the
6-8-3 tanh net) and reads the gradients and the numerical check, compared with torch.autograd here."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from service.openapi import EXAMPLE_REQUEST
from tests.support.models import local_gradients
from tests.support.stack import start_stack

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KEY = "generated-client-key"
# The TypeScript tools, installed once into the repository's ignored .gradsvc/ and reused by later runs.
NODE_DIR = ROOT / ".gradsvc" / "typescript-client"
NODE_PACKAGES = ["openapi-typescript@7.13.0", "openapi-fetch@0.17.0", "typescript@5.9"]


@pytest.fixture(scope="module")
def keyed_stack():
    s = start_stack(workers=1, GRADSVC_API_KEYS=KEY)
    yield s
    s.stop()


def _reference() -> dict[str, torch.Tensor]:
    """The gradients of the first request by local autograd: the service builds seed 0's weights as
    `torch.manual_seed(0); nn.Sequential(...)` does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.tensor(EXAMPLE_REQUEST["inputs"], dtype=torch.float64)
    return local_gradients(model, x, torch.tensor(EXAMPLE_REQUEST["targets"]), "cross_entropy")


def _assert_matches_autograd(gradients: dict[str, list]) -> None:
    reference = _reference()
    assert set(gradients) == set(reference)
    for name, expected in reference.items():
        got = torch.tensor(gradients[name], dtype=torch.float64)
        assert torch.allclose(got, expected, rtol=0, atol=1e-12 * expected.abs().max()), name


def _no_warnings(out: subprocess.CompletedProcess) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "warning" not in text.lower() and "⚠" not in text, text[-4000:]
    return text


def test_a_generated_python_client_sends_the_first_request_and_reads_gradients_and_the_check(keyed_stack,
                                                                                             tmp_path):
    package = tmp_path / "gradsvc_api"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # its ruff post-hooks
    _no_warnings(subprocess.run([str(BIN / "openapi-python-client"), "generate", "--url",
                                 f"{keyed_stack.base_url}/schema", "--output-path", str(package), "--meta", "none"],
                                capture_output=True, text=True, env=env, timeout=300))
    sys.path.insert(0, str(tmp_path))
    try:
        api = importlib.import_module("gradsvc_api")
        post_gradients = importlib.import_module("gradsvc_api.api.gradients.post_gradients")
        models = importlib.import_module("gradsvc_api.models")
    finally:
        sys.path.remove(str(tmp_path))
    client = api.AuthenticatedClient(base_url=keyed_stack.base_url, token=KEY,
                                     timeout=api.client.httpx.Timeout(120))
    response = post_gradients.sync_detailed(client=client, body=models.GradientRequest.from_dict(EXAMPLE_REQUEST),
                                            wait=60)
    assert response.status_code == 200, response.content[:500]
    result = response.parsed
    assert isinstance(result, models.GradientResult)
    _assert_matches_autograd({name: t.data for name, t in result.gradients.additional_properties.items()})
    check = result.numcheck
    assert (check.mode, check.passed, check.evaluations) == ("exact", True, 166)
    assert 0 < check.max_rel_error < 1e-6 and isinstance(result.gradients["0.weight"].b64, api.types.Unset)


FIRST_REQUEST_TS = """\
import createClient from "openapi-fetch";
import type { paths } from "./schema.js";

const client = createClient<paths>({ baseUrl: BASE_URL, headers: { Authorization: "Bearer " + API_KEY } });
const { data, response } = await client.POST("/gradients", {
  params: { query: { wait: 60 } },
  body: {
    model: {
      layers: [{ type: "Linear", in_features: 6, out_features: 8 }, { type: "Tanh" },
               { type: "Linear", in_features: 8, out_features: 3 }],
      dtype: "float64", seed: 0,
    },
    inputs: [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]],
    targets: [0, 2],
    loss: "cross_entropy",
    options: { numcheck: "exact" },
  },
});
if (data === undefined || !("gradients" in data)) {
  throw new Error("no result: HTTP " + response.status);
}
const gradients: Record<string, unknown> = {};
for (const [name, tensor] of Object.entries(data.gradients)) {
  gradients[name] = tensor?.data;
}
const check = data.numcheck;
console.log(JSON.stringify({ gradients, mode: check?.mode, passed: check?.passed,
                             max_rel_error: check?.max_rel_error, b64: data.gradients["0.weight"]?.b64 }));
"""


def _node_tools() -> Path:
    """NODE_DIR with the packages installed (npm's registry is needed once); skips where node, npm or the
    registry is unavailable."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the TypeScript client is not generated here")
    if not (NODE_DIR / "node_modules" / ".bin" / "tsc").exists():
        NODE_DIR.mkdir(parents=True, exist_ok=True)
        (NODE_DIR / "package.json").write_text('{"private": true, "type": "module"}\n')
        out = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent", *NODE_PACKAGES],
                             cwd=NODE_DIR, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            pytest.skip(f"npm could not install {NODE_PACKAGES} (no network to the npm registry?): "
                        f"{out.stderr[-500:]}")
    return NODE_DIR


def test_a_generated_typescript_client_compiles_strict_and_reads_gradients_and_the_check(keyed_stack):
    tools = _node_tools()
    bin_ = tools / "node_modules" / ".bin"
    _no_warnings(subprocess.run([str(bin_ / "openapi-typescript"), f"{keyed_stack.base_url}/schema", "-o",
                                 str(tools / "schema.d.ts")], cwd=tools, capture_output=True, text=True, timeout=300))
    consts = f"const BASE_URL = {json.dumps(keyed_stack.base_url)};\nconst API_KEY = {json.dumps(KEY)};\n"
    source = FIRST_REQUEST_TS.replace('from "./schema.js";\n', 'from "./schema.js";\n\n' + consts, 1)
    (tools / "first.ts").write_text(source)
    _no_warnings(subprocess.run([str(bin_ / "tsc"), "--strict", "--target", "es2022",
                                 "--module", "nodenext", "--moduleResolution", "nodenext", "--lib", "es2022,dom",
                                 "--outDir", "out", "first.ts"], cwd=tools, capture_output=True, text=True,
                                timeout=300))
    out = subprocess.run(["node", str(tools / "out" / "first.js")], cwd=tools, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout)
    _assert_matches_autograd(answer["gradients"])
    assert (answer["mode"], answer["passed"], "b64" in answer) == ("exact", True, False)
    assert 0 < answer["max_rel_error"] < 1e-6


def test_the_schema_and_the_docs_answer_without_a_key_and_the_api_still_asks_for_one(keyed_stack):
    import httpx

    with httpx.Client(base_url=keyed_stack.base_url, timeout=30) as anonymous:
        assert anonymous.get("/schema").json()["openapi"] == "3.1.0"
        assert anonymous.get("/docs").headers["content-type"].startswith("text/html")
        assert anonymous.get("/").headers["location"] == "/docs"
        assert anonymous.post("/gradients", json=EXAMPLE_REQUEST).status_code == 401
