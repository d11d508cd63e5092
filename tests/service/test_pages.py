"""The job page's HTML on its own (service/pages.py, service/graph_svg.py): what came from a request is
escaped, a running job's page reloads itself, each verdict says why; the login keeps its redirect on this
host and the session cookie HttpOnly and SameSite=Strict. The browser tests (tests/integration/
test_pages_browser.py) look at the same pages in Chromium."""

from __future__ import annotations

import re
from html import unescape
from urllib.parse import quote, unquote, urlsplit

import pytest
from litestar.testing import TestClient
from markupsafe import escape

from gradsvc.runtime.settings import Settings
from service import html, pages
from service.app import create_app
from service.graph_svg import render
from gradsvc.wire import (GradientResult, GraphNode, JobInfo, LayerMemory, Memory, Numcheck, ParameterCheck,
                          Progress, Timings)

from tests.support.stack import dead_redis_url

EVIL = '<script>alert("x")</script>'


def _result() -> GradientResult:
    check = ParameterCheck(max_abs_error=1e-12, max_rel_error=1e-9, checked=4, judged="floor", returned_judged="zero")
    return GradientResult(
        device="cpu", dtype="float64", parameter_count=4, torch_version="2", loss=0.5, gradients={},
        timings=Timings(prepare_ms=1.0, forward_ms=2.0, total_ms=4.0),
        numcheck=Numcheck(mode="exact", eps=1e-6, dtype="float64", evaluations=8, max_abs_error=1e-12,
                          max_rel_error=1e-9, passed=True, tolerance=1e-6, per_parameter={f"{EVIL}.weight": check},
                          reason=f"asked for {EVIL}"),
        memory=Memory(layers=[LayerMemory(name=EVIL, type="Linear", saved_bytes=10, output_bytes=8, parameter_bytes=4),
                              LayerMemory(name="b", type="Tanh", saved_bytes=40, output_bytes=8, parameter_bytes=0)],
                      saved_bytes_total=50),
        graph=[GraphNode(id=0, name=EVIL, next=[1]), GraphNode(id=1, name="AccumulateGrad", next=[])])


def _page(job: JobInfo) -> str:
    return html.page("job.html", logged_in=False, **pages.job_context(job)).content


def test_everything_from_the_request_is_escaped_in_the_page_and_the_svg():
    text = _page(JobInfo(job_id="j", status="finished", result=_result()))
    assert "<script" not in text
    assert text.count("&lt;script&gt;") >= 4  # the parameter, the reason, the layer, the graph node
    svg = render(_result().graph)
    assert "<svg" in text and "<script" not in svg and "&lt;script&gt;" in svg


def test_the_verdicts_say_why_and_the_bars_scale_to_the_largest_layer():
    text = _page(JobInfo(job_id="j", status="finished", result=_result()))
    assert str(escape(pages.VERDICTS["floor"])) in text and str(escape(pages.VERDICTS["zero"])) in text
    assert 'style="width: 25.0%"' in text and 'style="width: 100.0%"' in text
    assert "http-equiv=\"refresh\"" not in text


def test_a_job_whose_check_did_not_run_says_not_checked_not_failed():
    result = _result()
    result.numcheck = Numcheck(mode="off", eps=0.0, dtype="float64", evaluations=0, max_abs_error=0.0,
                               max_rel_error=0.0, passed=None, tolerance=0.0, per_parameter={})
    text = _page(JobInfo(job_id="j", status="finished", result=result))
    assert "Not checked" in text and 'id="numcheck-verdict"' not in text and "failed" not in text


def test_the_diagnostics_draw_module_norms_eigenvalues_and_the_density_escaped():
    import msgspec

    from gradsvc.wire import ClipResult, Curvature, Density, Diagnostics, Norms

    result = msgspec.structs.replace(
        _result(), diagnostics=Diagnostics(norms=Norms(global_=5.0, parameters={}, modules={EVIL: 4.0, "1": 3.0})),
        clip=ClipResult(total_norm=5.0, scale=0.2),
        curvature=Curvature(matrix="hessian", top_eigenvalues=[2.5, 1.25], residuals=[1e-7, 2e-6], products=40,
                            density=Density(eigenvalues=[0.0, 1.0, 2.0], weights=[0.5, 0.25, 0.25])))
    text = _page(JobInfo(job_id="j", status="finished", result=result))
    assert "<script" not in text and "&lt;script&gt;" in text
    norms = text[text.index('id="norms-table"'):text.index("</table>", text.index('id="norms-table"'))]
    assert 'style="width: 100.0%"' in norms and 'style="width: 75.0%"' in norms
    assert "2.5" in text and "1.25" in text and "scale 0.2" in text
    density = text[text.index('id="density-table"'):text.index("</table>", text.index('id="density-table"'))]
    assert density.count('class="bar density-bar"') == pages.DENSITY_BINS
    assert density.count('style="width: 100.0%"') == 1 and density.count('style="width: 50.0%"') == 2


@pytest.mark.parametrize("status", ["queued", "started"])
def test_a_running_jobs_page_reloads_itself_and_shows_its_progress(status):
    text = _page(JobInfo(job_id="j", status=status, progress=Progress(phase="numcheck", done=3, total=8)))
    assert f'<meta http-equiv="refresh" content="{pages.REFRESH_S}">' in text
    assert '<progress max="8" value="3">' in text and "numcheck" in text


def test_the_grad_fn_svg_draws_a_box_per_node_and_an_arrow_per_edge():
    nodes = [GraphNode(id=0, name="NllLossBackward0", next=[1]), GraphNode(id=1, name="AddmmBackward0", next=[2, 3]),
             GraphNode(id=2, name="AccumulateGrad", next=[]), GraphNode(id=3, name="TBackward0", next=[2])]
    svg = render(nodes)
    assert svg.count('class="grad-fn"') == 4 and svg.count("<line") == 4


def _recurrent_chain(steps: int) -> list[GraphNode]:
    """The grad_fn chain of a one-unit RNN over `steps` steps: four nodes a step, each pointing at the next."""
    n = 4 * steps + 12
    return [GraphNode(id=i, name=f"AddmmBackward{i % 4}", next=[i + 1] if i + 1 < n else []) for i in range(n)]


def test_a_24012_node_chain_is_drawn_in_milliseconds_and_summarised_past_the_node_limit():
    import time

    nodes = _recurrent_chain(6000)
    started = time.perf_counter()
    svg = render(nodes, 400)
    took_s = time.perf_counter() - started
    assert took_s < 1.0  # the quadratic layout took 38.8 s here, on the event loop
    assert svg.count('class="grad-fn"') == 400 and svg.count("<line") == 399
    assert "the 400 nodes nearest the loss of 24012; 23612 more" in svg
    assert 'data-id="0"' in svg and 'data-id="399"' in svg and 'data-id="400"' not in svg


def test_a_chain_within_the_node_limit_is_drawn_whole_with_no_summary():
    svg = render(_recurrent_chain(10), 400)
    assert svg.count('class="grad-fn"') == 52 and "grad-fn-summary" not in svg


@pytest.fixture(scope="module")
def keyed() -> TestClient:
    # A dead Redis: the login form's failure and the redirects need none.
    settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=1, api_keys=("k",))
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.mark.parametrize("path", ["/ui/jobs", "/ui/jobs/some-id"])
def test_a_page_without_a_key_or_session_redirects_to_the_login_form(keyed, path):
    r = keyed.get(path, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next=")


def test_a_wrong_key_at_the_login_form_is_a_401_page_and_sets_no_cookie(keyed):
    r = keyed.post("/ui/login", data={"key": "wrong", "next": "/ui/jobs"}, follow_redirects=False)
    assert r.status_code == 401 and "set-cookie" not in r.headers and 'id="login-error"' in r.text


@pytest.mark.parametrize("given", ["//evil.example/ui/", "https://evil.example/", "/ui/../x\\y", None])
def test_the_login_redirects_only_to_this_services_pages(given):
    assert pages._next_path(given) == "/ui/jobs"


@pytest.mark.parametrize("name", ['a<b"c', "50% done?", "x#1 y", "é"])
def test_the_login_sends_back_to_a_run_page_whatever_its_name(keyed, name):
    page = f"/ui/runs/{name}"
    r = keyed.get(quote(page), follow_redirects=False)
    assert r.status_code == 303
    form = keyed.get(r.headers["location"])  # the login form carries the page to come back to
    carried = unescape(re.search(r'name="next" value="([^"]*)"', form.text).group(1))
    assert carried == page
    # Once logged in (or with no keys at all), the redirect asks for that very page.
    settings = Settings(redis_url=dead_redis_url(), redis_timeout_s=1)
    with TestClient(create_app(settings)) as open_client:
        back = open_client.get("/ui/login", params={"next": carried}, follow_redirects=False)
    location = back.headers["location"]
    assert back.status_code == 303 and urlsplit(location).path == location and unquote(location) == page


def test_the_pages_and_docs_allow_nothing_from_another_origin(keyed):
    r = keyed.get("/ui/login")
    assert r.headers["content-security-policy"] == html.CSP and "default-src 'self'" in html.CSP
    for asset in ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css", "/docs/assets/docs.js",
                  "/ui/static/pages.css"):
        assert keyed.get(asset).status_code == 200, asset
    assert keyed.get("/docs/assets/index.html").status_code == 404  # an allow-list, not the package's folder
