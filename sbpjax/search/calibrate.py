"""Measuring what the pipeline search prices: compute speed, the cost of one
pipeline action, and transfers between stages.

    pl = sj.placement(8, "x")
    cost_model = ss.calibrate_transfer(sj.calibrate(pl), pl)     # collectives, then stage-to-stage moves
    compute = ss.calibrate_compute(pl)
    plan = ss.search_pipeline(chain, ss.Grid.from_placement(pl, cost_model=cost_model), compute=compute, ...)

Every figure is the median of timed runs after a warm-up: a wall-clock measure
of these devices as they are loaded now (by definition; the search itself
then depends on nothing but these numbers).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from sbpjax.boxing.cost import CostModel
from sbpjax.search.pipeline_cost import ComputeModel


def _median_time(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _ready(t):
    return t.to_jax()


def calibrate_compute(placement=None, n: int = 512, repeats: int = 9) -> ComputeModel:
    """``flops_per_s``: a jitted chain of ``n x n`` matmuls on every device of the
    placement at once (default: all devices), per device; ``action_s``: one call of a small :func:`sbpjax.jit` program
    on global tensors (what every forward and backward action is), plus the
    actor runtime's own time per action (an empty step's)."""
    import jax
    import jax.numpy as jnp

    import sbpjax.pipeline as sjp
    from sbpjax.compiler.api import jit
    from sbpjax.placement import Placement
    from sbpjax.sbp import Broadcast
    from sbpjax.tensor import to_global

    devices = list(placement.devices.flat) if placement is not None else jax.devices()
    reps = 8
    # every device multiplies at once, as a pipeline's stages do: devices that share
    # hardware (CPU devices on a few cores) then show the speed each really gets
    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    a = jax.device_put(
        jnp.ones((len(devices), n, n), jnp.float32) / n,
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")),
    )
    matmuls = jax.jit(lambda x: [x := x @ x for _ in range(reps)][-1])
    flops = 2.0 * n**3 * reps / _median_time(lambda: matmuls(a), repeats)  # ~2 GFLOP each: dispatch is noise

    pl = Placement(np.asarray(devices[:2], dtype=object), ("x",))
    rep = (Broadcast(),)
    program = jit(lambda w, x: jnp.tanh(x @ w), placement=pl, in_sbp=(rep, rep), out_sbp=rep)
    w, x = (to_global(np.ones(shape, np.float32), pl, rep) for shape in ((8, 8), (4, 8)))
    call = _median_time(lambda: _ready(program(w, x)), repeats)

    graph = sjp.build_graph(sjp.OneFOneB(), 2, 4)
    bodies: dict = {spec.name: (lambda k, inputs: {}) for spec in graph.actors}
    t0 = time.perf_counter()
    for _ in range(repeats):
        sjp.ThreadedSystem(graph, bodies).run()
    runtime = (time.perf_counter() - t0) / repeats / sum(spec.actions for spec in graph.actors)
    return ComputeModel(flops_per_s=flops, action_s=call + runtime)


def calibrate_transfer(
    cost_model: CostModel, placement, sizes=(1 << 10, 1 << 16, 1 << 20), repeats: int = 7
) -> CostModel:
    """``cost_model`` with ``transfer_alpha`` and ``transfer_beta`` fitted (least
    squares, clipped at 0) to the time of moving a replicated float32 tensor
    from the first half of ``placement``'s devices to the other half (what a
    pipeline does between stages; each receiving device gets all of it)."""
    from sbpjax.placement import Placement
    from sbpjax.sbp import Broadcast
    from sbpjax.tensor import to_global

    devices = list(placement.devices.flat)
    half = max(1, len(devices) // 2)
    src = Placement(np.asarray(devices[:half], dtype=object), ("x",))
    dst = Placement(np.asarray(devices[half : 2 * half], dtype=object), ("x",))
    rep = (Broadcast(),)
    rows, times = [], []
    for nbytes in sizes:
        t = to_global(np.ones(max(1, nbytes // 4), np.float32), src, rep)
        times.append(_median_time(lambda t=t: _ready(t.to_global(sbp=rep, placement=dst)), repeats))
        rows.append([1.0, 4.0 * max(1, nbytes // 4)])
    (alpha, beta), *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(times), rcond=None)
    return dataclasses.replace(
        cost_model, transfer_alpha=max(float(alpha), 0.0), transfer_beta=max(float(beta), 0.0)
    )
