"""``lax.dynamic_update_slice`` into an operand split along a dim the update
does not cover (a KV cache split along the sequence, a token written at a
traced position): each device writes the part of the update that falls in
its piece, nothing moves, and the values equal the one-device program's for
starts inside a piece, across piece boundaries, past the end (XLA clamps
them) and on pieces the devices do not divide evenly."""

import jax
import numpy as np
import pytest
from conftest import moved_bytes
from jax import lax

import sbpjax as sj

S0, S1, B = sj.S(0), sj.S(1), sj.B


def _write(cache, new, pos):
    return lax.dynamic_update_slice(cache, new, (pos, 0))


@pytest.mark.parametrize("rows", [64, 30])  # 8 pieces of 8; pieces of 4 and 3
@pytest.mark.parametrize("length", [1, 5, 8, 20])
def test_a_write_into_a_split_dim_moves_nothing(pl8, rows, length):
    r = np.random.default_rng(rows + length)
    cache = r.normal(size=(rows, 4)).astype(np.float32)
    new = r.normal(size=(length, 4)).astype(np.float32)
    f = sj.jit(_write, placement=pl8, in_sbp=((S0,), (B,), (B,)), out_sbp=(S0,))
    for pos in (0, 3, 7, 8, 13, rows - length, rows - 1, rows + 40, -3):
        p = np.int32(pos)
        want = np.asarray(jax.jit(_write)(cache, new, p))
        np.testing.assert_array_equal(f(cache, new, p).numpy(), want, err_msg=f"start {pos}")
    assert moved_bytes(f, cache, new, np.int32(0)) == 0


def test_a_write_into_two_split_dims_on_2x4(pl24):
    """Rows over x and columns over y, the update whole on both; and the
    update split with the operand along the dim it covers whole."""
    r = np.random.default_rng(1)
    cache = r.normal(size=(16, 32, 3)).astype(np.float32)

    def write(cache, new, i, j):
        return lax.dynamic_update_slice(cache, new, (i, j, 0))

    new = r.normal(size=(5, 6, 3)).astype(np.float32)
    f = sj.jit(write, placement=pl24, in_sbp=((S0, S1), (B, B), (B, B), (B, B)), out_sbp=(S0, S1))
    covering = r.normal(size=(16, 6, 3)).astype(np.float32)
    g = sj.jit(write, placement=pl24, in_sbp=((S0, S1), (S0, B), (B, B), (B, B)), out_sbp=(S0, S1))
    for i, j in ((0, 0), (6, 5), (11, 29), (7, 14), (20, 40)):
        args = (np.int32(i), np.int32(j))
        np.testing.assert_array_equal(
            f(cache, new, *args).numpy(), np.asarray(jax.jit(write)(cache, new, *args))
        )
        want = np.asarray(jax.jit(write)(cache, covering, *args))
        np.testing.assert_array_equal(g(cache, covering, *args).numpy(), want)
    assert moved_bytes(f, cache, new, np.int32(0), np.int32(0)) == 0
    assert moved_bytes(g, cache, covering, np.int32(0), np.int32(0)) == 0


@pytest.mark.parametrize("rows", [64, 30])
def test_a_write_into_a_dim_split_over_both_axes(pl24, rows):
    """Rows over x and y together (8 pieces, uneven for 30): every start."""
    r = np.random.default_rng(rows)
    cache = r.normal(size=(rows, 3)).astype(np.float32)
    new = r.normal(size=(5, 3)).astype(np.float32)
    f = sj.jit(_write, placement=pl24, in_sbp=((S0, S0), (B, B), (B, B)), out_sbp=(S0, S0))
    for pos in range(-2, rows + 3):
        p = np.int32(pos)
        np.testing.assert_array_equal(f(cache, new, p).numpy(), np.asarray(jax.jit(_write)(cache, new, p)))
    assert moved_bytes(f, cache, new, np.int32(0)) == 0


@pytest.mark.parametrize("start", [-3, -40, 2, 99])
def test_a_start_the_program_leaves_unwrapped_is_clamped_as_xla_clamps_it(pl8, start):
    """``allow_negative_indices=False``: a negative start reaches the
    primitive as it is and XLA clamps it to 0. Each device's slice and write
    along a dim it holds whole are clamped the same (they were wrapped once
    more: -3 became 9, which XLA clamped to 8, so columns 8..11 were read)."""
    r = np.random.default_rng(start + 50)
    x = r.normal(size=(16, 12)).astype(np.float32)
    u = r.normal(size=(16, 4)).astype(np.float32)

    def read_and_write(x, u, i):
        piece = lax.dynamic_slice_in_dim(x, i, 4, axis=1, allow_negative_indices=False)
        return piece, lax.dynamic_update_slice(x, u * piece, (0, i), allow_negative_indices=False)

    f = sj.jit(read_and_write, placement=pl8, in_sbp=((S0,), (S0,), (B,)), out_sbp=((S0,), (S0,)))
    i = np.int32(start)
    for got, want in zip(f(x, u, i), jax.jit(read_and_write)(x, u, i)):
        np.testing.assert_array_equal(got.numpy(), np.asarray(want), err_msg=f"start {start}")
    assert moved_bytes(f, x, u, i) == 0
