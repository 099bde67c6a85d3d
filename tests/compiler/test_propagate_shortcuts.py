"""The propagator's shortcuts never change a choice.

``Propagator._free_signature`` picks an op's signature without ranking or
costing when one must win, and ``plan.bytes_lower_bound`` skips candidates
without a search. Both only save time: with the free-signature shortcut off
and the bound replaced by 0 (every candidate searched exactly) the decisions
must be the same, op by op, on whole training steps.
"""

import numpy as np
from models import adamw, block_loss, block_params, mlp_loss, mlp_params, state_sbp, train_step

import sbpjax as sj
from sbpjax.boxing import plan as planner
from sbpjax.compiler import propagator as prop

S0, S1, B = sj.S(0), sj.S(1), sj.B


def decisions(f, *args):
    planner.clear_caches()
    e = f.explain(*args)
    return (
        [(name, ins, outs) for name, _, ins, outs in e.ops],
        [(b.where, b.src, b.dst, b.bytes) for b in e.boxings],
    )


def programs(pl8, pl24):
    r = np.random.default_rng(0)
    opt = adamw()
    mp = mlp_params()
    x, y = r.normal(size=(8, 16)).astype(np.float32), r.normal(size=(8, 16)).astype(np.float32)
    yield (
        "mlp 2x4 Megatron",
        sj.jit(
            train_step(mlp_loss, opt),
            placement=pl24,
            in_sbp=(
                {"w1": (B, S1), "w2": (B, S0)},
                state_sbp(opt.init(mp), {"w1": (B, S1), "w2": (B, S0)}, (B, B)),
                (S0, B),
                (S0, B),
            ),
        ),
        (mp, opt.init(mp), x, y),
    )
    bp = block_params()
    tokens = r.integers(0, 32, size=(8, 8)).astype(np.int32)
    labels = r.integers(0, 32, size=(8, 8)).astype(np.int32)
    for name, pl, ps, data in [
        ("block data", pl8, {k: (B,) for k in bp}, (S0,)),
        (
            "block tensor",
            pl8,
            {
                **{k: (B,) for k in bp},
                "wq": (S1,),
                "wk": (S1,),
                "wv": (S1,),
                "wo": (S0,),
                "w1": (S1,),
                "w2": (S0,),
                "head": (S1,),
            },
            (B,),
        ),
    ]:
        ss = state_sbp(opt.init(bp), ps, (B,))
        yield (
            name,
            sj.jit(
                train_step(block_loss, opt), placement=pl, in_sbp=(ps, ss, data, data), out_sbp=(ps, ss, (B,))
            ),
            (bp, opt.init(bp), tokens, labels),
        )


def test_shortcuts_change_no_decision(pl8, pl24, monkeypatch):
    fast = {name: decisions(f, *args) for name, f, args in programs(pl8, pl24)}
    monkeypatch.setattr(prop.Propagator, "_free_signature", lambda self, node, cur, sigs: None)
    monkeypatch.setattr(prop, "bytes_lower_bound", lambda *a, **k: 0)
    slow = {name: decisions(f, *args) for name, f, args in programs(pl8, pl24)}
    for name in fast:
        assert fast[name] == slow[name], name
