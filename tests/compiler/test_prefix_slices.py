"""A split dim cut or padded at its end (``shifts.prefix_aligned``): where
every device's piece of the shorter dim is its piece of the longer one cut
short, ``slice`` and ``pad`` stay local, the result split unevenly
(``logits[:, :-1]`` on 8 pieces of 32: seven of 32 and one of 31); cut or
padded by one at its start (``tokens[:, 1:]`` and its gradient), each device
exchanges one row with a neighbour; elsewhere the value is boxed first.
Every length is checked against the one-device program, and the plan's
bytes against the compiled program's collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes
from jax import lax

import sbpjax as sj
from sbpjax.rules.shifts import prefix_aligned

S0, S1, B = sj.S(0), sj.S(1), sj.B


def test_which_prefixes_line_up():
    assert prefix_aligned(63, 64, (0,), (8,))  # seven pieces of 8, one of 7
    assert not prefix_aligned(62, 64, (0,), (8,))  # six of 8, two of 7: the last starts at 55, not 56
    assert not prefix_aligned(29, 30, (0,), (8,))  # 4,4,4,4,4,3,3,3 against 4,4,4,4,4,4,3,3
    assert not prefix_aligned(56, 64, (0,), (8,))  # blocks of 7 against 8
    assert not prefix_aligned(7, 8, (0,), (8,))  # a device would hold nothing
    assert prefix_aligned(63, 64, (0, 1), (2, 4))


@pytest.mark.parametrize("rows", [64, 30])
def test_every_prefix_of_a_split_dim(pl8, rows):
    x = np.random.default_rng(rows).normal(size=(rows, 3)).astype(np.float32)
    for length in range(1, rows + 1):

        def cut(x, length=length):
            y = x[:length] * 2.0
            return y, jnp.sum(y, axis=0)

        f = sj.jit(cut, placement=pl8, in_sbp=(S0,))
        got = f(x)
        want = jax.jit(cut)(x)
        for g, w in zip(got, want):
            assert_close(g.numpy(), w, rtol=1e-6, err_msg=f"x[:{length}]")
        assert moved_bytes(f, x) == f.explain(x).bytes
        if prefix_aligned(length, rows, (0,), (8,)) or length == rows:
            assert f.explain(x).bytes == 0, length


def test_a_pad_at_the_end_fills_the_hole(pl24):
    x = np.random.default_rng(1).normal(size=(63, 5)).astype(np.float32)

    def grow(x):
        return lax.pad(x, jnp.float32(7.0), ((0, 1, 0), (0, 0, 0))) + 1.0

    f = sj.jit(grow, placement=pl24, in_sbp=((S0, S0),), out_sbp=(S0, S0))
    np.testing.assert_array_equal(f(x).numpy(), np.asarray(jax.jit(grow)(x)))
    assert moved_bytes(f, x) == 0


def test_a_language_model_loss_on_a_split_sequence(pl8):
    """Next-token cross-entropy on logits split along the sequence: the
    logits stay where they are (GSPMD's bytes or fewer; all-to-all'd to a
    vocab split before, 70x GSPMD's)."""
    r = np.random.default_rng(2)
    logits = r.normal(size=(4, 256, 512)).astype(np.float32)
    tokens = r.integers(0, 512, (4, 256)).astype(np.int32)

    def loss(logits, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    step = jax.value_and_grad(loss)
    f = sj.jit(step, placement=pl8, in_sbp=((S1,), (S1,)))
    (got_loss, got_grad), (want_loss, want_grad) = f(logits, tokens), jax.jit(step)(logits, tokens)
    assert_close(got_loss.numpy(), want_loss, rtol=1e-5)
    assert_close(got_grad.numpy(), want_grad, rtol=1e-5)
    ours = moved_bytes(f, logits, tokens)
    assert ours == f.explain(logits, tokens).bytes
    assert ours <= gspmd_bytes(step, pl8, ((S1,), (S1,)), None, (logits, tokens))


@pytest.mark.parametrize("rows", [64, 16, 30])  # pieces of 8 and of 2 shift by one row; 30 is boxed
def test_a_split_dim_cut_by_one_at_its_start(pl8, rows):
    x = np.random.default_rng(rows).normal(size=(rows, 3)).astype(np.float32)

    def tail(x):
        return jax.value_and_grad(lambda x: jnp.sum(jnp.sin(x[1:]) * x[1:]))(x)

    f = sj.jit(tail, placement=pl8, in_sbp=(S0,))
    for g, w in zip(f(x), jax.jit(tail)(x)):
        assert_close(g.numpy(), w, rtol=1e-6)
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes
    if rows % 8 == 0:  # the slice and its gradient's two pads: one row to each device but one
        assert moved <= 3 * 7 * (3 * 4) + 2 * 7 * 4, moved  # (and at most the loss's all-reduce)


def test_a_shift_over_two_axes(pl24):
    x = np.random.default_rng(3).normal(size=(64, 4)).astype(np.float32)

    def shift(x):
        return lax.pad(x[1:] * 2.0, jnp.float32(-1.0), ((1, 0, 0), (0, 0, 0)))

    f = sj.jit(shift, placement=pl24, in_sbp=((S0, S0),), out_sbp=(S0, S0))
    np.testing.assert_array_equal(f(x).numpy(), np.asarray(jax.jit(shift)(x)))
    assert moved_bytes(f, x) == 2 * 7 * 4 * 4  # one row each way between neighbouring pieces


@pytest.mark.parametrize("rows", [64, 30])
def test_a_roll_by_one_and_a_shift_with_a_fill(pl8, rows):
    """``jnp.roll(x, -1)`` (``x[1:]`` then ``x[:1]``) and ``x[1:]`` with a row
    of zeros after it: the whole rows fill the last piece's hole. On 8
    pieces of 8 they move a few rows, not the value (30 rows: boxed first)."""
    x = np.random.default_rng(rows).normal(size=(rows, 4)).astype(np.float32)

    def shifts(x):
        return jnp.roll(x, -1, axis=0), jnp.concatenate([x[1:], jnp.zeros((1, 4), x.dtype)]) * 2.0

    f = sj.jit(shifts, placement=pl8, in_sbp=(S0,), out_sbp=(S0, S0))
    for g, w in zip(f(x), jax.jit(shifts)(x)):
        np.testing.assert_array_equal(g.numpy(), np.asarray(w))
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes
    if rows == 64:  # at most two one-row exchanges and the first row's all-reduce (2 (p - 1) rows)
        row = 4 * 4
        assert moved <= 2 * 7 * row + 2 * 7 * row, moved


def test_an_empty_operand_concatenated_along_a_split_dim(pl8):
    x = np.arange(128, dtype=np.float32).reshape(64, 2)

    def grow(x):
        return jnp.concatenate([x, jnp.zeros((0, 2), x.dtype)]) + 1.0

    f = sj.jit(grow, placement=pl8, in_sbp=(S0,), out_sbp=(S0,))
    np.testing.assert_array_equal(f(x).numpy(), x + 1.0)
    assert moved_bytes(f, x) == 0
