"""The docs and the job pages in a real browser (headless Chromium, Debian's chromium + chromium-driver,
driven by selenium) against a live stack with API keys: log in once, a finished job's page shows the check
per parameter, the memory bars, the timings and the grad_fn chain; /docs renders the schema and its example
runs; no console error and no request to another origin; another key's job page is refused.

One browser for the module. GRADSVC_SCREENSHOT=docs/job-page.png also writes the job page's screenshot
there (the README's picture); GRADSVC_RUN_SCREENSHOT=docs/run-page.png the run page's (docs/runs.md's)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.stack import start_stack

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the dev extra")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY_A, KEY_B = "browser-key-a", "browser-key-b"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="Debian's chromium and chromium-driver are not "
                                "installed (.ci/run installs them)")
# The README's first request, with the grad_fn chain.
FIRST_REQUEST = {
    "model": {"layers": [{"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "Tanh"},
                         {"type": "Linear", "in_features": 8, "out_features": 3}], "dtype": "float64", "seed": 0},
    "inputs": [[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]], "targets": [0, 2],
    "loss": "cross_entropy", "options": {"numcheck": "exact", "graph": True},
}


@pytest.fixture(scope="module")
def page_stack():
    s = start_stack(workers=1, GRADSVC_API_KEYS=f"{KEY_A},{KEY_B}")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def jobs(page_stack) -> dict[str, dict]:
    """A finished job of each key: {key: result}."""
    out = {}
    for key in (KEY_A, KEY_B):
        r = httpx.post(f"{page_stack.base_url}/gradients?wait=60", json=FIRST_REQUEST, timeout=90,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text[:500]
        out[key] = r.json()
    return out


@pytest.fixture(scope="module")
def browser(page_stack):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,1800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    except Exception as exc:  # a browser that is installed but cannot start here (no shared memory, ...)
        pytest.skip(f"headless chromium does not start: {exc}")
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _foreign_requests(driver, origin: str) -> list[str]:
    urls = driver.execute_script(
        "return [location.href].concat(performance.getEntriesByType('resource').map(e => e.name))")
    return [u for u in urls if not (u.startswith(origin + "/") or u.startswith("data:"))]


def _login(driver, base_url: str, path: str, key: str) -> None:
    driver.delete_all_cookies()
    driver.get(base_url + path)
    form = WebDriverWait(driver, 10).until(EC.presence_of_element_located((By.ID, "login")))
    form.find_element(By.NAME, "key").send_keys(key)
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(driver, 10).until(EC.url_to_be(base_url + path))


def test_a_finished_jobs_page_shows_the_check_memory_bars_timings_and_chain(browser, page_stack, jobs, tmp_path):
    result = jobs[KEY_A]
    base = page_stack.base_url
    _login(browser, base, f"/ui/jobs/{result['job_id']}", KEY_A)
    assert browser.find_element(By.ID, "status").text == "finished"
    assert float(browser.find_element(By.ID, "loss").text) == pytest.approx(result["loss"], rel=1e-5)
    assert browser.find_element(By.ID, "numcheck-verdict").text == "passed"
    rows = browser.find_elements(By.CSS_SELECTOR, "#per-parameter tbody tr")
    assert [r.find_element(By.TAG_NAME, "code").text for r in rows] == list(result["numcheck"]["per_parameter"])
    for row, check in zip(rows, result["numcheck"]["per_parameter"].values()):
        verdicts = row.find_elements(By.CSS_SELECTOR, "td.verdict")
        assert [v.text.splitlines()[0] for v in verdicts] == [check["judged"], check["returned_judged"]]
        assert all(v.find_element(By.CLASS_NAME, "why").text for v in verdicts)  # and why
    bars = browser.find_elements(By.CSS_SELECTOR, "#memory-table .memory-bar")
    assert len(bars) == len(result["memory"]["layers"])
    widths = [b.size["width"] for b in bars]
    top = max(range(len(widths)), key=widths.__getitem__)
    assert result["memory"]["layers"][top]["saved_bytes"] == max(l["saved_bytes"] for l in result["memory"]["layers"])
    phases = [r.find_element(By.TAG_NAME, "td").text for r in
              browser.find_elements(By.CSS_SELECTOR, "#timings-table tbody tr")]
    assert phases == ["queue", "prepare", "forward", "backward", "memory", "numcheck", "total"]
    boxes = browser.find_elements(By.CSS_SELECTOR, "svg.grad-fn-graph g.grad-fn")
    assert [b.text for b in boxes] == [n["name"] for n in result["graph"]]
    assert browser.find_element(By.CSS_SELECTOR, "svg.grad-fn-graph").size["height"] > 100
    shot = tmp_path / "job-page.png"
    browser.find_element(By.TAG_NAME, "body").screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("GRADSVC_SCREENSHOT"):
        shutil.copy(shot, Path(__file__).resolve().parents[2] / os.environ["GRADSVC_SCREENSHOT"])
    assert _console_errors(browser) == []
    assert _foreign_requests(browser, base) == []


def test_the_job_list_links_to_the_owners_jobs_only(browser, page_stack, jobs):
    base = page_stack.base_url
    _login(browser, base, "/ui/jobs", KEY_A)
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "#jobs a")]
    assert links == [f"{base}/ui/jobs/{jobs[KEY_A]['job_id']}"]
    browser.find_element(By.CSS_SELECTOR, "#jobs a").click()
    WebDriverWait(browser, 10).until(EC.presence_of_element_located((By.ID, "numcheck")))
    assert _console_errors(browser) == []


def test_another_keys_job_page_is_refused(browser, page_stack, jobs):
    base = page_stack.base_url
    _login(browser, base, "/ui/jobs", KEY_A)
    browser.get(f"{base}/ui/jobs/{jobs[KEY_B]['job_id']}")
    assert "another API key" in browser.find_element(By.ID, "not-found").text
    assert browser.find_elements(By.ID, "numcheck") == []
    errors = _console_errors(browser)  # the browser reports the page's own 404, nothing else
    assert len(errors) == 1 and "404" in errors[0], errors
    r = httpx.get(f"{base}/ui/jobs/{jobs[KEY_B]['job_id']}", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404 and jobs[KEY_B]["job_id"] in r.text and "numcheck" not in r.text


def test_the_docs_render_the_schema_and_its_example_runs_as_written(browser, page_stack, jobs, tmp_path):
    base = page_stack.base_url
    browser.delete_all_cookies()
    browser.get(base + "/docs")  # open without a key (GRADSVC_DOCS_REQUIRE_KEY unset); Authorize sends one
    wait = WebDriverWait(browser, 30)
    post = wait.until(EC.presence_of_element_located((By.ID, "operations-gradients-postGradients")))
    labels = {e.get_attribute("id") for e in browser.find_elements(By.CSS_SELECTOR, ".opblock[id^=operations-]")}
    assert {"operations-jobs-getJob", "operations-gradients-postEstimate", "operations-service-getLayers"} <= labels
    browser.find_element(By.CSS_SELECTOR, "button.authorize").click()
    wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, ".auth-container input"))).send_keys(KEY_A)
    browser.find_element(By.CSS_SELECTOR, ".auth-btn-wrapper button.authorize").click()
    browser.find_element(By.CSS_SELECTOR, "button.btn-done, button.close-modal").click()
    post.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait.until(lambda d: post.find_elements(By.CSS_SELECTOR, "button.execute"))
    post.find_element(By.CSS_SELECTOR, "button.execute").click()
    status = wait.until(lambda d: post.find_elements(By.CSS_SELECTOR, ".live-responses-table tbody .response-col_status"))
    assert status[0].text.strip() == "200", post.find_element(By.CSS_SELECTOR, ".live-responses-table").text[:500]
    browser.save_screenshot(str(tmp_path / "docs.png"))
    assert _console_errors(browser) == []
    assert _foreign_requests(browser, base) == []


RUN_STEPS = 5


@pytest.fixture(scope="module")
def run_steps(page_stack) -> list[str]:
    """A training run of KEY_A's (an MLP, SGD, RUN_STEPS steps through client.run): its job ids in step order."""
    import torch
    from torch import nn

    from gradclient import Client

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    job_ids = []
    with Client(page_stack.base_url, api_key=KEY_A, timeout=120) as client:
        run = client.run("exp <b>\"1\" &amp;")
        for step in range(RUN_STEPS):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            result = run.gradients(model, x, y, numcheck="off" if step == 2 else "auto")
            for name, p in model.named_parameters():
                p.grad = torch.as_tensor(result.gradients[name])
            opt.step()
            job_ids.append(result.job_id)
    return job_ids


def test_a_runs_page_draws_a_point_per_step_and_links_each_steps_job(browser, page_stack, run_steps, tmp_path):
    from urllib.parse import quote

    base = page_stack.base_url
    name = 'exp <b>"1" &amp;'
    path = f"/ui/runs/{quote(name, safe='')}"
    _login(browser, base, "/ui/runs", KEY_A)
    browser.find_element(By.CSS_SELECTOR, "#runs a").click()  # the list links the run's page
    WebDriverWait(browser, 10).until(EC.presence_of_element_located((By.ID, "run-name")))
    assert browser.current_url == base + path
    assert browser.find_element(By.ID, "run-name").text == name  # escaped: shown as text, not markup
    for plot in ("loss-plot", "norm-plot"):
        assert len(browser.find_elements(By.CSS_SELECTOR, f"svg#{plot} circle.point")) == RUN_STEPS, plot
    modules = browser.find_elements(By.CSS_SELECTOR, "svg#norm-heatmap text.module")
    assert [m.text for m in modules] == ["0", "2"]
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg#norm-heatmap rect.cell")) == 2 * RUN_STEPS
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg#ratio-heatmap rect.cell")) == 2 * (RUN_STEPS - 1)
    links = browser.find_elements(By.CSS_SELECTOR, "svg#verdict-strip a")
    assert [a.get_dom_attribute("href") for a in links] == [f"/ui/jobs/{job_id}" for job_id in run_steps]
    verdicts = [a.find_element(By.TAG_NAME, "rect").get_attribute("class") for a in links]
    assert verdicts == ["verdict passed"] * 2 + ["verdict off"] + ["verdict passed"] * 2
    assert browser.find_element(By.CSS_SELECTOR, "svg#loss-plot").size["height"] > 100
    shot = tmp_path / "run-page.png"
    browser.find_element(By.TAG_NAME, "body").screenshot(str(shot))
    if os.environ.get("GRADSVC_RUN_SCREENSHOT"):
        shutil.copy(shot, Path(__file__).resolve().parents[2] / os.environ["GRADSVC_RUN_SCREENSHOT"])
    assert _console_errors(browser) == []
    assert _foreign_requests(browser, base) == []
    browser.get(f"{base}/ui/jobs/{run_steps[2]}")  # the step whose check was off: not checked, not failed
    assert "Not checked" in browser.find_element(By.ID, "numcheck").text
    assert not browser.find_elements(By.ID, "numcheck-verdict")
    browser.get(f"{base}/ui/jobs/{run_steps[-1]}")  # the job page links back to its run
    link = browser.find_element(By.CSS_SELECTOR, "#run-link a")
    assert link.text == name and link.get_attribute("href") == base + path


def test_another_keys_run_page_and_list_show_nothing_of_the_run(browser, page_stack, run_steps):
    base = page_stack.base_url
    _login(browser, base, "/ui/runs", KEY_B)
    assert browser.find_elements(By.ID, "no-runs")
    browser.get(f"{base}/ui/runs/exp")
    assert "no run" in browser.find_element(By.ID, "not-found").text
