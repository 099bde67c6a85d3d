"""A loop whose carry starts as zeros (an RNN's ``h0 = jnp.zeros``): its first
iteration may box the carry by making zeros afresh (free), later iterations
must gather the real carry. Iterations that box alike but run other steps are
not one loop body: each case equals the single-device program, forward and
gradient, on the layouts that once gave a wrong loss and zero gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import sbpjax as sj
from sbpjax import B, S

T, N, D = 6, 4, 8


def rnn_loss(cell, h0, unroll=1, final_state=False):
    def loss(w, xs):
        def body(h, x):
            h = cell(h @ w + x)
            return h, h.sum()

        h, ys = jax.lax.scan(body, h0((N, D)), xs, unroll=unroll)  # made in the program, known zeros
        return jnp.sum(h**2) if final_state else jnp.sum(ys)

    return loss


CELLS = {"tanh": jnp.tanh, "2tanh": lambda z: 2 * jnp.tanh(z)}
LAYOUTS = [
    ((8,), (B, S(1))),
    ((8,), (B, S(2))),
    ((8,), (B, S(0))),
    ((2, 4), ((B, B), (S(1), S(2)))),
]


def data():
    r = np.random.default_rng(11)
    return (0.3 * r.normal(size=(D, D))).astype(np.float32), r.normal(size=(T, N, D)).astype(np.float32)


def check(loss, pl, in_sbp, w, xs):
    """The loss and its gradient, each as its own program (as a user writes
    them: the layouts chosen differ from one program of both)."""
    for fn in (loss, jax.grad(loss)):
        got = sj.jit(fn, placement=pl, in_sbp=in_sbp)(w, xs).numpy()
        want = np.asarray(jax.jit(fn)(w, xs))
        assert_close(got, want, rtol=1e-5)
        assert np.abs(want).max() > 1.0  # zeros would not pass


@pytest.mark.parametrize("shape,in_sbp", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("h0", ["zeros", "ones"])
def test_rnn_with_a_constant_first_carry_equals_one_device(shape, in_sbp, cell, h0):
    w, xs = data()
    loss = rnn_loss(CELLS[cell], jnp.zeros if h0 == "zeros" else jnp.ones)
    pl = sj.placement(shape, ("x", "y")[: len(shape)])
    check(loss, pl, in_sbp, w, xs)


@pytest.mark.parametrize("unroll,final_state", [(2, False), (1, True), (3, True)])
def test_unrolled_and_final_state_rnns_with_zero_carries(unroll, final_state):
    w, xs = data()
    loss = rnn_loss(CELLS["2tanh"], jnp.zeros, unroll, final_state)
    for shape, in_sbp in (((8,), (B, S(1))), ((2, 4), ((B, B), (S(1), S(2))))):
        pl = sj.placement(shape, ("x", "y")[: len(shape)])
        check(loss, pl, in_sbp, w, xs)
