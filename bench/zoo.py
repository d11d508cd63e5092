"""The conformance run over five public zoos: every architecture each library builds at a tiny size from its own
code (nothing downloaded), in train mode, sent through the SDK to a live stack, its gradients compared with local
float32 and float64 autograd and its buffers with the local forward's, once with default options and once with
`numcheck` off. It prints the pass rate per zoo and every failure grouped by cause.

    make zoo                                     # the whole run, in its own venv (.venv-zoo/: torch 2.14.1 and
                                                 # torchvision 0.29.1, which timm needs here; docs/models.md)
    python bench/zoo.py --zoo transformers --limit 5 --json out.json
    python bench/zoo.py --only transformers/causal_lm/bloom,timm/resnet      # some models by name
    python bench/zoo.py --sample 6 --second-step  # each model's second step (capture reused) against its local step

The stack's API and worker run on the server's venv (`--server-python`, default .venv/bin/python: the pinned
torch), the zoo's libraries and the SDK on this interpreter: a client on another torch release than its server,
as users run it.

Rule for a gradient (per parameter): |service - float64| <= 10 x |float32 - float64| + 1e-6 x max|float64|, the
float32 local run's own error being what float32 arithmetic allows (a gradient that is zero in exact arithmetic
is rounding noise). Dropout is set to 0 (two generators draw different masks; dropout itself is replayed from the
job's seed and tested apart); BatchNorm and every other train-mode behaviour stay.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.zoo_models import ZOOS, Case, cases_of
from gradclient.module_state import set_state, state_of


class Outcome(NamedTuple):
    zoo: str
    name: str
    options: str  # "default" or "numcheck_off"
    passed: bool
    cause: str = ""
    seconds: float = 0.0
    detail: str = ""


# ---- common ------------------------------------------------------------------------------------------------------
def _to(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, dtype) for v in value)
    return value


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _loss_of(out: Any, targets: Any, loss: str) -> torch.Tensor:
    if loss == "output":
        if isinstance(out, torch.Tensor):
            return out
        return out["loss"] if isinstance(out, dict) else out.loss
    logits = out if isinstance(out, torch.Tensor) else (out["logits"] if isinstance(out, dict) else out[0])
    return {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}[loss](logits, targets)


def local_run(model: nn.Module, inputs: Any, targets: Any, loss: str, dtype: torch.dtype):
    """(gradients by parameter name, buffers after the forward) of a copy of `model` in `dtype`."""
    m = copy.deepcopy(model).to(dtype)
    torch.manual_seed(0)
    value = _loss_of(_call(m, _to(inputs, dtype)), _to(targets, dtype), loss)
    params = {n: p for n, p in m.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(value, list(params.values()), allow_unused=True)  # None: unused, as eager leaves it
    return dict(zip(params, grads)), {n: b.detach().clone() for n, b in m.named_buffers()}


def compare(result, g32: dict, g64: dict | None, buffers: dict, model: nn.Module) -> str:
    """"" when the answer holds, else what differs. Without a float64 answer key, float32's to 1e-4 of its scale."""
    for name, own in g32.items():
        got = result.gradients.get(name)
        if own is None:  # a parameter the loss does not use: eager leaves its .grad None, the service too (or 0)
            if got is not None and float(torch.as_tensor(got).to_dense().abs().max()) != 0.0:
                return f"gradient of the unused {name} is not zero"
            continue
        if got is None:
            return f"gradient of {name} missing"
        got, own = torch.as_tensor(got).to_dense().double(), own.to_dense().double()
        if g64 is None or not torch.equal(g64[name].isnan(), own.isnan()):  # float64 NaN where float32 is not
            # (a mask of finfo(float64).min overflowing): float32's answer is the key
            ref, allowed = own, 1e-4 * float(own.abs().nan_to_num(0.0).max()) + 1e-12
        else:
            ref = g64[name].to_dense().double()
            finite = ref.abs().nan_to_num(0.0)
            allowed = 10 * float((own - ref).abs().nan_to_num(0.0).max()) + 1e-6 * float(finite.max())
        if not torch.equal(got.isnan(), ref.isnan()):  # a NaN local autograd gives (a fully masked row) too
            return f"wrong gradient: {name} has NaN where local autograd has not, or not where it has"
        err = float((got - ref).abs().nan_to_num(0.0).max())
        if not err <= allowed:
            return f"wrong gradient: {name} off by {err:.3g}, allowed {allowed:.3g}"
    for name, want in buffers.items():
        if not want.is_floating_point():
            continue
        got = dict(model.named_buffers()).get(name)
        if got is not None and not torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-6):
            return f"buffer {name} differs from the local forward's"
    return ""


def cause_of(exc: BaseException) -> str:
    """An error's cause as a group key: its code (or class) and its message with names and numbers taken out."""
    code = getattr(exc, "code", None) or type(exc).__name__
    message = str(exc).splitlines()[0] if str(exc) else ""
    op = re.search(r"aten\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+|[a-z_]+::[A-Za-z0-9_]+", message)
    if op:
        return f"{code}: {op[0]}"
    return f"{code}: {_without_names(message)}"


def _without_names(message: str) -> str:
    """A message as a group key: quoted names and numbers taken out, its first 110 characters."""
    return re.sub(r"'[^']*'|\"[^\"]*\"|\d+(\.\d+)?(e-?\d+)?", "_", message)[:110]


def run_case(client, case: Case, numcheck: str) -> Outcome:
    """One model with one option set ("auto": default options, "off": numcheck off)."""
    return run_options(client, case, [numcheck])[0]


def run_options(client, case: Case, numchecks: list[str]) -> list[Outcome]:
    """One model with each option set in turn: built and run locally once (the answer keys), then sent once per
    option set from the same state (its weights and buffers restored between calls), as a user's second call with
    other options: the later calls reuse the recording the first one made."""
    started = time.perf_counter()
    options = ["default" if n == "auto" else "numcheck_off" for n in numchecks]

    def every(cause: str, detail: str = "") -> list[Outcome]:
        return [Outcome(case.zoo, case.name, o, False, cause, detail=detail) for o in options]

    try:
        model, inputs, targets, loss = case.build()
    except Exception as exc:  # noqa: BLE001  (the library could not build it: not the service's failure)
        return every("not built: " + cause_of(exc), str(exc)[:300])
    garbage = [n for n, t in (*model.named_parameters(), *model.named_buffers())
               if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if garbage:  # memory the library never initialised (torch_geometric's RGATConv drops its l2's torch.full)
        return every("not built: the library left weights NaN or infinite", ", ".join(garbage[:5]))
    try:
        g32, buffers = local_run(model, inputs, targets, loss, torch.float32)
    except Exception as exc:  # noqa: BLE001  (it does not run locally either)
        return every("not run locally: " + cause_of(exc), str(exc)[:300])
    try:
        g64, _ = local_run(model, inputs, targets, loss, torch.float64)
    except Exception:  # noqa: BLE001  (a kernel without float64 here, torch._grouped_mm's: float32 is the key)
        g64 = None
    state = {n: t.detach().clone() for n, t in state_of(model).items()}  # parameters, buffers, tensor attributes
    outcomes = []
    for numcheck, option in zip(numchecks, options):
        for n, t in state.items():  # the state the answer keys started from (the last call wrote its buffers)
            set_state(model, n, t)
        outcomes.append(_sent(client, case, (model, inputs, targets, loss), numcheck, option, (g32, g64, buffers)))
        outcomes[-1] = outcomes[-1]._replace(seconds=time.perf_counter() - started)
        started = time.perf_counter()
    return outcomes


def _sent(client, case: Case, built: tuple, numcheck: str, option: str, keys: tuple) -> Outcome:
    model, inputs, targets, loss = built
    g32, g64, buffers = keys
    try:
        # seed 0: the job's random draws (a hashing attention's, where dropout is off) are the local forward's
        result = client.gradients(model, inputs, targets, loss=loss, numcheck=numcheck, seed=0, timeout=900)
    except Exception as exc:  # noqa: BLE001  (what the service or the SDK answered: the run's subject)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        cause = ("500 " if status is not None and status >= 500 and status != 503 else "") + cause_of(exc)
        return Outcome(case.zoo, case.name, option, False, cause,
                       detail="".join(traceback.format_exception_only(exc))[:600])
    wrong = compare(result, g32, g64, buffers, model)
    note = "" if g64 is not None else "answer key float32 (no float64 run locally)"
    if not wrong and numcheck == "auto" and result.numcheck.passed is False:
        wrong = f"numcheck failed a right gradient ({_failed_part(result.numcheck)})"
    if not wrong and numcheck == "auto" and (result.numcheck.reason or "").startswith("not run: the numerical check"):
        # the check crashed inside: the job answered, unchecked (passed null), but the crash is a bug to count
        said = result.numcheck.reason.split("inside (", 1)[-1].rsplit("), so nothing", 1)[0]
        wrong = "numcheck could not run: " + _without_names(said)
    return Outcome(case.zoo, case.name, option, not wrong, wrong, detail=note)


def _failed_part(check) -> str:
    """Which part of the check failed: the finite differences (a tensor's, or a direction's) or the returned
    gradients' comparison with float64 (a tensor's error against its tolerance)."""
    for name, p in (check.per_parameter or {}).items():
        if p.returned_judged == "failed":
            return f"returned {name}: {p.returned_max_rel_error:.3g} over {p.returned_tolerance:.3g}"
        if p.judged == "failed":
            return f"differences {name}: {p.max_rel_error:.3g}"
    return f"{check.mode} differences: {check.max_rel_error:.3g}"


# ---- the run -----------------------------------------------------------------------------------------------------
def report(outcomes: list[Outcome]) -> str:
    lines = []
    by_zoo = collections.defaultdict(list)
    for o in outcomes:
        by_zoo[o.zoo].append(o)
    lines.append(f"{'zoo':<16} {'options':<13} {'passed':>7} {'of':>4} {'rate':>7}  {'not built':>9}")
    for zoo, items in by_zoo.items():
        for options in ("default", "numcheck_off"):
            mine = [o for o in items if o.options == options]
            built = [o for o in mine if not o.cause.startswith(("not built", "not run locally"))]  # the library's own
            if not mine:
                continue
            passed = sum(o.passed for o in built)
            rate = 100.0 * passed / len(built) if built else float("nan")
            lines.append(f"{zoo:<16} {options:<13} {passed:>7} {len(built):>4} {rate:>6.1f}%  {len(mine) - len(built):>9}")
    causes = collections.defaultdict(list)
    for o in outcomes:
        if not o.passed:
            causes[(o.zoo, o.cause)].append(f"{o.name} ({o.options})")
    if causes:
        lines.append("\nfailures by cause:")
        for (zoo, cause), names in sorted(causes.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
            lines.append(f"  [{zoo}] {cause} x{len(names)}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    return "\n".join(lines)


def second_step(client, case: Case, repeats: int = 5) -> tuple[float, float]:
    """(service s, local s): the median of `repeats` timed steps of this model after an untimed first, through the
    SDK (numcheck off, no memory accounting: the capture reused, the unchanged weights by reference, the batch
    sent) and locally (forward, loss, backward on this interpreter's torch)."""
    model, inputs, targets, loss = case.build()

    def local() -> None:
        model.zero_grad(set_to_none=True)
        _loss_of(_call(model, inputs), targets, loss).backward()

    local_s, service_s = [], []
    for i in range(repeats + 1):
        started = time.perf_counter()
        local()
        local_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        client.gradients(model, inputs, targets, loss=loss, numcheck="off", memory=False, timeout=900)
        service_s.append(time.perf_counter() - started)
    return statistics.median(service_s[1:]), statistics.median(local_s[1:])


def _second_steps(client, selected: list[Case]) -> None:
    ratios = collections.defaultdict(list)
    for case in selected:
        try:
            service_s, local_s = second_step(client, case)
        except Exception as exc:  # noqa: BLE001  (a model the run fails or does not build: timed in the run itself)
            print(f"skip {case.zoo}/{case.name}: {cause_of(exc)}", flush=True)
            continue
        ratios[case.zoo].append(service_s / local_s)
        print(f"{case.zoo}/{case.name}: service {service_s * 1e3:.0f} ms, local {local_s * 1e3:.0f} ms, "
              f"{service_s / local_s:.2f}x", flush=True)
    every = [r for rs in ratios.values() for r in rs]
    for zoo, rs in ratios.items():
        print(f"{zoo:<16} {len(rs):>3} models, median second step {statistics.median(rs):.2f}x local")
    if every:
        print(f"{'all':<16} {len(every):>3} models, median second step {statistics.median(every):.2f}x local")


_RUN_SETTINGS = {"GRADSVC_JOB_TIMEOUT_S": "600", "GRADSVC_MAX_WAIT_S": "600",
                 # each model is sent twice, then never again: nothing is worth keeping longer (results, pieces,
                 # resident models), and what is kept adds up over hundreds of models on one host
                 "GRADSVC_RESULT_TTL_S": "120", "GRADSVC_TENSOR_TTL_S": "300", "GRADSVC_TENSOR_CACHE_BYTES": str(256 << 20),
                 "GRADSVC_RESIDENT_MODEL_BYTES": str(512 << 20)}
# Several models at once: one torch thread a process, or idle OpenMP threads spin on the cores the others need
_SHARING = {"OMP_NUM_THREADS": "1"}


def run_each(client, selected: list[Case], numchecks: list[str]) -> list[Outcome]:
    """Every selected model with each option set, one after another, each printed as it ends."""
    outcomes = []
    for case in selected:
        for o in run_options(client, case, numchecks):
            outcomes.append(o)
            print(f"{'ok  ' if o.passed else 'FAIL'} {case.zoo}/{case.name} [{o.options}] {o.seconds:.1f}s "
                  f"{o.cause}", flush=True)
    return outcomes


def run_parts(argv: list[str], url: str, api_key: str | None, jobs: int) -> list[Outcome]:
    """The selection in `jobs` interleaved parts, each run by a process of this script on the same stack (one
    model's local runs and recording overlap another's job). Processes, not threads: torch.export and the recording
    patch torch's global state, and a thread's capture took in another thread's ops."""
    with tempfile.TemporaryDirectory() as tmp:
        parts = [Path(tmp) / f"part{k}.json" for k in range(jobs)]
        env = {**os.environ, **_SHARING, "GRADSVC_API_KEY": api_key or ""}  # one torch thread, as the workers (main)
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--url", url, "--part", f"{k}/{jobs}",
                                   "--jobs", "1", "--json", str(part)], env=env) for k, part in enumerate(parts)]
        try:
            for k, (proc, part) in enumerate(zip(procs, parts)):
                if proc.wait() != 0 or not part.exists():  # never a report that silently lacks a part's models
                    raise SystemExit(f"part {k}/{jobs} ended with exit code {proc.returncode} and no outcomes: "
                                     "its models are not in the report (its output above says why)")
        finally:  # stopped early (a failed part, SIGTERM, Ctrl-C): the other parts with it
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
        return [Outcome(**o) for part in parts for o in json.loads(part.read_text())]


def _selected(args: argparse.Namespace) -> list[Case]:
    chosen = []
    only = set(filter(None, args.only.split(",")))
    for zoo in args.zoo.split(","):
        cases = [c for c in cases_of(zoo) if args.match in c.name and (not only or f"{zoo}/{c.name}" in only)]
        if not cases:
            print(f"{zoo}: not installed here (or nothing matched); skipped", flush=True)
        if args.sample and len(cases) > args.sample:
            cases = cases[::math.ceil(len(cases) / args.sample)]
        chosen += cases[:args.limit] if args.limit else cases
    if args.part:  # "k/n": every n-th model from the k-th (run_parts)
        k, n = (int(v) for v in args.part.split("/"))
        chosen = chosen[k::n]
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default=",".join(ZOOS), help="comma-separated: " + ", ".join(ZOOS))
    ap.add_argument("--limit", type=int, default=0, help="at most this many models a zoo (0: all)")
    ap.add_argument("--match", default="", help="only models whose name contains this")
    ap.add_argument("--only", default="", help="only these models, comma-separated zoo/name (a run's failures)")
    ap.add_argument("--sample", type=int, default=0, help="about this many models a zoo, spread evenly (0: all)")
    ap.add_argument("--second-step", action="store_true", help="time each model's second step against its local step")
    ap.add_argument("--url", default="", help="a running stack; else one is started")
    ap.add_argument("--server-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--options", default="default,numcheck_off")
    ap.add_argument("--json", default="", help="write every outcome here")
    ap.add_argument("--jobs", type=int, default=2, help="models in flight at once, each in a process of its own "
                    "with a worker of its own: one model's local runs and recording overlap another's job")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)  # "k/n": run_parts' k-th process
    args = ap.parse_args(argv)

    from tests.support.stack import start_stack  # the same real stack the tests use

    # SIGTERM (a timeout, a CI runner) unwinds as Ctrl-C does: the `finally` below stops the stack it started (its
    # redis-server, API and workers), which a plain SIGTERM would leave running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    stack = None
    jobs = 1 if args.second_step else args.jobs
    if args.url:
        from gradclient import Client
        client = Client(args.url, timeout=900)
    else:
        python = args.server_python if Path(args.server_python).exists() else sys.executable
        # handoff: large bodies and results pass through files as `gradsvc up` (one host) configures it
        stack = start_stack(workers=jobs, python=python, handoff=True, **_RUN_SETTINGS,
                            **(_SHARING if jobs > 1 else {}))
        client = stack.sdk_client(timeout=900)
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    try:
        if args.second_step:
            _second_steps(client, _selected(args))
            return 0
        numchecks = [{"default": "auto", "numcheck_off": "off"}[o] for o in args.options.split(",")]
        if jobs > 1:
            outcomes = run_parts(sys.argv[1:] if argv is None else argv, str(client.base_url), stack.api_key if
                                 stack is not None else os.environ.get("GRADSVC_API_KEY"), jobs)
        else:
            outcomes = run_each(client, _selected(args), numchecks)
    finally:
        client.close()
        if stack is not None:
            stack.stop()
    if args.part:
        Path(args.json).write_text(json.dumps([o._asdict() for o in outcomes]))
        return 0
    print(f"\n{len(outcomes)} runs in {time.perf_counter() - started:.0f} s on torch {torch.__version__}")
    print(report(outcomes))
    if args.json:
        Path(args.json).write_text(json.dumps([o._asdict() for o in outcomes], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
