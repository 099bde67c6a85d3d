"""Gathered parameters gathered again for the backward pass
(sbpjax.compiler.regather): the step's values do not change, the plan's bytes
(regathers included) equal the compiled program's, the compiled program runs
the extra all-gathers, and XLA's temp memory is lower than when every gathered
copy is held (``regather=False``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler.lower import _after

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


def test_off_by_default():
    f = sj.jit(STEP, placement=PL, in_sbp=((S(0),), (S(0),)), out_sbp=((B,), (S(0),)))
    e = f.explain(WEIGHTS, X)
    assert not any(b.regather for b in e.boxings) and e.propagation.regathered is None
    assert e.bytes == fsdp(False).explain(WEIGHTS, X).bytes


def test_regather_must_be_a_bool():
    with pytest.raises(sj.SBPError, match="regather must be True or False"):
        sj.jit(STEP, placement=PL, regather="yes")
