"""options.curvature across shards: what each job of a sharded request computes, and how the reduce job
combines their parts into the answer one job would give for the same seed.

The batch's matrix is a weighted sum of the shards' (M = sum_k s_k M_k, s_k = n_k / n under a `mean` loss,
1 under a `sum`), so the Hutchinson trace spreads over the row shards exactly: each shard returns z_p^T M_k z_p
for the same seeded probes z_p, and sample p of the batch is sum_k s_k z_p^T M_k z_p. Lanczos does not split so:
each step's vector is the previous product of the whole M, which would take a round trip through every shard
per step. The top eigenvalues and the density's Lanczos runs therefore run in jobs of their own over the whole
batch ("Lanczos jobs", after the row shards): the top in the first, the density's probes split into contiguous
ranges over up to `shards` of them (probe p is drawn from the seed and p alone, `first_probe`), and with the
density the trace comes from those runs, as in one job.
"""

from __future__ import annotations

import msgspec

from gradsvc.wire import Curvature, CurvatureOptions, Density, Options

from .curvature import DEFAULT_PROBES, trace_estimate


def lanczos_ranges(c: CurvatureOptions | None, count: int) -> list[list[int]]:
    """The Lanczos jobs' density probe ranges [a, b) (offsets from c.first_probe), one per job: up to `count`
    jobs when the density is asked, one (the top eigenvalues', [0, 0)) when only the top is, none otherwise."""
    if c is None or not (c.top or c.density):
        return []
    if not c.density:
        return [[0, 0]]
    jobs = min(count, c.probes)
    size, extra = divmod(c.probes, jobs)
    ranges, a = [], 0
    for j in range(jobs):
        b = a + size + (1 if j < extra else 0)
        ranges.append([a, b])
        a = b
    return ranges


def row_curvature(c: CurvatureOptions | None) -> CurvatureOptions | None:
    """What each row shard computes: the trace's per-probe samples over its rows, unless the density's
    Lanczos runs give the trace (as in one job)."""
    if c is None or not c.trace or c.density:
        return None
    return CurvatureOptions(matrix=c.matrix, top=0, trace=True, probes=c.probes, seed=c.seed,
                            first_probe=c.first_probe)


def lanczos_options(opts: Options, ranges: list[list[int]]) -> list[Options]:
    """Each Lanczos job's options: the request's model options over the whole batch, its curvature part, and
    nothing else the row shards already compute (no check, no per-loss or per-example outputs)."""
    c = opts.curvature
    out = []
    for j, (a, b) in enumerate(ranges):
        part = msgspec.structs.replace(
            c, top=c.top if j == 0 else 0, eigenvectors=c.eigenvectors and j == 0, density=c.density,
            trace=c.trace and c.density, probes=(b - a) if c.density else c.probes, first_probe=c.first_probe + a)
        out.append(msgspec.structs.replace(
            opts, shards=1, curvature=part, numcheck="off", timing_repeat=1, input_grad=False, hvp=None,
            per_loss=False, per_sample="off", outputs=False, graph=False))
    return out


def combine(c: CurvatureOptions, shares: list[float], rows: list[Curvature | None], jobs: list[Curvature],
            ranges: list[list[int]]) -> Curvature:
    """The batch's curvature from the row shards' parts (`shares`: each shard's weight in the batch's loss)
    and the Lanczos jobs' (in job order, with their probe `ranges`)."""
    result = Curvature(matrix=c.matrix)
    if c.top:
        top = jobs[0]
        result.top_eigenvalues, result.residuals, result.eigenvectors = \
            top.top_eigenvalues, top.residuals, top.eigenvectors
    samples: list[float] = []
    if c.density:
        nodes, weights = [], []
        for job, (a, b) in zip(jobs, ranges):
            scale = (b - a) / c.probes  # a job's weights are divided by its own probe count
            nodes += job.density.eigenvalues
            weights += [w * scale for w in job.density.weights]
            samples += job.trace_samples or []
        result.density = Density(eigenvalues=nodes, weights=weights)
    elif c.trace:
        per_shard = [r.trace_samples for r in rows]
        samples = [sum(s * part[p] for s, part in zip(shares, per_shard)) for p in range(len(per_shard[0]))]
    if c.trace:
        result.trace, result.trace_stderr = trace_estimate(samples)
        result.trace_samples = samples
    trace_products = (c.probes or DEFAULT_PROBES) if c.trace and not c.density else 0
    result.products = sum(job.products for job in jobs) + trace_products
    return result
