"""Strided slices along a split dim (``x[:, ::2]``, ``x[:, 1::2]``) and
their gradients (pads with interior padding): where every piece is a
multiple of the stride, each device keeps the rows of its own piece and
nothing moves (``sbpjax.rules.shifts._geometry``); elsewhere the value is
boxed first, as before. Values against the one-device program, bytes
against the compiled program's collectives and GSPMD's."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes
from jax import lax

import sbpjax as sj
from sbpjax.rules.shifts import may_shift, strided_in_place

S0, S1, B = sj.S(0), sj.S(1), sj.B


def _run(fn, x, pl, sbp):
    f = sj.jit(fn, placement=pl, in_sbp=(sbp,))
    got = jax.tree.map(lambda t: t.numpy(), f(x), is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
    assert_close(got, jax.jit(fn)(x), rtol=1e-5)
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes
    return moved


def test_a_strided_slice_of_a_split_dim_stays_on_its_devices(pl8):
    """Every start below the stride, strides 2 and 4, 64 rows over 8 (pieces
    of 8): the slice and the gradient of a product of even and odd rows (the
    interleaved halves of a RoPE written with strides) move nothing, as in
    GSPMD's program."""
    x = np.random.default_rng(0).normal(size=(4, 64, 16)).astype(np.float32)
    for stride in (2, 4):
        for start in range(stride):

            def take(x, a=start, s=stride):
                return x[:, a::s] * 2.0

            assert _run(take, x, pl8, (S1,)) == 0, (start, stride)

    def halves(x):
        return jnp.sum(jnp.tanh(x[:, ::2] * x[:, 1::2]))

    assert _run(jax.grad(halves), x, pl8, (S1,)) == 0
    assert gspmd_bytes(jax.grad(halves), pl8, ((S1,),), None, (x,)) == 0


def test_strided_rows_over_two_axes(pl24):
    x = np.random.default_rng(1).normal(size=(4, 64, 16)).astype(np.float32)

    def loss(x):
        return jnp.sum(jnp.tanh(x[:, 1::2]) ** 2)

    assert _run(jax.grad(loss), x, pl24, (S0, S1)) == 0
    assert _run(jax.grad(loss), x, pl24, (B, S1)) == 0


@pytest.mark.parametrize("rows", [64, 24, 40])
def test_strides_that_do_not_line_up_box_first(pl8, rows):
    """Pieces not a multiple of the stride (24 or 40 rows over 8), a
    start past the stride, a stride longer than a piece: the value is boxed
    first; values stay exact and the bytes never exceed GSPMD's."""
    x = np.random.default_rng(rows).normal(size=(4, rows, 8)).astype(np.float32)
    for start, stride in itertools.product(range(3), (2, 3, 16)):

        def take(x, a=start, s=stride):
            return x[:, a::s] * 2.0

        moved = _run(take, x, pl8, (S1,))
        assert moved <= gspmd_bytes(take, pl8, ((S1,),), None, (x,)), (start, stride)


def test_which_strides_stay_in_place():
    def eqn(fn, shape=(64, 8)):
        return jax.make_jaxpr(fn)(jnp.zeros(shape)).jaxpr.eqns[0]

    assert may_shift(eqn(lambda x: x[::2]))
    assert may_shift(eqn(lambda x: lax.pad(x, 0.0, ((0, 1, 1), (0, 0, 0))), (32, 8)))
    assert strided_in_place(64, 2, (0,), (8,))  # pieces of 8
    assert strided_in_place(64, 4, (0, 1), (2, 4))  # pieces of 8 over both axes
    assert not strided_in_place(24, 2, (0,), (8,))  # pieces of 3
    assert not strided_in_place(64, 16, (0,), (8,))  # a stride past a piece
