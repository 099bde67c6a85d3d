"""Gathered parameters gathered again for the backward pass
(sbpjax.compiler.regather): the step's values do not change, the plan's bytes
(regathers included) equal the compiled program's, the compiled program runs
the extra all-gathers, and XLA's temp memory is lower than when every gathered
copy is held (``regather=False``); the default, ``"auto"``, runs the fewest
that bring the estimated peak under the greedy plan's, and only while the plan
moves no more than the greedy pass's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from models import gpt_loss, gpt_params, gpt_sbp, state_sbp
from test_choose import _two_d, assert_step_close, gspmd_jit, mlp_case

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler.lower import _after

AUTO_MARGIN = sj.CompileOptions().regather_margin

RNG = np.random.default_rng(3)
LAYERS, D, H, N = 3, 64, 256, 32
WEIGHTS = [
    ((RNG.normal(size=(D, H)) / 8).astype(np.float32), (RNG.normal(size=(H, D)) / 16).astype(np.float32))
    for _ in range(LAYERS)
]
X = RNG.normal(size=(N, D)).astype(np.float32)


def loss(ws, x):
    y = x
    for w1, w2 in ws:
        y = y + jax.nn.gelu(y @ w1) @ w2
    return jnp.mean(y**2)


STEP = jax.value_and_grad(loss)
IS_GT = lambda v: isinstance(v, sj.GlobalTensor)  # noqa: E731
PL = sj.placement(8, "x")


def fsdp(regather):
    """ZeRO-3 / FSDP: every weight and the batch split over the 8 devices."""
    return sj.jit(STEP, placement=PL, in_sbp=((S(0),), (S(0),)), out_sbp=((B,), (S(0),)), regather=regather)


def compiled_bytes(compiled):
    return sum(c.bytes for c in sj.collectives(compiled))


def all_gathers(compiled):
    return sum(c.count for c in sj.collectives(compiled) if c.op == "all-gather")


def test_regathers_keep_values_and_bytes_and_lower_memory():
    held, again = fsdp(False), fsdp(True)
    e_held, e_again = held.explain(WEIGHTS, X), again.explain(WEIGHTS, X)
    regathers = [b for b in e_again.boxings if b.regather]
    assert regathers and not any(b.regather for b in e_held.boxings)
    # the layouts are the same; the regathers only add their gathers' bytes
    assert e_again.bytes == e_held.bytes + sum(b.bytes for b in regathers)
    assert all(b.plan.steps[0].op == "all_gather" for b in regathers)
    c_held, c_again = held.lower(WEIGHTS, X).compile(), again.lower(WEIGHTS, X).compile()
    assert compiled_bytes(c_held) == e_held.bytes
    assert compiled_bytes(c_again) == e_again.bytes
    assert all_gathers(c_again) == all_gathers(c_held) + len(regathers)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(c_again) < temp(c_held)
    before, after = e_again.propagation.regathered
    assert after < before
    assert "gathered again" in str(e_again) and " again " in str(e_again)

    ref_loss, ref_grads = jax.jit(STEP)(WEIGHTS, X)
    for f in (held, again):
        got_loss, got_grads = f(WEIGHTS, X)
        assert_close(got_loss.numpy(), np.asarray(ref_loss), rtol=1e-5)
        for g, r in zip(jax.tree.leaves(got_grads, is_leaf=IS_GT), jax.tree.leaves(ref_grads)):
            assert_close(g.numpy(), np.asarray(r), rtol=1e-4)


def test_no_regather_inside_a_checkpoint_region():
    """A jax.checkpoint region recomputes its own gathers in the backward pass."""

    def remat_loss(ws, x):
        y = x
        for w1, w2 in ws:
            y = y + jax.checkpoint(lambda y, w1, w2: jax.nn.gelu(y @ w1) @ w2)(y, w1, w2)
        return jnp.mean(y**2)

    f = sj.jit(jax.value_and_grad(remat_loss), placement=PL, in_sbp=((S(0),), (S(0),)), regather=True)
    e = f.explain(WEIGHTS, X)
    assert not any(b.regather for b in e.boxings)
    ref = jax.jit(jax.value_and_grad(remat_loss))(WEIGHTS, X)
    for g, r in zip(jax.tree.leaves(f(WEIGHTS, X), is_leaf=IS_GT), jax.tree.leaves(ref)):
        assert_close(g.numpy(), np.asarray(r), rtol=1e-4)


def test_the_anchor_changes_no_bit():
    """``_after`` adds -0.0 computed at run time: every float, signed zeros,
    infinities and NaN included, comes back bit for bit, whatever the anchor
    holds; integers pass through."""
    xs = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, np.nan, 1e-45], np.float32)
    ints = np.arange(4, dtype=np.int32)
    for anchor in ([np.nan], [-np.inf], [3.0], [0.0], [True], [1 + 2j]):
        got = jax.jit(lambda x, i, a: _after([x, i], (a,)))(xs, ints, jnp.asarray(anchor))
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint32), xs.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(got[1]), ints)


def test_auto_holds_gathered_weights_where_the_peak_is_below_the_greedy_plans():
    """The default, regather="auto", on this FSDP step: the greedy pass
    gathers the weights too and holds more (its estimated peak is over twice
    the chosen plan's), so "auto" holds them; True regathers one."""
    auto = sj.jit(STEP, placement=PL, in_sbp=((S(0),), (S(0),)), out_sbp=((B,), (S(0),)))
    e, e_again = auto.explain(WEIGHTS, X), fsdp(True).explain(WEIGHTS, X)
    assert not any(b.regather for b in e.boxings) and e.propagation.regathered is None
    assert any(b.regather for b in e_again.boxings)
    before, _ = e_again.propagation.regathered
    assert before < (1 - AUTO_MARGIN) * e.choice.greedy_peak
    assert e.bytes == e_again.bytes - sum(b.bytes for b in e_again.boxings if b.regather)


def two_d_mlp_step():
    """A 4-layer MLP (d 64, batch 128, momentum) with 2-D kernels on 4x2: the
    chosen plan all-gathers the kernels over the data axis and, held, its
    estimated peak is above the greedy plan's."""
    pl = sj.placement((4, 2), ("x", "y"))
    step, args, in_sbp, out_sbp = mlp_case(pl, "megatron", 64, 4, optax.sgd(0.1, momentum=0.9), batch=128)
    psbp = _two_d(in_sbp[0])
    ssbp = state_sbp(args[1], psbp, (B, B))
    return pl, step, args, (psbp, ssbp) + in_sbp[2:], (psbp, ssbp, out_sbp[2])


def test_auto_regathers_the_fewest_weights_that_bring_the_peak_under_the_greedy_plans():
    """regather="auto" regathers the largest gathered weights first, only until the
    estimated peak is AUTO_MARGIN below the greedy plan's: fewer regathers
    than True, bytes and XLA's temp memory between holding and regathering
    all, bytes below GSPMD's; values those of the single-device step."""
    pl, step, args, in_sbp, out_sbp = two_d_mlp_step()
    fs = {
        rg: sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp, regather=rg)
        for rg in ("auto", False, True)
    }
    es = {rg: f.explain(*args) for rg, f in fs.items()}
    count = {rg: sum(b.regather for b in e.boxings) for rg, e in es.items()}
    assert 0 < count["auto"] < count[True] and count[False] == 0
    target = (1 - AUTO_MARGIN) * es["auto"].choice.greedy_peak
    before, after = es["auto"].propagation.regathered
    assert after <= target < before
    assert es[True].propagation.regathered[1] < after
    compiled = {rg: f.lower(*args).compile() for rg, f in fs.items()}
    for rg, c in compiled.items():
        assert compiled_bytes(c) == es[rg].bytes
    assert es[False].bytes < es["auto"].bytes < es[True].bytes
    temp = {rg: c.memory_analysis().temp_size_in_bytes for rg, c in compiled.items()}
    assert temp[True] <= temp["auto"] < temp[False]
    want = jax.jit(step)(*args)
    assert_step_close(jax.tree.map(lambda t: t.numpy(), fs["auto"](*args), is_leaf=IS_GT), want, "auto")
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, want)
    assert es["auto"].bytes <= compiled_bytes(g.lower(*g_args).compile())


def test_auto_declines_regathers_that_move_more_than_greedy():
    """A one-layer GPT step, Megatron-annotated on 8 devices with the batch B:
    the whole-program plan moves what the greedy pass's does, and regathering
    its gathered weights would move more than that plan. Asked to bring the
    peak half under the greedy plan's (``regather_margin=0.5``), which needs
    regathers, "auto" runs none, and explain() says what they would have saved
    and cost; True still runs them."""
    params = gpt_params(32, 1, 64)
    tokens = np.random.default_rng(1).integers(0, 64, size=(32, 16)).astype(np.int32)
    psbp = gpt_sbp(params, "megatron", 1)

    def step(p, x, y):
        loss, g = jax.value_and_grad(gpt_loss)(p, x, y, 4)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    kw = dict(placement=PL, in_sbp=(psbp, (B,), (B,)), out_sbp=(psbp, (B,)))
    auto = sj.jit(step, options=sj.CompileOptions(regather_margin=0.5), **kw)
    e = auto.explain(params, tokens, tokens)
    e_forced = sj.jit(step, regather=True, **kw).explain(params, tokens, tokens)
    forced = [b for b in e_forced.boxings if b.regather]
    assert forced and not any(b.regather for b in e.boxings) and e.propagation.regathered is None
    count, before, after, extra, with_them, limit = e.propagation.regather_declined
    assert (count, extra) == (len(forced), sum(b.bytes for b in forced))
    assert (before, after) == e_forced.propagation.regathered
    assert with_them == e.bytes + extra == e_forced.bytes > limit == e.choice.greedy_bytes
    assert "regathers: none" in str(e) and "regather=True" in str(e)
    c = auto.lower(params, tokens, tokens).compile()
    assert compiled_bytes(c) == e.bytes


def test_regather_must_be_a_bool_or_auto():
    for bad in ("yes", 1, None, np.array(True)):
        with pytest.raises(sj.SBPError, match="regather must be True, False or 'auto'"):
            sj.jit(STEP, placement=PL, regather=bad)
