"""A run's page and CSV made from its steps, without a server: every run and module name escaped (they are the
requester's data), a point a step in each curve, a heatmap cell a module and step, each verdict linking its job;
the CSV reads back to the same numbers, with names that need quoting."""

from __future__ import annotations

import csv
import io

from gradsvc.wire import RunCheck, RunStep
from service import html
from service.pages import run_context
from service.run_routes import steps_csv

EVIL = '<script>alert("x")</script>'


def steps(n: int = 4) -> list[RunStep]:
    return [RunStep(step=i, job_id=f"job-{i}", ended_at="t", loss=1.0 / (i + 1), grad_norm=2.0 + i,
                    module_grad_norms={"0": 1.0 + i, EVIL: 0.5, "a,b": 0.25},
                    update_ratio={"0": 1e-3, EVIL: 2e-3} if i else None, total_ms=1.0, losses={"task": 0.1},
                    numcheck=RunCheck("exact", i != 2, 1e-9)) for i in range(n)]


def test_the_run_page_escapes_every_name_and_draws_a_point_a_step():
    page = html.page("run.html", logged_in=False, **run_context(EVIL, steps())).content
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert page.count('class="point"') == 2 * 4  # loss and gradient norm
    assert page.count('<rect class="cell"') == 3 * 4 + 2 * 3  # norms: 3 modules x 4 steps; ratios from step 1
    assert [f'href="/ui/jobs/job-{i}"' in page for i in range(4)] == [True] * 4
    assert page.count("verdict failed") == 1


def test_the_csv_has_a_row_a_step_and_a_column_a_module_whatever_its_name():
    rows = list(csv.DictReader(io.StringIO(steps_csv(steps()))))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert float(rows[3][f"grad_norm[{EVIL}]"]) == 0.5 and float(rows[3]["grad_norm[a,b]"]) == 0.25
    assert rows[0]["update_ratio[0]"] == "" and float(rows[1][f"update_ratio[{EVIL}]"]) == 2e-3
    assert float(rows[2]["loss[task]"]) == 0.1 and rows[2]["numcheck_passed"] == "false"
    assert [float(r["loss"]) for r in rows] == [s.loss for s in steps()]


def test_a_step_whose_check_did_not_run_reads_off_on_the_page_and_an_empty_cell_in_the_csv():
    run = steps(2)
    run[1].numcheck = RunCheck("off", None, 0.0)
    page = html.page("run.html", logged_in=False, **run_context("exp", run)).content
    assert page.count("verdict off") == 1 and "verdict failed" not in page and "off passed" not in page
    rows = list(csv.DictReader(io.StringIO(steps_csv(run))))
    assert [(r["numcheck_mode"], r["numcheck_passed"]) for r in rows] == [("exact", "true"), ("off", "")]


def wide_steps(n: int, modules: int) -> list[RunStep]:
    return [RunStep(step=i, job_id=f"job-{i}", ended_at="t", loss=1.0, grad_norm=1.0,
                    module_grad_norms={f"m{j}": 1.0 + j for j in range(modules)},
                    update_ratio={f"m{j}": 1e-3 for j in range(modules)} if i else None, total_ms=1.0)
           for i in range(n)]


def test_a_long_run_of_a_deep_model_draws_at_most_the_page_cells_in_each_heatmap_and_says_so():
    """300 steps x 64 modules is 19,200 cells a heatmap; the page draws every k-th step within 2,000 cells, the
    last step always, and the curves keep every step."""
    kept = wide_steps(300, 64)
    context = run_context("deep", kept, max_cells=2_000)
    page = html.page("run.html", logged_in=False, **context).content
    norm_cells = page.count('<rect class="cell"') - page.split('id="ratio-heatmap"')[1].count('<rect class="cell"')
    assert 0 < norm_cells <= 2_000 and context["heatmap_stride"] == 10
    assert "step 299: " in page.split('id="norm-heatmap"')[1] and 'id="heatmap-stride"' in page
    assert page.count('class="point"') == 2 * 300
    small = html.page("run.html", logged_in=False, **run_context("small", steps(), max_cells=2_000)).content
    assert 'id="heatmap-stride"' not in small
    assert run_context("wide", wide_steps(2, 5_000), max_cells=2_000)["norm_heatmap"].count('<rect class="cell"') \
        <= 2_000


def test_the_csv_leaves_the_error_of_a_check_that_did_not_run_empty_not_zero():
    off = [RunStep(step=0, job_id="j", ended_at="t", loss=1.0, grad_norm=1.0, module_grad_norms={"0": 1.0},
                   total_ms=1.0, numcheck=RunCheck("off", False, 0.0))]
    row = next(csv.DictReader(io.StringIO(steps_csv(off))))
    assert row["numcheck_mode"] == "off" and row["numcheck_max_rel_error"] == ""
