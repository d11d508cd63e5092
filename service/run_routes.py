"""GET /runs (the caller's runs), GET /runs/{name} (its steps, as JSON, MessagePack or CSV) and DELETE
/runs/{name}. Another key's run reads as unknown (404), as another key's job does."""

from __future__ import annotations

import csv
import io

import anyio.to_thread
from litestar import Request, Response, delete, get, route

from gradsvc.wire import RunCheck, RunInfo, RunStep

from .api_state import ApiState
from .exceptions import ServiceError
from .negotiation import respond

CSV_MEDIA_TYPE = "text/csv"  # Litestar adds "; charset=utf-8" to a text type
_FIXED = ("step", "job_id", "ended_at", "loss", "grad_norm", "total_ms", "numcheck_mode", "numcheck_passed",
          "numcheck_max_rel_error", "noise_scale")


async def owned_steps(state: ApiState, owner: str, name: str) -> list[RunStep]:
    steps = await anyio.to_thread.run_sync(state.runs.steps, owner, name)
    if steps is None:
        raise ServiceError("not_found", f"no run {name!r} for this API key (its steps may have expired: "
                           "GRADSVC_RUN_TTL_S after the last one); GET /runs lists this key's runs", run=name)
    return steps


@route("/runs/{name:str}", http_method=["OPTIONS"], include_in_schema=False)
async def run_options() -> Response:
    # Litestar's own OPTIONS answer for a path served by two handlers lists only the first one's methods.
    return Response(None, status_code=204, headers={"Allow": "DELETE, GET, OPTIONS"})


@get("/runs")
async def list_runs(request: Request, owner: str, state: ApiState) -> Response:
    return respond(request, await anyio.to_thread.run_sync(state.runs.runs, owner))


@get("/runs/{name:str}")
async def get_run(request: Request, owner: str, state: ApiState, name: str) -> Response:
    fmt = request.query_params.get("format", "json")
    if fmt not in ("csv", "json"):
        raise ServiceError("invalid_parameter", f"format={fmt!r} is not a format of a run; use format=csv, or "
                           "leave it out for JSON (or MessagePack by Accept)", parameter="format", value=fmt)
    last = _last(request)
    steps = await owned_steps(state, owner, name)
    if last is not None:
        steps = steps[-last:] if last else []
    _bounded(steps, state.settings.run_export_max_cells, name)
    # Encoded in a thread: a long run of a deep model is megabytes of text.
    if fmt == "csv":
        text = await anyio.to_thread.run_sync(steps_csv, steps)
        return Response(text, media_type=CSV_MEDIA_TYPE,
                        headers={"Content-Disposition": 'attachment; filename="run.csv"'})
    return await anyio.to_thread.run_sync(lambda: respond(request, RunInfo(name=name, steps=steps)))


def _last(request: Request) -> int | None:
    raw = request.query_params.getall("last", [])
    if not raw:
        return None
    if len(raw) != 1 or not raw[0].isdigit():
        raise ServiceError("invalid_parameter", f"query parameter `last`: expected one whole number of steps (the run's "
                           f"last n), got {'&'.join(raw)[:40]!r}", parameter="last", value="&".join(raw)[:40])
    return int(raw[0])


def _bounded(steps: list[RunStep], max_cells: int, name: str) -> None:
    """A run's answer holds at most max_cells values (steps x columns: GRADSVC_RUN_EXPORT_MAX_CELLS)."""
    cells = sum(len(_FIXED) + len(s.module_grad_norms) + len(s.update_ratio or ()) + len(s.losses or ())
                for s in steps)
    if cells <= max_cells:
        return
    fits = max(1, len(steps) * max_cells // cells)
    raise ServiceError("too_large", f"run {name!r}: its {len(steps)} steps are {cells} values, over "
                       f"GRADSVC_RUN_EXPORT_MAX_CELLS={max_cells}; ask for its last steps with ?last={fits} (or fewer)",
                       run=name, cells=cells, max_cells=max_cells, setting="GRADSVC_RUN_EXPORT_MAX_CELLS", last=fits)


@delete("/runs/{name:str}", status_code=200)
async def delete_run(request: Request, owner: str, state: ApiState, name: str) -> Response:
    if not await anyio.to_thread.run_sync(state.runs.delete, owner, name):
        raise ServiceError("not_found", f"no run {name!r} for this API key; GET /runs lists this key's runs",
                           run=name)
    return respond(request, {"deleted": name})


def _verdict(check: RunCheck | None) -> str:
    """The numcheck_passed cell: true, false, or empty where the check did not run."""
    if check is None or check.passed is None:
        return ""
    return "true" if check.passed else "false"


def steps_csv(steps: list[RunStep]) -> str:
    """One row a step: the step's figures, then one column per named loss, module gradient norm and module
    update ratio (`loss[name]`, `grad_norm[module]`, `update_ratio[module]`; empty where a step has none)."""
    losses = _columns(s.losses for s in steps)
    modules = _columns(s.module_grad_norms for s in steps)
    ratios = _columns(s.update_ratio for s in steps)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*_FIXED, *(f"loss[{n}]" for n in losses), *(f"grad_norm[{m}]" for m in modules),
                     *(f"update_ratio[{m}]" for m in ratios)])
    for s in steps:
        nc = s.numcheck
        writer.writerow([s.step, s.job_id, s.ended_at, repr(s.loss), repr(s.grad_norm), repr(s.total_ms),
                         nc.mode if nc else "", _verdict(nc),
                         repr(nc.max_rel_error) if nc and nc.mode != "off" else "", _cell(s.noise_scale),
                         *(_cell((s.losses or {}).get(n)) for n in losses),
                         *(_cell(s.module_grad_norms.get(m)) for m in modules),
                         *(_cell((s.update_ratio or {}).get(m)) for m in ratios)])
    return out.getvalue()


def _columns(maps) -> list[str]:
    """The keys of every map, in the order they first appear (a module's place in the model)."""
    seen: dict[str, None] = {}
    for m in maps:
        seen.update(dict.fromkeys(m or ()))
    return list(seen)


def _cell(value: float | None) -> str:
    return "" if value is None else repr(value)


ROUTES = [run_options, list_runs, get_run, delete_run]
