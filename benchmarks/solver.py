"""Solver benchmark: the IOPDDL contest instances, and sj.jit-like training steps.

    python benchmarks/solver.py            # the four instances with their time limits (~8 min)
    python benchmarks/solver.py --quick    # instance G only, smaller training steps (< 2 min)

* instances: ``python -m sbpjax.solver FILE --time-limit T`` in a subprocess, as the
  contest ran its entries (the time includes starting Python and reading the file). The
  answer is priced here with ``Problem.evaluate``; ``ratio`` is its cost over the best
  cost any team submitted (the contest ran on an 8-core workstation; this machine's
  cores are listed under ``machine``). Target: feasible, within the limit, ratio <= 1.05.
* synthetic: ``sbpjax.solver.synthetic.train_step`` graphs (forward, mirrored backward,
  optimizer; some with weights shared by 4 layers, some with a usage limit 1.15x the
  least possible peak), solved in library mode (default effort): nodes, seconds, work
  (table entries, the machine-independent measure), and the proven gap
  ``(cost - lower_bound) / cost``.
Writes ``benchmarks/results/solver.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

import numpy as np

from sbpjax.solver import load_problem, solve
from sbpjax.solver.synthetic import train_step

# The contest's time limits and the best cost any team submitted (final evaluation).
CONTEST = {
    "A": (60, 6548641531),
    "G": (120, 217039),
    "M": (180, 49928460991),
    "S": (240, 1534613444),
}


def run_instance(name: str) -> dict:
    limit, best = CONTEST[name]
    path = os.path.join(HERE, "iopddl", f"asplos-2025-iopddl-{name}.json.gz")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "sbpjax.solver", path, "--time-limit", str(limit)],
        env=env,
        capture_output=True,
        text=True,
        timeout=limit + 120,
    )
    seconds = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"instance {name}: the solver failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"instance {name}: {len(lines)} lines of output"
    strategies = json.loads(lines[0])
    cost, feasible, peak = load_problem(path).evaluate(strategies)
    return {
        "name": name,
        "cost": int(cost) if np.isfinite(cost) else None,
        "best_submitted_cost": best,
        "ratio": cost / best,
        "feasible": feasible,
        "seconds": round(seconds, 2),
        "time_limit": limit,
        "within_limit": seconds <= limit,
    }


def run_synthetic(layers: int, shared: int, memory: float | None) -> dict:
    p = train_step(layers, strategies=30, shared=shared, memory=memory, seed=layers)
    began = time.perf_counter()
    sol = solve(p)
    seconds = time.perf_counter() - began
    return {
        "layers": layers,
        "shared": shared,
        "memory": memory,
        "nodes": p.num_nodes,
        "edges": len(p.edges),
        "model_nodes": sol.stats["model_nodes"],
        "seconds": round(seconds, 3),
        "work": sol.stats["work"],
        "exact": sol.stats["exact"],
        "feasible": sol.feasible,
        "cost": sol.cost,
        "lower_bound": sol.lower_bound,
        "proven_gap": sol.gap,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "solver.json"))
    args = ap.parse_args()
    names = ["G"] if args.quick else ["A", "G", "M", "S"]
    sizes = [10, 50] if args.quick else [10, 100, 400]
    instances = []
    for name in names:
        row = run_instance(name)
        instances.append(row)
        print(
            f"{name}: cost {row['cost']:,} best submitted {row['best_submitted_cost']:,} ratio {row['ratio']:.4f} "
            f"feasible {row['feasible']} {row['seconds']:.1f} s of {row['time_limit']} s",
            flush=True,
        )
    synthetic = []
    for layers in sizes:
        for shared, memory in ((1, None), (4, None), (1, 1.15)):
            row = run_synthetic(layers, shared, memory)
            synthetic.append(row)
            print(
                f"train step {layers} layers shared {shared} memory {memory}: {row['nodes']} nodes, "
                f"{row['seconds']:.2f} s, work {row['work']:.3g}, gap {row['proven_gap']:.4f}",
                flush=True,
            )
    out = {
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count()},
        "instances": instances,
        "synthetic": synthetic,
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    print("\n| instance | cost | best submitted | ratio | feasible | seconds | limit |")
    print("|---|---|---|---|---|---|---|")
    for r in instances:
        print(
            f"| {r['name']} | {r['cost']:,} | {r['best_submitted_cost']:,} | {r['ratio']:.4f} | {r['feasible']} "
            f"| {r['seconds']:.1f} | {r['time_limit']} |"
        )
    print("\n| train step | nodes | seconds | work | exact | proven gap |")
    print("|---|---|---|---|---|---|")
    for r in synthetic:
        label = f"{r['layers']} layers" + (f", shared {r['shared']}" if r["shared"] > 1 else "")
        label += f", memory {r['memory']}" if r["memory"] else ""
        print(
            f"| {label} | {r['nodes']:,} | {r['seconds']:.2f} | {r['work']:.3g} | {r['exact']} "
            f"| {r['proven_gap']:.4f} |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
