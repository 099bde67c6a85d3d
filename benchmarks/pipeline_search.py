"""Pipeline search benchmark: the joint search against exhaustive search, measured.

    python benchmarks/pipeline_search.py            # three cases (a few minutes on 8 CPU devices)
    python benchmarks/pipeline_search.py --quick    # two cases, same fields
    python benchmarks/pipeline_search.py --smoke    # the tests' run: a 4-layer MLP, a small space

For every case the search (``ss.search_pipeline`` with its defaults) and the
exhaustive search of the same space with the same prices (every configuration,
every cut simulated) each pick a configuration. On the small cases both are
built (``plan.build``) and run on the 8 CPU devices, seen as 2 nodes of 4
with each axis whole (``Grid(..., refine=False)``: a layer's devices along an
axis take one role, which keeps the stage programs quick to compile): ``measured_step_s`` is
the searched plan's step, ``brute_force_step_s`` the exhaustive plan's (the
median of timed steps after a warm-up one; when both pick the same
configuration it is measured once and the two fields are equal). The cost
model is calibrated here first (``sj.calibrate``: alpha, beta of the devices'
collectives; ``ss.calibrate_transfer``: of a move between stages;
``ss.calibrate_compute``: flops per second and the cost of one pipeline
action). The large case is priced only (64 layers of a GPT on 64
devices that need not exist: ``ss.Grid(64)``), where exhaustive search is out
of reach: ``search_s`` is its figure.

``search_s`` is the search's own time on the layers' profiles (``profile_s``:
XLA's flop counts and the matmuls of the layers, measured once for both).

Cases: ``mlp_uneven``: 8 dense layers of uneven widths, 512 rows per step
(``--quick``: 128), 8 MB per device;
``nanogpt``: the NNX GPT of examples/auto_pipeline.py (embedding, 4 blocks,
head), 16 sequences of 16 tokens, 2 MB per device; ``gpt_64x64``:
``ss.gpt_profiles(64, d_model=4096, heads=32, seq=2048, vocab=50304)``, batch
512 sequences, 80 GB per device, 100 TFLOP/s devices.

Writes ``benchmarks/results/pipeline_search.json`` with the list ``search``:
``name, predicted_step_s, measured_step_s, brute_force_step_s, search_s,
layers, devices`` and, for reading them, the exhaustive plan's prediction and
time, both configurations and whether they are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _devices.py, also when imported
from _devices import simulate_devices  # noqa: E402

simulate_devices(8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from auto_pipeline import NanoGPT, batch, cross_entropy  # noqa: E402
from flax import nnx  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.pipeline as sjp  # noqa: E402
import sbpjax.search as ss  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTHS = [64, 256, 64, 512, 128, 64, 384, 128, 64]


def dense(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def mlp_case(rows: int, widths=WIDTHS):
    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in zip(widths, widths[1:])
    ]
    chain = sjp.LayerChain.from_functions(
        [dense] * len(params), params, np.zeros((rows, widths[0]), np.float32)
    )

    def data(seed):
        r = np.random.default_rng(seed)
        return (
            r.normal(size=(rows, widths[0])).astype(np.float32),
            r.normal(size=(rows, widths[-1])).astype(np.float32),
        )

    return chain, mse, data


def gpt_case(rows: int, seq: int = 16):
    model = NanoGPT(4, 32, 4, seq, nnx.Rngs(0))
    chain = sjp.LayerChain.from_model(model, batch(rows, seq, 0)[0])
    return chain, cross_entropy, lambda seed: batch(rows, seq, seed)


def describe(plan) -> dict:
    return {
        "groups": plan.groups,
        "stage_shape": list(plan.stage_shape),
        "schedule": getattr(plan.schedule, "name", repr(plan.schedule)),
        "microbatches": plan.microbatches,
        "remat": plan.remat,
        "layers_per_stage": [b - a for a, b in plan.bounds],
        "layouts": None
        if plan.layouts is None
        else sorted({lp.choice.label(plan.layouts.grid) for lp in plan.layouts.layers}),
        "memory_per_device": plan.peak_memory,
    }


def measure(plans: list, chain, loss, data, steps: int, placement) -> list[float]:
    """Median step time of each plan's pipeline, the plans taking turns step by
    step (the same load on the machine for each); the first step of each compiles."""
    pipes = [plan.build(chain, loss, optax.adam(1e-3), placement=placement) for plan in plans]
    for pipe in pipes:
        pipe.step(*data(0))
    times: list[list[float]] = [[] for _ in pipes]
    for step in range(steps):
        x, y = data(step + 1)
        for i, pipe in enumerate(pipes):
            t0 = time.perf_counter()
            pipe.step(x, y)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measured_case(name, chain, loss, data, rows, budget, grid, compute, steps, placement, space=None) -> dict:
    t0 = time.perf_counter()
    profiles = ss.profile(chain)  # XLA's flop counts and the matmuls: once, for both searches
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    space = space or {}
    plan = ss.search_pipeline(profiles, grid, batch=rows, memory=budget, compute=compute, **space)
    search_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    brute = ss.search_pipeline(
        profiles, grid, batch=rows, memory=budget, compute=compute, method="exhaustive", **space
    )
    brute_s = time.perf_counter() - t0
    same = plan.key() == brute.key()
    times = measure([plan] if same else [plan, brute], chain, loss, data, steps, placement)
    row = {
        "name": name,
        "predicted_step_s": plan.step_s,
        "measured_step_s": times[0],
        "brute_force_step_s": times[-1],
        "search_s": search_s,
        "layers": len(chain),
        "devices": grid.size,
        "profile_s": profile_s,
        "brute_force_predicted_step_s": brute.step_s,
        "brute_force_search_s": brute_s,
        "brute_force_simulations": brute.simulations,
        "simulations": plan.simulations,
        "proven": plan.proven,
        "same_configuration": same,
        "configuration": describe(plan),
        "brute_force_configuration": describe(brute),
        "memory_budget": budget,
    }
    # nothing beats exhaustive search on the same prices, and the search finds its optimum
    # unless it ran out of simulations somewhere (plan.proven)
    assert brute.step_s <= plan.step_s * (1 + 1e-12), row
    assert not plan.proven or plan.step_s <= brute.step_s * (1 + 1e-12), row
    return row


def priced_case(space=None) -> dict:
    profiles = ss.gpt_profiles(64, d_model=4096, heads=32, seq=2048, vocab=50304, examples=1)
    grid = ss.Grid(64, "x")  # the default alpha-beta model: 10 us, 10 GB/s
    compute = ss.ComputeModel(flops_per_s=1e14, action_s=2e-5)
    t0 = time.perf_counter()
    plan = ss.search_pipeline(profiles, grid, batch=512, memory=80e9, compute=compute, **(space or {}))
    return {
        "name": "gpt_64x64",
        "predicted_step_s": plan.step_s,
        "measured_step_s": None,
        "brute_force_step_s": None,
        "search_s": time.perf_counter() - t0,
        "layers": len(profiles),
        "devices": grid.size,
        "simulations": plan.simulations,
        "configurations": plan.configurations,
        "configuration": describe(plan),
        "memory_budget": 80e9,
    }


def run(quick: bool, smoke: bool = False) -> dict:
    """Calibrate, search and measure every case; the JSON record (``search``:
    the rows). ``benchmarks/pipeline.py`` calls this for its ``search`` list.
    ``smoke`` (the tests' setting): a 4-layer MLP over a small space (GPipe and
    1F1B, 1 or 2 microbatches), one timed step: the same fields in seconds."""
    quick = quick or smoke
    steps = 1 if smoke else 3 if quick else 8
    pl = sj.placement((2, 4), ("node", "gpu"))
    t0 = time.perf_counter()
    cost_model = sj.calibrate(pl, sizes=(1 << 12, 1 << 16, 1 << 20), repeats=3 if quick else 5)
    cost_model = ss.calibrate_transfer(cost_model, pl)
    compute = ss.calibrate_compute(pl)
    grid = ss.Grid.from_placement(pl, cost_model=cost_model, refine=False)
    print(
        f"calibrated in {time.perf_counter() - t0:.1f}s: alpha {cost_model.axis_alpha('gpu'):.2e} s, beta "
        f"{cost_model.axis_beta('gpu'):.2e} s/byte, {compute.flops_per_s / 1e9:.1f} GFLOP/s, "
        f"{compute.action_s * 1e6:.0f} us per action, transfers {cost_model.transfer_alpha:.2e} s + "
        f"{cost_model.transfer_beta:.2e} s/byte"
    )
    rows = 64 if smoke else 128 if quick else 512
    cases = [("mlp_uneven", *mlp_case(rows, WIDTHS[:5] if smoke else WIDTHS), rows, 8e6)]
    space = {"microbatches": [1, 2], "schedules": ["gpipe", "1f1b"]} if smoke else None
    if not quick:
        cases.append(("nanogpt", *gpt_case(16), 16, 2e6))
    results = [
        measured_case(name, chain, loss, data, examples, budget, grid, compute, steps, pl, space)
        for name, chain, loss, data, examples, budget in cases
    ]
    results.append(priced_case(space))
    header = (
        "case",
        "layers",
        "devices",
        "predicted",
        "measured",
        "brute force",
        "ratio",
        "search s",
        "same",
    )
    print(" ".join(f"{h:>12}" for h in header))
    for r in results:
        ratio = r["measured_step_s"] / r["brute_force_step_s"] if r["measured_step_s"] else None
        cells = (
            r["name"],
            r["layers"],
            r["devices"],
            f"{r['predicted_step_s'] * 1e3:.3g} ms",
            "-" if r["measured_step_s"] is None else f"{r['measured_step_s'] * 1e3:.3g} ms",
            "-" if r["brute_force_step_s"] is None else f"{r['brute_force_step_s'] * 1e3:.3g} ms",
            "-" if ratio is None else f"{ratio:.3f}",
            f"{r['search_s']:.2f}",
            r.get("same_configuration", "-"),
        )
        print(" ".join(f"{str(c):>12}" for c in cells))
    return {
        "search": results,
        "cost_model": {
            "alpha": {a: cost_model.axis_alpha(a) for a in pl.axis_names},
            "beta": {a: cost_model.axis_beta(a) for a in pl.axis_names},
            "flops_per_s": compute.flops_per_s,
            "action_s": compute.action_s,
            "transfer_alpha": cost_model.transfer_alpha,
            "transfer_beta": cost_model.transfer_beta,
        },
        "quick": quick,
        "jax": jax.__version__,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tests' setting: one small case, a small space")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "pipeline_search.json"))
    args = ap.parse_args()
    result = run(args.quick, args.smoke)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
