"""Out-of-range indices mean on many devices what they mean on one.

JAX gives every gather and scatter a mode for indices outside the operand:
``x[ids]`` and ``mode="clip"`` clamp them, ``jnp.take``'s default fills the
result (NaN for floats, the dtype's minimum for signed integers, or the
``fill_value`` given), and a scatter drops or clamps its updates. A pad id
equal to the vocabulary size is the common case. Where the table is split
along the dim the ids index (an embedding split by vocabulary), each device
looks up only its own rows; the oracle here is the same program on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbpjax as sj
from sbpjax import B, S

ROWS = 16
IDS = np.array([0, 3, ROWS - 1, ROWS, ROWS + 7, -1, -ROWS, -ROWS - 3, 100, 5], np.int32)

LOOKUPS = {
    "getitem_clamps": lambda t, i: t[i],
    "take_clip": lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
    "take_fill_nan": lambda t, i: jnp.take(t, i, axis=0),
    "take_fill_value": lambda t, i: jnp.take(t, i, axis=0, fill_value=-7.5),
    "take_int_fill": lambda t, i: jnp.take(t.astype(jnp.int32), i, axis=0),
    "take_along_axis_fill": lambda t, i: jnp.take_along_axis(t, _per_column(i, t), axis=0),
    "take_along_axis_clip": lambda t, i: jnp.take_along_axis(t, _per_column(i, t), axis=0, mode="clip"),
}


def _per_column(ids, t):
    """Each column of ``t`` indexed by ``ids`` shifted by the column number."""
    return ids[:, None] + jnp.arange(t.shape[1], dtype=ids.dtype)


def table(rows=ROWS):
    # no zeros: a row read as zeros would pass unnoticed
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 1.0


@pytest.mark.parametrize("name", sorted(LOOKUPS))
@pytest.mark.parametrize(
    "layout", ["rows_split", "rows_split_unevenly", "rows_split_both_axes", "columns_split", "replicated"]
)
def test_a_lookup_reads_out_of_range_ids_as_one_device_does(name, layout, pl8, pl24):
    fn = LOOKUPS[name]
    # 10 rows on 8 devices: pieces of 2, 2, 1, ..., each block padded to 2 rows
    pl, t_sbp, rows = {
        "rows_split": (pl8, (S(0),), ROWS),
        "rows_split_unevenly": (pl8, (S(0),), 10),
        "rows_split_both_axes": (pl24, (S(0), S(0)), ROWS),
        "columns_split": (pl24, (B, S(1)), ROWS),
        "replicated": (pl8, (B,), ROWS),
    }[layout]
    ids_sbp = (B,) * pl.ndim
    want = np.asarray(jax.jit(fn)(table(rows), IDS))
    f = sj.jit(fn, placement=pl, in_sbp=(t_sbp, ids_sbp))
    got = f(table(rows), IDS).numpy()
    # exact: each element is one row's value (or the fill), plus zeros
    np.testing.assert_array_equal(got, want)


def test_a_partial_table_fills_once(pl8):
    """A lookup in a partial sum (each device holds a term): a finite fill
    value is held by one device, so the sum is the fill, not 8 times it."""
    P = sj.P
    fn = LOOKUPS["take_fill_value"]
    terms = table() / 8
    want = np.asarray(jax.jit(fn)(terms * 8, IDS))
    f = sj.jit(fn, placement=pl8, in_sbp=((P,), (B,)), out_sbp=(P,))
    got = f(sj.to_global(terms * 8, pl8, (P,)), IDS)
    assert got.sbp == (P,)
    np.testing.assert_allclose(
        got.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want[np.isfinite(want)]).max()
    )


@pytest.mark.parametrize("mode", ["clip", "drop"])
def test_a_scatter_add_into_a_split_table_keeps_its_mode(mode, pl8):
    """(``promise_in_bounds`` leaves out-of-range updates undefined: not tested.)"""

    def fn(t, i):
        updates = jnp.ones((len(i), 4)) * (1 + jnp.arange(len(i)))[:, None]  # each update its own
        return t.at[i].add(updates, mode=mode)

    want = np.asarray(jax.jit(fn)(table(), IDS))
    f = sj.jit(fn, placement=pl8, in_sbp=((S(0),), (B,)), out_sbp=(S(0),))
    np.testing.assert_array_equal(f(table(), IDS).numpy(), want)


# distinct rows after JAX's own index handling (a set with repeated rows keeps
# whichever update XLA applies last: not a value to compare)
SET_IDS = {
    ROWS: {"drop": [0, 3, ROWS - 1, ROWS, 100, -3, 9], "clip": [0, 3, ROWS, -3, 9]},
    10: {"drop": [0, 3, 9, 10, 100, -3, 5], "clip": [0, 3, 10, -4, 5]},
}


@pytest.mark.parametrize("mode", ["clip", "drop"])
@pytest.mark.parametrize("layout", ["rows_split", "rows_split_unevenly", "rows_split_both_axes"])
def test_a_set_into_a_table_split_by_rows_writes_only_owned_rows(mode, layout, pl8, pl24):
    """``t.at[ids].set(u)`` with the table split along the rows it writes (a
    KV cache's or a memory bank's update): each device writes its own rows,
    nothing moves, and out-of-range ids mean what they mean on one device."""
    pl, t_sbp, rows = {
        "rows_split": (pl8, (S(0),), ROWS),
        "rows_split_unevenly": (pl8, (S(0),), 10),
        "rows_split_both_axes": (pl24, (S(0), S(0)), ROWS),
    }[layout]
    ids = np.asarray(SET_IDS[rows][mode], np.int32)

    def fn(t, i):
        updates = -jnp.ones((len(i), 4)) * (1 + jnp.arange(len(i)))[:, None]  # each update its own
        return t.at[i].set(updates, mode=mode)

    want = np.asarray(jax.jit(fn)(table(rows), ids))
    rep = (B,) * pl.ndim
    f = sj.jit(fn, placement=pl, in_sbp=(t_sbp, rep), out_sbp=t_sbp)
    np.testing.assert_array_equal(f(table(rows), ids).numpy(), want)
    assert f.explain(table(rows), ids).bytes == 0
    assert sj.collectives(f.lower(table(rows), ids).compile()) == []
