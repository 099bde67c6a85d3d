"""Control-flow benchmark: a cond inside scanned layers runs only the branch taken.

    python benchmarks/control_flow.py            # default sizes (about a minute on 8 CPU devices)
    python benchmarks/control_flow.py --quick    # small sizes, same fields

The program: a LayerDrop / stochastic-depth train step (Fan et al. 2019;
Huang et al. 2016). Megatron MLP blocks stacked under ``jax.lax.scan`` on a
2x4 placement (the batch over ``x``, each block's hidden dim over ``y``),
each layer wrapped in ``jax.lax.cond(keep[i], block, identity)``, with the
mask ``keep`` an input of the step, and an SGD update. One compiled step per
program, run with every layer kept, half of them, and none:

* ``sbpjax``: ``sj.jit`` as it is (each cond a ``lax.switch``,
  ``sbpjax.compiler.switches``);
* ``sbpjax_written_out``: the same with the switches turned off (every
  branch computed and a ``select_n`` picking, as before switches existed);
* ``gspmd``: ``jax.jit`` of the same step with the same layouts as
  ``NamedSharding``s.

Per mask (rows): the median step time of each (calls interleaved, same
process) and the ratios ``time_ratio_vs_gspmd`` and
``time_ratio_vs_written_out``; ``max_error`` (sbpjax against the
single-device step: ``max|got - ref| / max|ref|`` over the new parameters and
the loss). Per program (``programs``): collective bytes of the compiled step
(``sj.collectives``, each branch counted once, as if every branch ran: the
same count for all masks), the plan's bytes (``explain().bytes``),
conditionals and while loops in the compiled HLO.

Writes ``benchmarks/results/control_flow.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _devices.py, also when imported
from _devices import simulate_devices  # noqa: E402

simulate_devices(8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from compiler import collective_bytes, median_times, spec_of  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from models import max_error  # noqa: E402

import sbpjax as sj  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
B, S = sj.B, sj.S
W1_SBP, W2_SBP, X_SBP = (B, S(2)), (B, S(1)), (S(0), B)  # stacked dim whole, Megatron over y
LR = 0.1


def block(h, w1, w2):
    return h + jax.nn.gelu(h @ w1, approximate=True) @ w2


def loss(w1, w2, keep, x, y):
    def layer(h, slices):
        w1_i, w2_i, keep_i = slices
        return jax.lax.cond(keep_i, block, lambda h, *_: h, h, w1_i, w2_i), None

    h, _ = jax.lax.scan(layer, x, (w1, w2, keep))
    return jnp.mean((h - y) ** 2)


def step(w1, w2, keep, x, y):
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, keep, x, y)
    return w1 - LR * g1, w2 - LR * g2, value


def configs(quick):
    if quick:
        return dict(layers=4, d=64, hidden=256, batch=16, repeats=5)
    return dict(layers=8, d=256, hidden=1024, batch=64, repeats=10)


def hlo_stats(compiled) -> dict:
    text = compiled.as_text()
    return {"conditionals": text.count(" conditional("), "while_loops": text.count(" while(")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "control_flow.json"))
    args = ap.parse_args()
    cfg = configs(args.quick)
    L, d, hid, n = cfg["layers"], cfg["d"], cfg["hidden"], cfg["batch"]
    rng = np.random.default_rng(0)
    w1 = (rng.normal(size=(L, d, hid)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.normal(size=(L, hid, d)) / np.sqrt(hid)).astype(np.float32)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.normal(size=(n, d)).astype(np.float32)
    masks = {
        "all_kept": np.ones(L, bool),
        "half_kept": np.arange(L) % 2 == 0,
        "none_kept": np.zeros(L, bool),
    }
    pl = sj.placement((2, 4), ("x", "y"))
    in_sbp = (W1_SBP, W2_SBP, (B, B), X_SBP, X_SBP)
    out_sbp = (W1_SBP, W2_SBP, (B, B))

    is_gt = lambda v: isinstance(v, sj.GlobalTensor)  # noqa: E731

    def global_args(f, keep):
        gts, tree = f._globals((w1, w2, keep, x, y), {})
        return gts, tree

    # the compiled programs, each built once (sj.jit caches per shapes and layouts)
    jitted, programs, runners = {}, {}, {}
    for name, as_switch in (("sbpjax", True), ("sbpjax_written_out", False)):
        options = sj.CompileOptions(switches=as_switch)
        f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp, options=options)
        gts, tree = global_args(f, masks["all_kept"])
        prog = f._compile(gts, tree)[1]
        compiled = f.lower(w1, w2, masks["all_kept"], x, y).compile()
        explained = f.explain(w1, w2, masks["all_kept"], x, y).bytes
        programs[name] = {
            "bytes": collective_bytes(compiled),
            "explained_bytes": explained,
            **hlo_stats(compiled),
        }
        jitted[name], runners[name] = f, prog

    def sharding(nd, ndim):
        return NamedSharding(pl.mesh, spec_of(nd, ndim, pl))

    gspmd = (
        jax.jit(
            step,
            in_shardings=[sharding(nd, k) for nd, k in zip(in_sbp, (3, 3, 1, 2, 2))],
            out_shardings=tuple(sharding(nd, k) for nd, k in zip(out_sbp, (3, 3, 0))),
        )
        .lower(w1, w2, masks["all_kept"], x, y)
        .compile()
    )
    programs["gspmd"] = {"bytes": collective_bytes(gspmd), **hlo_stats(gspmd)}
    runners["gspmd"] = gspmd

    reference = jax.jit(step)
    rows = []
    for mask_name, keep in masks.items():
        ref = [np.asarray(v) for v in reference(w1, w2, keep, x, y)]
        errors = {}
        inputs = {}
        for name, f in jitted.items():
            out = f(w1, w2, keep, x, y)
            errors[name] = max_error(
                jax.tree.leaves(jax.tree.map(lambda t: t.numpy(), out, is_leaf=is_gt)), ref
            )
            inputs[name] = [t.physical for t in global_args(f, keep)[0]]
        g_args = [jax.device_put(a, s) for a, s in zip((w1, w2, keep, x, y), gspmd.input_shardings[0])]
        errors["gspmd"] = max_error([np.asarray(v) for v in gspmd(*g_args)], ref)
        inputs["gspmd"] = g_args
        times = median_times([(runners[k], inputs[k]) for k in runners], cfg["repeats"])
        t = dict(zip(runners, times))
        row = {
            "mask": mask_name,
            "layers_kept": int(keep.sum()),
            "layers": L,
            "max_error": errors["sbpjax"],
            "written_out_max_error": errors["sbpjax_written_out"],
            "gspmd_max_error": errors["gspmd"],
            **{f"{k}_step_ms": v * 1e3 for k, v in t.items()},
            "time_ratio_vs_gspmd": t["sbpjax"] / t["gspmd"],
            "time_ratio_vs_written_out": t["sbpjax"] / t["sbpjax_written_out"],
        }
        rows.append(row)
        print(
            f"{mask_name:10s} kept {row['layers_kept']}/{L}: sbpjax {t['sbpjax'] * 1e3:7.2f} ms, "
            f"written out {t['sbpjax_written_out'] * 1e3:7.2f} ms, GSPMD {t['gspmd'] * 1e3:7.2f} ms "
            f"(x{row['time_ratio_vs_written_out']:.2f} of written out, x{row['time_ratio_vs_gspmd']:.2f} of GSPMD), "
            f"max error {row['max_error']:.1e}"
        )
    for name, p in programs.items():
        print(f"{name:20s} {p}")

    # what the benchmark claims, checked on every run
    assert programs["sbpjax"]["bytes"] == programs["sbpjax"]["explained_bytes"]
    assert programs["sbpjax_written_out"]["bytes"] == programs["sbpjax_written_out"]["explained_bytes"]
    assert programs["sbpjax"]["bytes"] <= programs["gspmd"]["bytes"]
    assert programs["sbpjax"]["conditionals"] >= 2 and programs["sbpjax_written_out"]["conditionals"] == 0
    assert all(max(r["max_error"], r["written_out_max_error"], r["gspmd_max_error"]) < 1e-4 for r in rows)

    out = {"config": {**cfg, "quick": args.quick, "placement": "2x4"}, "programs": programs, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", args.output)


if __name__ == "__main__":
    main()
