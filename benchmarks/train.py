"""Training benchmark: a GPT train step with sbpjax against GSPMD, and ZeRO's memory.

    python benchmarks/train.py            # default sizes (a few minutes on 8 CPU devices)
    python benchmarks/train.py --quick    # small sizes, same fields, under two minutes

(1) The GPT of ``examples/gpt_hybrid.py`` on a 2x4 (data x tensor) placement
with its Megatron annotations; one AdamW step compiled by ``sbpjax.flax`` and
by GSPMD: ``jax.jit`` of the same functional step given the NamedShardings the
annotations stand for (what ``nnx.with_partitioning`` would attach) for the
parameters, the optimizer state (same as its parameter) and the batch. Bytes
per step are read from each compiled program (``sj.collectives``); the time
ratio is the median of repeats in this process. Both runs are checked against
the single-device step.

(2) ZeRO against plain data parallelism on 8 devices: parameter and optimizer
state bytes the most loaded device holds, measured from the local arrays.

Writes ``benchmarks/results/train.json``.
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
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from compiler import collective_bytes, median_times, spec_of  # noqa: E402
from flax import nnx  # noqa: E402
from gpt_hybrid import BATCH_SBP, HYBRID_RULES, build, loss_fn  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.flax as sjf  # noqa: E402
from sbpjax.compiler.api import is_nd_sbp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# one tick per stage (GPT checked with SGD, GPT with AdamW, timing, ZeRO's two trainers);
# a bar on a terminal, nothing in a log (tqdm's disable=None)
STAGES = 5
progress = tqdm(total=STAGES, desc="train benchmark", unit="stage", disable=True)


def _is_gt(v):
    return isinstance(v, sj.GlobalTensor)


def functional_step(graphdef, template, optimizer):
    """The train step on a pure dict of parameters, for jax.jit and the reference."""

    def step(params, opt_state, batch):
        def objective(p):
            state = jax.tree.map(lambda v: v, template)
            nnx.replace_by_pure_dict(state, p)
            return loss_fn(nnx.merge(graphdef, state), batch)

        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def gpt_vs_gspmd(cfg, repeats, rng, min_seconds):
    vocab, seq, d, heads, layers, batch = cfg
    pl = sj.placement((2, 4), ("x", "y"))
    optimizer = optax.adamw(1e-3, weight_decay=0.01)  # what is measured
    tokens = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    batch_ = (tokens, labels)

    # The values are checked with SGD: Adam divides each gradient by its own
    # size, so a gradient that is zero in exact arithmetic (the key bias: a
    # softmax ignores shifts) becomes +-lr from rounding noise in any program.
    checked = {}
    for name, opt in [("check", optax.sgd(0.1)), ("adamw", optimizer)]:
        checked[name] = run_both(cfg, pl, opt, batch_)
        progress.update(1)
        if name == "check":
            ref_params, ref_loss = reference_step(cfg, opt, batch_)
            for who in ("sbpjax", "gspmd"):
                params, loss = checked[name][who + "_result"]
                np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, err_msg=who)
                for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
                    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-4, atol=1e-6, err_msg=who)
    r = checked["adamw"]
    np.testing.assert_allclose(r["sbpjax_result"][1], r["gspmd_result"][1], rtol=2e-5)
    t_sj, t_g = median_times(
        [(r["sbpjax_program"], r["sbpjax_args"]), (r["gspmd_program"], r["gspmd_args"])],
        repeats,
        min_seconds,
    )
    progress.update(1)
    return {
        "sbpjax_bytes": r["sbpjax_bytes"],
        "sbpjax_explained_bytes": r["sbpjax_explained_bytes"],
        "gspmd_bytes": r["gspmd_bytes"],
        "time_ratio_vs_gspmd": t_sj / t_g,
        "sbpjax_ms": t_sj * 1e3,
        "gspmd_ms": t_g * 1e3,
        "plan_summary": r["plan_summary"],
    }


def reference_step(cfg, optimizer, batch_):
    vocab, seq, d, heads, layers, _ = cfg
    graphdef, state = nnx.split(build(vocab, seq, d, heads, layers))
    params = nnx.to_pure_dict(state)
    new_params, _, loss = jax.jit(functional_step(graphdef, state, optimizer))(
        params, optimizer.init(params), batch_
    )
    return new_params, float(loss)


def run_both(cfg, pl, optimizer, batch_):
    """One step by sbpjax and by GSPMD: compiled programs, their bytes and results."""
    vocab, seq, d, heads, layers, _ = cfg
    out = {}
    model = build(vocab, seq, d, heads, layers)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    step = functional_step(graphdef, state, optimizer)

    sjf.annotate(model, HYBRID_RULES)
    # no donation: the program is timed on the same arguments again and again (and GSPMD's does not donate)
    trainer = sjf.Trainer(model, optimizer, loss_fn, pl, batch_sbp=BATCH_SBP, donate=False)
    ts = trainer.train_step
    gbatch = (
        tuple(sj.to_global(v, pl, BATCH_SBP) for v in batch_),
        trainer.state,
    )  # the batch and the model's state
    out["sbpjax_bytes"] = collective_bytes(ts.lower(trainer.params, trainer.opt_state, gbatch).compile())
    explanation = ts.explain(trainer.params, trainer.opt_state, gbatch)
    out["sbpjax_explained_bytes"], out["plan_summary"] = explanation.bytes, explanation.summary()
    leaves = jax.tree.leaves((trainer.params, trainer.opt_state, gbatch), is_leaf=_is_gt)
    tree = jax.tree_util.tree_structure(((trainer.params, trainer.opt_state, gbatch), {}), is_leaf=_is_gt)
    out["sbpjax_program"] = ts._fn._compile(leaves, tree)[1]  # the jitted shard_map on local arrays
    out["sbpjax_args"] = [t.physical for t in leaves]
    new_params, _, loss, _ = ts(trainer.params, trainer.opt_state, gbatch)
    out["sbpjax_result"] = (
        jax.tree.map(lambda t: t.numpy(), new_params, is_leaf=_is_gt),
        float(loss.numpy()),
    )

    # GSPMD with the same layouts as NamedShardings
    shard = lambda nd, leaf: NamedSharding(pl.mesh, spec_of(nd, np.ndim(leaf), pl))  # noqa: E731
    p_sh = jax.tree.map(shard, ts.stored_sbp, params, is_leaf=is_nd_sbp)
    opt_state = optimizer.init(params)
    o_sh = jax.tree.map(shard, ts.opt_sbp, opt_state, is_leaf=is_nd_sbp)
    b_sh = tuple(shard(BATCH_SBP, v) for v in batch_)
    replicated = NamedSharding(pl.mesh, spec_of((sj.B, sj.B), 0, pl))
    gspmd = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh), out_shardings=(p_sh, o_sh, replicated))
    g_args = (jax.device_put(params, p_sh), jax.device_put(opt_state, o_sh), jax.device_put(batch_, b_sh))
    out["gspmd_bytes"] = collective_bytes(gspmd.lower(*g_args).compile())
    g_params, _, g_loss = gspmd(*g_args)
    out["gspmd_result"] = (jax.tree.map(np.asarray, g_params), float(g_loss))
    out["gspmd_program"], out["gspmd_args"] = gspmd, g_args
    return out


def zero_vs_dp(cfg, rng):
    vocab, seq, d, heads, layers, batch = cfg
    pl = sj.placement(8, "x")
    tokens = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    out, losses = {}, {}
    for name, zero in [("dp", False), ("zero", True)]:
        trainer = sjf.Trainer(
            build(vocab, seq, d, heads, layers),
            optax.adamw(1e-3),
            loss_fn,
            pl,
            batch_sbp=(sj.S(0),),
            zero=zero,
        )
        losses[name] = [trainer.step((tokens, labels)) for _ in range(2)]
        per = trainer.state_bytes_per_device()
        out[f"{name}_state_bytes_per_device"] = per["params"] + per["opt_state"]
        out[f"{name}_detail"] = per
        out[f"{name}_step_bytes"] = collective_bytes(
            trainer.lower(tuple(sj.to_global(v, pl, (sj.S(0),)) for v in (tokens, labels))).compile()
        )
        progress.update(1)
    np.testing.assert_allclose(losses["zero"], losses["dp"], rtol=1e-5)  # same training, less memory
    out["zero_over_dp"] = out["zero_state_bytes_per_device"] / out["dp_state_bytes_per_device"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=2.0,
        help="the least time the timing rounds take (default %(default)s s); 0: --repeats rounds "
        "only (the tests' run, which reads no times)",
    )
    ap.add_argument("--output", default=os.path.join(HERE, "results", "train.json"))
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 10)
    # vocab, seq, d_model, heads, layers, batch
    cfg = (96, 32, 64, 4, 2, 16) if args.quick else (256, 128, 256, 8, 4, 32)
    rng = np.random.default_rng(0)
    global progress
    progress = tqdm(total=STAGES, desc="train benchmark", unit="stage", disable=None)
    result = {"config": dict(zip(["vocab", "seq", "d_model", "heads", "layers", "batch"], cfg))}
    result.update(gpt_vs_gspmd(cfg, repeats, rng, args.min_seconds))
    result.update(zero_vs_dp(cfg, rng))
    progress.close()
    print(result.pop("plan_summary"))
    print(
        f"GPT step on 2x4: sbpjax {result['sbpjax_bytes']} B (plan {result['sbpjax_explained_bytes']} B), "
        f"GSPMD {result['gspmd_bytes']} B; time sbpjax/GSPMD {result['time_ratio_vs_gspmd']:.2f}"
    )
    print(
        f"state per device on 8: ZeRO {result['zero_state_bytes_per_device']} B, data parallel "
        f"{result['dp_state_bytes_per_device']} B (ratio {result['zero_over_dp']:.4f}, 1/8 = 0.125)"
    )
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
