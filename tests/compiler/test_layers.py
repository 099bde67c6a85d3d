"""Repeated layers: alike ops may share one choice.

An L-layer model written as a loop falls into one class per op of a layer
(``layer_classes``). By default every op decides on its own; with
``CompileOptions(tie_layers=True)`` the ops of a class share one decision (a
smaller problem, in a smaller space). Checked against one device (values),
the compiled program (plan bytes) and GSPMD (bytes)."""

import collections
import functools

import jax
import numpy as np
import pytest
from conftest import gspmd_bytes
from models import adamw, check_train, gpt_loss, gpt_params, gpt_sbp, state_sbp, train_step

import sbpjax as sj
from sbpjax.compiler.arguments import leaf_name, leaf_paths
from sbpjax.compiler.classes import arg_class, layer_classes
from sbpjax.compiler.pricing import price
from sbpjax.compiler.trace import trace

S0, B = sj.S(0), sj.B


def _gpt(layers, d=32, vocab=48, batch=8, seq=8, seed=0):
    params = gpt_params(d, layers, vocab, seed=seed)
    r = np.random.default_rng(seed + 1)
    tokens = r.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = r.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    return params, tokens, labels


def test_the_ops_of_alike_layers_fall_into_shared_classes():
    """In a 4-layer GPT step, the middle layers' ops repeat: most classes have
    one op per layer (or per layer and pass), and no class mixes ops of
    different primitives or shapes."""
    params, tokens, labels = _gpt(4)
    loss = functools.partial(gpt_loss, heads=4)
    args = (params, tokens, labels)
    leaves, tree = jax.tree_util.tree_flatten((args, {}))
    avals = [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for v in leaves]
    program = trace(jax.grad(loss), avals, tree)
    names = [leaf_name(p) for p in leaf_paths(tree)]
    classes = layer_classes(program, names)
    members = collections.defaultdict(list)
    for node, c in zip(program.nodes, classes):
        members[c].append(node)
    repeated = [ns for ns in members.values() if len(ns) > 1]
    assert sum(len(ns) for ns in repeated) > len(program.nodes) / 2
    for ns in repeated:
        assert len({(n.name, tuple(tuple(a.shape) for a in n.ins)) for n in ns}) == 1
    # the first layer reads the embedding: its first ops are classes of their own
    assert len(members) < len(program.nodes)
    assert arg_class("args[0]['blocks'][3]['wq']") == "args[*]['blocks'][*]['wq']"


def test_a_four_layer_gpt_moves_less_than_gspmd_and_greedy(pl24):
    """A 4-layer Megatron GPT step on 2x4 (AdamW): exact against one device,
    plan bytes equal the compiled program's, no more than GSPMD's with the
    same annotations, and no costlier than greedy's plan by the solver's
    objective; the solve proves its plan optimal."""
    params, tokens, labels = _gpt(4)
    loss = functools.partial(gpt_loss, heads=4)
    psbp = gpt_sbp(params, "megatron", 2)
    f, e = check_train(loss, params, tokens, labels, pl24, psbp, (S0, B), (S0, B), steps=2)
    choice = e.propagation.choice
    assert not choice.shared and choice.gap is not None and choice.gap <= 1e-9, choice
    assert "whole-program choice" in str(e).splitlines()[1]
    opt = adamw()
    state = opt.init(params)
    ssbp = state_sbp(state, psbp, (B, B))
    step = train_step(loss, opt)
    kw = dict(placement=pl24, in_sbp=(psbp, ssbp, (S0, B), (S0, B)), out_sbp=(psbp, ssbp, (B, B)))
    greedy = sj.jit(step, solver="greedy", **kw).explain(params, state, tokens, labels)
    assert price(e.propagation) <= price(greedy.propagation)
    gspmd = gspmd_bytes(
        step, pl24, (psbp, ssbp, (S0, B), (S0, B)), (psbp, ssbp, (B, B)), (params, state, tokens, labels)
    )
    assert e.bytes <= gspmd, (e.bytes, gspmd)


@pytest.mark.slow
def test_tied_layers_share_decisions_in_a_smaller_space(pl24):
    """With tie_layers the alike ops of a 3-layer GPT share decisions: fewer
    decisions, the tied space inside the untied one, so the untied optimum
    (proven) costs no more than the tied plan. The tied problem's shared
    decisions join the layers, which the solver cannot eliminate exactly: it
    reports a proven gap."""
    params, tokens, labels = _gpt(3, d=16, vocab=32)
    loss = functools.partial(gpt_loss, heads=2)
    psbp = gpt_sbp(params, "megatron", 2)
    _, alone = check_train(loss, params, tokens, labels, pl24, psbp, (S0, B), (S0, B), steps=1)
    # a twentieth of the default effort: the tied solve spends all it is given
    tied_options = sj.CompileOptions(tie_layers=True, effort=sj.CompileOptions().effort // 20)
    _, tied = check_train(
        loss, params, tokens, labels, pl24, psbp, (S0, B), (S0, B), steps=1, options=tied_options
    )
    a, t = alone.propagation.choice, tied.propagation.choice
    assert t.shared and not a.shared and "sharing decisions" in str(tied)
    assert t.groups < a.groups, (t.groups, a.groups)
    assert a.gap <= 1e-9 and 0 <= t.gap < 1 and t.bound <= t.objective
    assert t.gap == pytest.approx((t.objective - t.bound) / t.objective, rel=1e-9, abs=1e-12)
    assert price(alone.propagation) <= price(tied.propagation)
