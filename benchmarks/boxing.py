"""Boxing benchmark: sbpjax plans against GSPMD on every 1-D and 2-D pair.

    python benchmarks/boxing.py            # 4096x4096 float32 (several minutes)
    python benchmarks/boxing.py --quick    # 128x128, same fields, under two minutes

For every pair over {S(0), S(1), B, P, P(max), P(min)} on 8 devices and every
pair over {S(0), S(1), B, P}^2 on a 2x4 placement it records: the plan's bytes,
the bytes measured in the compiled sbpjax program (``sj.collectives``), the
bytes GSPMD uses for the same conversion (``jax.jit`` with in/out
``NamedSharding``; P(sum) as an ``unreduced`` axis on an Explicit mesh;
P(max|min) is not expressible), the floor (pairs without partials) and the
time ratio sbpjax / GSPMD (median of repeats, both timed in the same process).

GSPMD baselines may abort the process or give wrong values (see "How sbpjax is
measured" in docs/comparison.md), so cases run in worker subprocesses that are restarted after a
crash, and every GSPMD result is checked against the logical value. Writes
``benchmarks/results/boxing.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "boxing.json")
NAMES_1D = ["S(0)", "S(1)", "B", "P", "P(max)", "P(min)"]
NAMES_2D = ["S(0)", "S(1)", "B", "P"]


def all_cases():
    cases = [("8", (a,), (b,)) for a, b in itertools.product(NAMES_1D, NAMES_1D)]
    nd = list(itertools.product(NAMES_2D, repeat=2))
    cases += [("2x4", a, b) for a, b in itertools.product(nd, nd)]
    return cases


# ---------------------------------------------------------------------------
# Worker: runs cases in a process of its own
# ---------------------------------------------------------------------------


def worker(args):
    from _devices import xla_flags_with_devices

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(8)  # its cases are on 8 devices
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    sys.path.insert(0, os.path.dirname(HERE))
    import sbpjax as sj
    from sbpjax.boxing.lower import boxing_fn

    cases = json.load(open(args.cases))
    n = args.size
    shape = (n, n)
    x = np.random.default_rng(0).integers(-8, 8, size=shape).astype(np.float32)
    placements = {"8": sj.placement(8, "x"), "2x4": sj.placement((2, 4), ("x", "y"))}
    explicit = {
        key: jax.sharding.Mesh(pl.devices, pl.axis_names, axis_types=(AxisType.Explicit,) * pl.ndim)
        for key, pl in placements.items()
    }

    def median_time(fn, arg, repeats):
        jax.block_until_ready(fn(arg))
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def gspmd_spec(sbp, axis_names):
        dims = [[] for _ in shape]
        unreduced = set()
        for a, s in enumerate(sbp):
            if isinstance(s, sj.Split):
                dims[s.dim].append(axis_names[a])
            elif isinstance(s, sj.Partial):
                if s.op != "sum":
                    return None  # P(max|min): GSPMD has no such layout
                unreduced.add(axis_names[a])
        parts = [None if not d else (d[0] if len(d) == 1 else tuple(d)) for d in dims]
        return parts, frozenset(unreduced)

    def sharding(mesh, spec):
        parts, unreduced = spec
        return NamedSharding(mesh, PartitionSpec(*parts, unreduced=unreduced))

    def gspmd_input(t, mesh, spec):
        """The same global tensor as a GSPMD array (partial terms as unreduced)."""
        parts, unreduced = spec
        if not unreduced:
            return jax.device_put(t.numpy(), sharding(mesh, spec))
        # one stacked dim of partial terms, contracted away: GSPMD marks the result unreduced
        names = tuple(mesh.axis_names[a] for a, _ in t.layout.partial)
        terms = np.asarray(t.physical).reshape((-1,) + shape)
        stacked = jax.device_put(terms, NamedSharding(mesh, PartitionSpec(names, *parts)))
        ones = jax.device_put(np.ones(len(terms), np.float32), NamedSharding(mesh, PartitionSpec(names)))
        mk = jax.jit(lambda s, o: jnp.einsum("k,kij->ij", o, s, out_sharding=sharding(mesh, spec)))
        return mk(stacked, ones)

    out = open(args.out, "a")
    no_gspmd = {int(i) for i in args.no_gspmd.split(",") if i}
    for index in range(args.start, len(cases)):
        key, src_t, dst_t = cases[index]
        pl = placements[key]
        src, dst = sj.parse_sbp(", ".join(src_t)), sj.parse_sbp(", ".join(dst_t))
        plan = sj.plan_boxing(shape, np.float32, pl, src, dst)
        t = sj.to_global(x, pl, src)
        row = {
            "placement": key,
            "src": sj.format_sbp(src),
            "dst": sj.format_sbp(dst),
            "plan_bytes": plan.bytes,
            "floor": plan.floor,
            "steps": [s.label() for s in plan.steps],
            "measured_bytes": 0,
            "gspmd_bytes": None,
            "gspmd_status": "not expressible",
            "time_ratio_vs_gspmd": None,
            "sbpjax_s": None,
            "gspmd_s": None,
        }
        # the executable read for its collectives is the one timed
        if plan.steps:
            fn = boxing_fn(plan).lower(t.physical).compile()
            row["measured_bytes"] = sum(c.bytes for c in sj.collectives(fn))
            row["sbpjax_s"] = median_time(fn, t.physical, args.repeats)
        mesh = explicit[key]
        s_spec, d_spec = gspmd_spec(src, pl.axis_names), gspmd_spec(dst, pl.axis_names)
        if s_spec is not None and d_spec is not None and index not in no_gspmd:
            # Mark the case as started: if GSPMD aborts the process, the parent knows which.
            print(json.dumps({"started": index}), file=out, flush=True)
            try:
                a = gspmd_input(t, mesh, s_spec)
                conv = jax.jit(lambda v: v, out_shardings=sharding(mesh, d_spec)).lower(a).compile()
                row["gspmd_bytes"] = sum(c.bytes for c in sj.collectives(conv))
                got = conv(a)
                if d_spec[1]:
                    got = jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, PartitionSpec()))(got)
                ok = np.array_equal(np.asarray(got), x)
                row["gspmd_status"] = "ok" if ok else "wrong values"
                if plan.steps and ok:
                    row["gspmd_s"] = median_time(conv, a, args.repeats)
                    row["time_ratio_vs_gspmd"] = row["sbpjax_s"] / row["gspmd_s"]
            except Exception as e:  # noqa: BLE001 - a baseline that raises is recorded, not fatal
                row["gspmd_bytes"] = None
                row["gspmd_status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(json.dumps({"index": index, "row": row}), file=out, flush=True)


# ---------------------------------------------------------------------------
# Parent: runs workers, restarts them after crashes, summarises
# ---------------------------------------------------------------------------


def _rows_written(out_file: str) -> int:
    try:
        with open(out_file) as f:  # a restarted worker may write a case again: count each once
            return len({json.loads(line)["index"] for line in f if '"row"' in line})
    except FileNotFoundError:
        return 0


def _run_worker(cmd, out_file: str, err_file: str, bar) -> subprocess.CompletedProcess:
    """Run one worker to its end, moving the progress bar as its rows arrive."""
    with open(err_file, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        while proc.poll() is None:
            time.sleep(0.5)
            bar.update(max(_rows_written(out_file) - bar.n, 0))
    bar.update(max(_rows_written(out_file) - bar.n, 0))
    with open(err_file) as err:
        return subprocess.CompletedProcess(cmd, proc.returncode, None, err.read())


def run_cases(args):
    cases = all_cases()
    rows: dict = {}
    # a bar on a terminal, nothing in a log (tqdm's disable=None); rows count across worker restarts
    bar = tqdm(total=len(cases), desc="boxing cases", unit="case", disable=None)
    with bar, tempfile.TemporaryDirectory() as tmp:
        cases_file = os.path.join(tmp, "cases.json")
        json.dump(cases, open(cases_file, "w"))
        out_file = os.path.join(tmp, "rows.jsonl")
        # A case whose GSPMD conversion aborts the process (a failed check in XLA) is run
        # again without GSPMD by the next worker, which goes on from there: one restart per
        # aborting case (jax 0.12 aborts on 18 of the 292).
        start, skip_gspmd = 0, set()
        while True:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--cases",
                cases_file,
                "--out",
                out_file,
                "--start",
                str(start),
                "--size",
                str(args.size),
                "--repeats",
                str(args.repeats),
                "--no-gspmd",
                ",".join(map(str, sorted(skip_gspmd))),
            ]
            proc = _run_worker(cmd, out_file, os.path.join(tmp, "stderr.txt"), bar)
            started = None
            for line in open(out_file):
                rec = json.loads(line)
                if "row" in rec:
                    rows[rec["index"]] = rec["row"]
                    started = None
                else:
                    started = rec["started"]
            if proc.returncode == 0:
                break
            crashed = started if started is not None else (max(rows) + 1 if rows else 0)
            last = (proc.stderr or "").strip().splitlines()[-1:]
            if crashed in skip_gspmd:
                raise SystemExit(f"case {crashed} ({cases[crashed]}) stops the worker without GSPMD: {last}")
            print(f"  worker stopped at case {crashed} ({cases[crashed]}): {last}; restarting", flush=True)
            skip_gspmd.add(crashed)
            start = crashed
        for index in skip_gspmd:
            rows[index]["gspmd_status"] = "aborted the process"
    return [rows[i] for i in range(len(cases))]


def summarize(rows, size):
    T = size * size * 4
    one = [r for r in rows if r["placement"] == "8"]
    two = [r for r in rows if r["placement"] == "2x4"]
    expressible = [r for r in two if r["gspmd_bytes"] is not None]
    no_partial = [r for r in two if r["floor"] is not None]
    ratios = [r["time_ratio_vs_gspmd"] for r in rows if r["time_ratio_vs_gspmd"] is not None]
    worse = [
        r
        for r in rows
        if r["gspmd_bytes"] is not None and r["gspmd_status"] == "ok" and r["plan_bytes"] > r["gspmd_bytes"]
    ]
    return {
        "tensor_bytes": T,
        "cases": len(rows),
        "measured_equals_plan": sum(r["measured_bytes"] == r["plan_bytes"] for r in rows),
        "one_d_pairs": len(one),
        "two_d_pairs": len(two),
        "two_d_plan_T": sum(r["plan_bytes"] for r in two) / T,
        "two_d_gspmd_T_over_expressible": sum(r["gspmd_bytes"] for r in expressible) / T,
        "two_d_plan_T_over_gspmd_expressible": sum(r["plan_bytes"] for r in expressible) / T,
        "gspmd_expressible_pairs": len(expressible),
        "gspmd_wrong_value_pairs": [
            f"{r['placement']} {r['src']}->{r['dst']}" for r in rows if r["gspmd_status"] == "wrong values"
        ],
        "gspmd_aborted_pairs": [
            f"{r['placement']} {r['src']}->{r['dst']}"
            for r in rows
            if r["gspmd_status"] == "aborted the process"
        ],
        "gspmd_error_pairs": [
            f"{r['placement']} {r['src']}->{r['dst']}: {r['gspmd_status']}"
            for r in rows
            if r["gspmd_status"].startswith("error")
        ],
        "pairs_where_sbpjax_moves_more_than_gspmd": [
            f"{r['placement']} {r['src']}->{r['dst']}" for r in worse
        ],
        "no_partial_pairs": len(no_partial),
        "no_partial_floor_T": sum(r["floor"] for r in no_partial) / T,
        "no_partial_plan_T": sum(r["plan_bytes"] for r in no_partial) / T,
        "no_partial_gspmd_T": sum(r["gspmd_bytes"] for r in no_partial if r["gspmd_bytes"] is not None) / T,
        "no_partial_pairs_at_floor": sum(r["plan_bytes"] == r["floor"] for r in no_partial),
        "median_time_ratio_vs_gspmd": statistics.median(ratios) if ratios else None,
        "timed_pairs": len(ratios),
    }


def print_table(rows, size):
    T = size * size * 4
    print(
        f"{'placement':<9} {'src':<14} {'dst':<14} {'plan|T|':>8} {'meas|T|':>8} {'gspmd|T|':>9} "
        f"{'floor|T|':>9} {'t/gspmd':>8}  steps"
    )
    for r in rows:
        g = "-" if r["gspmd_bytes"] is None else f"{r['gspmd_bytes'] / T:.4g}"
        if r["gspmd_status"] not in ("ok", "not expressible"):
            g += "!"
        f = "-" if r["floor"] is None else f"{r['floor'] / T:.4g}"
        tr = "-" if r["time_ratio_vs_gspmd"] is None else f"{r['time_ratio_vs_gspmd']:.2f}"
        print(
            f"{r['placement']:<9} {r['src']:<14} {r['dst']:<14} {r['plan_bytes'] / T:>8.4g} "
            f"{r['measured_bytes'] / T:>8.4g} {g:>9} {f:>9} {tr:>8}  {', '.join(r['steps'])}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128x128, 2 repeats")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output", default=RESULTS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-gspmd", default="", help=argparse.SUPPRESS)  # case indices, comma-separated
    args = ap.parse_args()
    args.size = args.size or (128 if args.quick else 4096)
    args.repeats = args.repeats or (2 if args.quick else 5)
    if args.worker:
        worker(args)
        return
    t0 = time.time()
    rows = run_cases(args)
    print_table(rows, args.size)
    summary = summarize(rows, args.size)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    print("\nsummary:")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(
            {
                "config": {
                    "shape": [args.size, args.size],
                    "dtype": "float32",
                    "repeats": args.repeats,
                    "devices": 8,
                    "quick": args.quick,
                },
                "summary": summary,
                "cases": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
