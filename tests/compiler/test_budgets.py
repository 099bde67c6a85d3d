"""Memory budgets held to the hand-written layouts a user would try instead.

A GPT train step (AdamW) on 2x4 with its parameters and state ``AUTO`` under
budgets between ZeRO-3's need and data parallel's: each plan fits (XLA's
``memory_analysis()`` of the compiled step) and moves no more than the
cheapest of data parallel, ZeRO-1/2 and ZeRO-3/FSDP that fits the same
budget, each compiled both by sj.jit and by GSPMD given those layouts
(``benchmarks/_budgets.py``, the compiler benchmark's budget section)."""

import os

import jax
import numpy as np
import pytest
from conftest import load_module
from models import adamw, gpt_loss, gpt_params, train_step

import sbpjax as sj
from sbpjax.compiler import hand_layouts
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.choice import Choice
from sbpjax.compiler.liveness import block_bytes
from sbpjax.compiler.propagate import propagate
from sbpjax.compiler.trace import trace

S0, B = sj.S(0), sj.B
HEADS = 4
HERE = os.path.dirname(os.path.abspath(__file__))
# the hand-written layouts, compiled by sj.jit and GSPMD: the compiler benchmark's own
BENCHMARKS = os.path.join(HERE, "..", "..", "benchmarks")
budgets = load_module(os.path.join(BENCHMARKS, "_budgets.py"), "bench_budgets", imports_from=BENCHMARKS)


def _gpt_step():
    params = gpt_params(64, 2, 64)
    opt = adamw()
    r = np.random.default_rng(0)
    tokens = r.integers(0, 64, size=(16, 8)).astype(np.int32)
    labels = r.integers(0, 64, size=(16, 8)).astype(np.int32)
    step = train_step(lambda p, x, y: gpt_loss(p, x, y, HEADS), opt)
    return step, (params, opt.init(params), tokens, labels)


def _program(step, args):
    leaves, tree = jax.tree.flatten((args, {}))
    return trace(step, [jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) for x in leaves], tree)


def _mirrors(args) -> dict:
    """{Adam moment leaf: its parameter's leaf}: the flattened arguments are
    the parameters (n), Adam's count, the first moments (n), the second (n)."""
    n = len(jax.tree.leaves(args[0]))
    return {n + 1 + k: k for k in range(n)} | {2 * n + 1 + k: k for k in range(n)}


@pytest.mark.slow
def test_budgets_between_zero3_and_data_parallel_fit_and_beat_every_hand_layout_that_fits():
    """The compiler benchmark's budget section (its own code) at d_model 64, 2
    layers: not the quick run's d_model 32, where each collective's latency
    outweighs most bytes and GSPMD given ZeRO-1's layouts moves fewer bytes
    than sj.jit plans (see tests/test_examples.py)."""
    section = budgets.budget_section(True, np.random.default_rng(0), gpt_loss, size=(64, 2))
    rows = section["budgets"]
    assert [r["fraction"] for r in rows] == list(budgets.FRACTIONS)
    need = {h["layout"]: h["held_bytes"] for h in rows[0]["by_hand"]}
    assert need["zero-3/fsdp"] < need["zero-1/2"] < need["dp"]
    for r in rows:
        assert need["zero-3/fsdp"] < r["budget_bytes"] < need["dp"], r
        assert r["sbpjax_held_bytes"] <= r["budget_bytes"], r  # XLA's memory_analysis of the step
        # the fewer bytes of sj.jit's and GSPMD's programs of each layout that fits
        fitting = [min(h["sbpjax_bytes"], h["gspmd_bytes"]) for h in r["by_hand"] if h["fits"]]
        assert fitting and r["cheapest_fitting_bytes"] == min(fitting), r
        assert r["sbpjax_bytes"] <= min(fitting), r
        # explain() lists the hand-written layouts the plan was held to: the
        # ZeRO layouts, and the chosen splits with ZeRO over x where they leave x whole
        names = {c[0] for c in r["candidates"]}
        assert names - {"AUTO's splits + zero-1/2 over x", "AUTO's splits + zero-3/fsdp over x"} == {
            "zero-1/2",
            "zero-3/fsdp",
            "zero-1/2 over x",
            "zero-3/fsdp over x",
        }, r


def test_hand_layouts_split_state_for_zero1_and_everything_for_zero3(pl24):
    step, args = _gpt_step()
    program = _program(step, args)
    n_params, mirrors = len(jax.tree.leaves(args[0])), _mirrors(args)
    in_sbp = [AUTO] * (len(program.inputs) - 2) + [(S0, B), (S0, B)]
    cands = dict(hand_layouts.candidates(program, in_sbp, pl24.shape, mirrors, pl24.axis_names))
    # split over every axis, and over the batch's axis (x) alone
    assert set(cands) == {"zero-1/2", "zero-3/fsdp", "zero-1/2 over x", "zero-3/fsdp over x"}
    assert all(ins[-2:] == [(S0, B), (S0, B)] for ins in cands.values())  # as annotated

    def per_device(ins):
        return [block_bytes(v.shape, v.dtype, nd, pl24.shape) for v, nd in zip(program.inputs, ins)]

    whole = [int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in program.inputs]
    z1, z3 = per_device(cands["zero-1/2"]), per_device(cands["zero-3/fsdp"])
    x1, x3 = per_device(cands["zero-1/2 over x"]), per_device(cands["zero-3/fsdp over x"])
    for i in range(len(program.inputs) - 2):
        if i == n_params:  # Adam's step count, a scalar, is whole under both
            assert z1[i] == z3[i] == whole[i]
            continue
        assert z3[i] * 8 == whole[i]  # every GPT weight has a dim 8 divides
        assert z1[i] == (z3[i] if i in mirrors else whole[i])  # only the state split
        assert x3[i] * 2 == whole[i]  # over x alone: 2 pieces
        assert x1[i] == (x3[i] if i in mirrors else whole[i])
    # no mirror pairs (nothing is known to be optimizer state): ZeRO-3/FSDP only
    names = [n for n, _ in hand_layouts.candidates(program, in_sbp, pl24.shape, {}, pl24.axis_names)]
    assert names == ["zero-3/fsdp", "zero-3/fsdp over x"]


def test_a_plan_over_the_budget_gives_way_to_a_hand_layout_that_fits(pl24):
    """Where the kept plan does not fit (the solver found none, and greedy's
    data parallel holds too much), the cheapest hand-written layout that
    fits is kept, and explain() says so."""
    step, args = _gpt_step()
    program, mirrors = _program(step, args), _mirrors(args)
    in_sbp = [AUTO] * (len(program.inputs) - 2) + [(S0, B), (S0, B)]

    def greedy_of(ins):
        return propagate(program, pl24, ins, None)

    dp = greedy_of([(B, B) if nd is AUTO else nd for nd in in_sbp])
    dp.choice = Choice("greedy", reason="the solver found no plan")
    budget = (
        sum(block_bytes(v.shape, v.dtype, nd, pl24.shape) for v, nd in zip(program.inputs, dp.in_sbp)) // 2
    )
    kept = hand_layouts.no_worse_than_by_hand(program, dp, False, in_sbp, mirrors, {}, budget, greedy_of)
    assert kept is not None and kept is not dp
    assert kept.choice.method == "hand" and kept.choice.memory_bytes <= budget
    assert "no solved plan fits" in kept.choice.describe()
    # nothing fits a budget of one byte
    dp.choice = Choice("greedy")
    assert hand_layouts.no_worse_than_by_hand(program, dp, False, in_sbp, mirrors, {}, 1, greedy_of) is None


def test_plans_solved_for_one_budget_serve_the_next_and_change_no_plan(pl24, monkeypatch):
    """The plans a budget's choice solves on the way (the plan without the
    budget, each hand-written layout's) do not depend on the budget: the next
    budget's choice reads them back (``sub_plans``) and makes the plan it would
    make from nothing."""
    from test_auto import _mlp_step

    from sbpjax.compiler import sub_plans

    class Counted(dict):
        keys: list = []  # every key stored, in order

        def __setitem__(self, key, value):
            Counted.keys.append(key)
            super().__setitem__(key, value)

    step, params, state, x, y = _mlp_step()
    args = (params, state, x, y)

    def explained(budget):
        f = sj.jit(
            step,
            placement=pl24,
            in_sbp=(AUTO, AUTO, (S0, B), (S0, B)),
            donate_argnums=(0, 1),
            memory_budget=budget,
            plan_cache=False,
        )
        return f.explain(*args)

    def plan_of(e):
        return e.propagation.in_sbp, [(d.in_sbp, d.out_sbp) for d in e.propagation.decisions], e.bytes

    monkeypatch.setattr(sub_plans, "_ENTRIES", type("Kept", (Counted, sub_plans.OrderedDict), {})())
    explained(200_000)
    first = list(Counted.keys)
    assert len(first) >= 2, first  # the plan without the budget, and the hand-written layouts'
    second = explained(64_000)
    # nothing solved again: not even the layouts this budget chose, planned as
    # given (second_looks.as_given), which were among the first budget's
    # candidates (its chosen splits with ZeRO added over x, hand_layouts.on_chosen)
    assert Counted.keys == first
    assert second.choice.source == "solved"
    sub_plans.clear()
    again = explained(64_000)
    # from nothing: plans the first budget solved (and the second read back), each once
    from_nothing = Counted.keys[len(first) :]
    assert from_nothing and len(set(from_nothing)) == len(from_nothing)
    assert set(from_nothing) <= set(first)
    assert plan_of(second) == plan_of(again)
    assert second.choice.candidates == again.choice.candidates
