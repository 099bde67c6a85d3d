"""Which splits a reshape keeps (``sbpjax.rules.shape.reshape_map``): a split
dim and the result dim starting at the same flat offset hold the same
elements in each of p even pieces, whatever their sizes. A property sweep of
random reshapes and layouts forced on both sides (``sj.constrain``) checks the
values against NumPy and that the plan moves nothing."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes

import sbpjax as sj
from sbpjax import B, S
from sbpjax.rules.shape import reshape_map


def _factors(rng, n, k):
    out = []
    for _ in range(k - 1):
        d = int(rng.choice([d for d in range(1, n + 1) if n % d == 0]))
        out.append(d)
        n //= d
    return (*out, n)


def _even(shape, nd, grid):
    return all(shape[d] % math.prod(p for p, s in zip(grid, nd) if s == S(d)) == 0 for d in range(len(shape)))


@pytest.mark.parametrize("seed", range(3))
def test_a_kept_split_of_a_reshape_moves_nothing_and_matches_numpy(pl8, pl24, seed):
    rng = np.random.default_rng(seed)
    checked = 0
    for trial in range(30):
        pl = (pl8, pl24)[trial % 2]
        total = int(rng.choice([96, 192, 384, 144, 480]))
        ins = _factors(rng, total, int(rng.integers(1, 4)))
        outs = _factors(rng, total, int(rng.integers(1, 4)))
        kept = list(reshape_map(ins, outs).items())
        if not kept:
            continue
        pairs = [kept[int(rng.integers(len(kept)))] for _ in range(pl.ndim)]
        nd_in = tuple(S(d) for d, _ in pairs)
        nd_out = tuple(S(k) for _, k in pairs)
        if not (_even(ins, nd_in, pl.shape) and _even(outs, nd_out, pl.shape)):
            continue
        x = rng.normal(size=ins).astype(np.float32)
        f = sj.jit(
            lambda v, outs=outs, nd_out=nd_out: sj.constrain(jnp.sin(v).reshape(outs), nd_out) * 2,
            placement=pl,
            in_sbp=(nd_in,),
            out_sbp=nd_out,
        )
        assert_close(f(x).numpy(), np.sin(x).reshape(outs) * 2, rtol=1e-6, err_msg=f"{ins}->{outs} {nd_in}")
        assert f.explain(x).bytes == moved_bytes(f, x) == 0, f"{ins}->{outs} {nd_in}->{nd_out}"
        checked += 1
    assert checked >= 10


def test_a_merge_with_part_of_the_next_dim_keeps_the_rows_split(pl24):
    """(16, 96) -> (384, 4): 384 merges the 16 rows with 24 of the 96 columns.
    The rows' split is kept (it was gathered whole: 43,008 B against GSPMD's
    24,576 for (S(0), S(1)))."""
    x = np.random.default_rng(0).normal(size=(16, 96)).astype(np.float32)
    f = sj.jit(lambda v: v.reshape(384, 4).sum(1), placement=pl24, in_sbp=((S(0), S(1)),), out_sbp=(B, B))
    assert_close(f(x).numpy(), x.reshape(384, 4).sum(1), rtol=1e-5)
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes
    # at most: gather the columns over y (8 x 3 pieces of 8 x 24 floats), then the sums over x
    assert moved <= min(
        8 * 3 * 8 * 24 * 4 + 8 * 192 * 4, gspmd_bytes(f.fn, pl24, ((S(0), S(1)),), (B, B), (x,))
    )
    assert reshape_map((16, 96), (384, 4)) == {0: 0}
    assert reshape_map((6, 4), (4, 6)) == {0: 0}
