"""The pages for a browser: log in once, the owner's recent jobs, one page per job (its status while it
runs, then the loss, the check per parameter, memory bars per layer, timings and the grad_fn chain), the owner's
training runs and one page per run (its curves, module x step heatmaps and check verdicts)."""

from __future__ import annotations

from urllib.parse import quote, urlsplit

import anyio.to_thread
from litestar import Request, Response, get, post
from litestar.response import Redirect
from markupsafe import Markup

from gradsvc.wire import JobInfo

from . import graph_svg, html, recent, run_svg
from .exceptions import ServiceError
from .api_state import ApiState
from .run_routes import owned_steps
from .page_login import LOGIN_TTL_S, PageLogin

# A running job's page reloads itself this often (a <meta> refresh: no script).
REFRESH_S = 2
# How each check judged a parameter (ParameterCheck.judged / returned_judged; docs/api.md, Result).
VERDICTS = {
    "ratio": "its error relative to its own scale is within the tolerance",
    "floor": "element by element within atol + tolerance x |gradient|: a tensor small beside the model's gradient",
    "zero": "its gradient is zero to working precision: no ratio is meaningful; the headline errors leave it out",
    "failed": "its error is outside the tolerance",
    "": "this check did not look at it",
}
# A run's page draws its last PLOT_STEPS steps and lists its last TABLE_STEPS.
PLOT_STEPS = 1000
TABLE_STEPS = 200
_PHASES = ("queue_ms", "prepare_ms", "forward_ms", "backward_ms", "memory_ms", "numcheck_ms", "total_ms")
_PAGE_PATHS = ("/ui/", "/docs")


def login_redirect(request: Request) -> Redirect:
    return Redirect(f"/ui/login?next={quote(request.url.path)}", status_code=303)


def _location(path: str) -> str:
    """A page's path (decoded: a run's name may hold < " % # ? or a space) as a Location header's value, so the
    browser asks for that very page."""
    return quote(path, safe="/")


def _next_path(given: str | None) -> str:
    """Where a login sends the browser: one of this service's pages, never another host."""
    if given and given.startswith(_PAGE_PATHS) and "//" not in given and "\\" not in given:
        return given
    return "/ui/jobs"


@get("/ui/login", include_in_schema=False)
async def login_form(request: Request, state: ApiState) -> Response:
    page_login = state.page_login
    nxt = _next_path(request.query_params.get("next"))
    if not page_login.auth.enabled:
        return Redirect(_location(nxt), status_code=303)
    return html.page("login.html", next=nxt, failed=False, ttl_h=LOGIN_TTL_S // 3600, logged_in=False)


@post("/ui/login", include_in_schema=False, status_code=303)
async def login(request: Request, state: ApiState) -> Response:
    page_login = state.page_login
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        # Another site's page posting the form (login CSRF: the browser would hold the attacker's session).
        raise ServiceError("bad_request", f"the login form was posted from another site (Origin {origin[:100]!r}); "
                           "log in from this service's own page, /ui/login", header="Origin")
    form = await request.form()
    nxt = _next_path(form.get("next"))
    token = await page_login.login(str(form.get("key", "")), request.client.host if request.client else "")
    if token is None:
        return html.page("login.html", status_code=401, next=nxt, failed=True, ttl_h=LOGIN_TTL_S // 3600,
                         logged_in=False)
    return Redirect(_location(nxt), status_code=303, cookies=[PageLogin.cookie(request, token)])


@post("/ui/logout", include_in_schema=False, status_code=303)
async def logout(request: Request, state: ApiState) -> Response:
    page_login = state.page_login
    await page_login.logout(request)
    return Redirect("/ui/login", status_code=303, cookies=[PageLogin.cookie(request, "", max_age=0)])


@get("/ui/jobs", include_in_schema=False)
async def job_list(request: Request, viewer: str | None, state: ApiState) -> Response:
    reader, page_login = state.reader, state.page_login
    if viewer is None:
        return login_redirect(request)
    jobs = []
    for job_id in await recent.recent(reader.aredis, reader.prefix, viewer):
        try:
            jobs.append(await reader.info(job_id, viewer, with_result=False))
        except ServiceError:  # expired since it was listed
            continue
    return html.page("jobs.html", jobs=jobs, limit=recent.RECENT_JOBS, logged_in=page_login.auth.enabled)


@get("/ui/jobs/{job_id:str}", include_in_schema=False)
async def job_page(request: Request, viewer: str | None, state: ApiState, job_id: str) -> Response:
    reader, page_login = state.reader, state.page_login
    if viewer is None:
        return login_redirect(request)
    try:
        job = await reader.info(job_id, viewer)  # GET /jobs/{id}'s rule: another key's job reads as unknown
    except ServiceError as exc:
        if exc.code != "not_found":
            raise
        return html.page("missing.html", status_code=404, message=exc.message, logged_in=page_login.auth.enabled)
    max_nodes = state.settings.page_graph_nodes
    run = await anyio.to_thread.run_sync(state.runs.job_run, job_id) if job.status == "finished" else None
    # Off the event loop: a result's page (its drawing, its tables) costs time that grows with the result.
    return await anyio.to_thread.run_sync(
        lambda: html.page("job.html", logged_in=page_login.auth.enabled, **{**job_context(job, max_nodes), "run": run}))


def job_context(job: JobInfo, max_graph_nodes: int = graph_svg.DEFAULT_MAX_NODES) -> dict:
    """What job.html shows: the job, and for a result its bars (percentages of the largest) and chain."""
    r = job.result
    context = {"job": job, "r": r, "running": job.status in ("queued", "started"), "refresh_s": REFRESH_S,
               "verdicts": VERDICTS, "memory_rows": [], "timing_rows": [], "graph_svg": None, "norm_rows": [],
               "density_rows": [], "run": None}
    if r is None:
        return context
    if r.memory is not None:
        top = max((layer.saved_bytes for layer in r.memory.layers), default=0) or 1
        context["memory_rows"] = [{"layer": layer, "pct": round(100 * layer.saved_bytes / top, 1)}
                                  for layer in r.memory.layers]
    times = {phase: getattr(r.timings, phase) for phase in _PHASES}
    top_ms = max(times.values()) or 1
    context["timing_rows"] = [{"phase": phase.removesuffix("_ms"), "ms": ms, "pct": round(100 * ms / top_ms, 1)}
                              for phase, ms in times.items()]
    context.update(_diagnostics_rows(r))
    if r.graph:
        # names escaped by graph_svg itself
        context["graph_svg"] = Markup(graph_svg.render(r.graph, max_graph_nodes))
    return context


DENSITY_BINS = 24


def _diagnostics_rows(r) -> dict:
    """Bars for the module norms (percent of the largest) and the density's weights binned by eigenvalue."""
    out: dict = {}
    norms = r.diagnostics.norms if r.diagnostics is not None else None
    if norms is not None:
        top = max(norms.modules.values(), default=0.0) or 1.0
        out["norm_rows"] = [{"module": m, "norm": v, "pct": round(100 * v / top, 1)} for m, v in norms.modules.items()]
    density = r.curvature.density if r.curvature is not None else None
    if density is not None and density.eigenvalues:
        lo, hi = min(density.eigenvalues), max(density.eigenvalues)
        width = (hi - lo) / DENSITY_BINS or 1.0
        bins = [0.0] * DENSITY_BINS
        for value, weight in zip(density.eigenvalues, density.weights):
            bins[min(int((value - lo) / width), DENSITY_BINS - 1)] += weight
        peak = max(bins) or 1.0
        out["density_rows"] = [{"at": lo + (i + 0.5) * width, "weight": w, "pct": round(100 * w / peak, 1)}
                               for i, w in enumerate(bins)]
    return out


@get("/ui/runs", include_in_schema=False)
async def run_list(request: Request, viewer: str | None, state: ApiState) -> Response:
    if viewer is None:
        return login_redirect(request)
    runs = await anyio.to_thread.run_sync(state.runs.runs, viewer)
    return html.page("runs.html", runs=runs, logged_in=state.page_login.auth.enabled)


@get("/ui/runs/{name:str}", include_in_schema=False)
async def run_page(request: Request, viewer: str | None, state: ApiState, name: str) -> Response:
    if viewer is None:
        return login_redirect(request)
    try:
        steps = await owned_steps(state, viewer, name)  # GET /runs/{name}'s rule: another key's run is unknown
    except ServiceError as exc:
        return html.page("missing.html", status_code=404, message=exc.message, what="run",
                         logged_in=state.page_login.auth.enabled)
    # Drawn in a thread: a long run of a deep model is hundreds of thousands of SVG elements, which on the event
    # loop held every other client (the page's size is bounded too: GRADSVC_RUN_PAGE_CELLS).
    cells = state.settings.run_page_cells
    return await anyio.to_thread.run_sync(lambda: html.page("run.html", logged_in=state.page_login.auth.enabled,
                                                            **run_context(name, steps, cells)))


def run_context(name: str, kept, max_cells: int = 100_000) -> dict:
    """What run.html shows: the run's steps and its plots (SVG made here, every name escaped by run_svg). A long
    run shows its last PLOT_STEPS steps (a page of 10,000 steps x 30 modules would be 300,000 heatmap cells);
    each heatmap draws at most `max_cells` cells (GRADSVC_RUN_PAGE_CELLS): every k-th of those steps, the last
    one always, and the first `max_cells` modules. The CSV has them all."""
    steps = kept[-PLOT_STEPS:]
    noise = [(s.step, s.noise_scale) for s in steps if s.noise_scale is not None]
    modules = max((len(s.module_grad_norms) for s in steps), default=1) or 1
    stride = max(1, -(-len(steps) * modules // max_cells))  # ceil
    drawn = steps[::-1][::stride][::-1]
    plots = {
        "loss_svg": run_svg.curve("loss-plot", "loss", [(s.step, s.loss) for s in steps]),
        "norm_svg": run_svg.curve("norm-plot", "gradient norm", [(s.step, s.grad_norm) for s in steps]),
        "noise_svg": run_svg.curve("noise-plot", "noise scale", noise) if noise else "",
        "norm_heatmap": run_svg.heatmap("norm-heatmap", "gradient norm per module", drawn, "module_grad_norms",
                                        max_cells),
        "ratio_heatmap": run_svg.heatmap("ratio-heatmap", "update ratio per module", drawn, "update_ratio", max_cells),
        "verdict_svg": run_svg.verdicts("verdict-strip", steps),
    }
    return {"name": name, "steps": steps, "kept": len(kept), "table_steps": steps[-TABLE_STEPS:][::-1],
            "heatmap_stride": stride, **{k: Markup(v) for k, v in plots.items()}}


@get("/ui/static/{name:str}", include_in_schema=False)
async def page_asset(name: str) -> Response:
    return html.asset(html.STATIC, {"pages.css": "text/css"}, name)


ROUTES = [login_form, login, logout, job_list, job_page, run_list, run_page, page_asset]
