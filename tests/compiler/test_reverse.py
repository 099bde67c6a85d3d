"""``rev`` (``jnp.flip``, ``x[::-1]``) along a split dim keeps the split: each
device's block goes to the device of the mirrored piece (one permute), as
GSPMD's collective permute moves it. It used to gather the operand or move it
by all-to-alls (``ids[::-1]`` on 8 devices: 1,792 B against GSPMD's 256)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes

import sbpjax as sj

S0, S1, B = sj.S(0), sj.S(1), sj.B


def _layouts(ndim, axes):
    """Every nd-SBP of S and B over ``axes`` placement axes for a rank-``ndim`` value."""
    one = [B] + [sj.S(d) for d in range(ndim)]
    return list(itertools.product(one, repeat=axes))


@pytest.mark.parametrize("where", ["8", "2x4", "3"])
def test_a_reversal_keeps_every_layout_and_moves_one_block_per_mirrored_piece(pl8, pl24, where):
    """Every layout of a (24, 16) value (and an uneven (13, 16) one), each
    set of reversed dims: the values are NumPy's, the compiled program moves
    what ``explain()`` says and no more than GSPMD; an even split keeps its
    layout, and each device receives its block once (one permute over the
    axes splitting reversed dims), but the middle ones of odd axes."""
    pl = {"8": pl8, "2x4": pl24, "3": sj.placement(3, "x")}[where]
    rng = np.random.default_rng(0)
    for shape in ((24, 16), (13, 16)):
        x = rng.normal(size=shape).astype(np.float32)
        for dims in ((0,), (1,), (0, 1)):
            fn = lambda a, dims=dims: jnp.flip(a, dims) * 2.0  # noqa: E731
            for nd in _layouts(2, pl.ndim):
                f = sj.jit(fn, placement=pl, in_sbp=(nd,), out_sbp=nd)
                np.testing.assert_array_equal(f(x).numpy(), np.flip(x, dims) * 2.0)
                compiled = f.lower(x).compile()
                moved = sum(c.bytes for c in sj.collectives(compiled))
                assert moved == f.explain(x).bytes, (shape, dims, nd, str(f.explain(x)))
                even = all(
                    shape[s.dim] % np.prod([pl.shape[a] for a, t in enumerate(nd) if t == s]) == 0
                    for s in nd
                    if isinstance(s, sj.sbp.Split)
                )
                if not even:  # (jax.jit takes no uneven input sharding)
                    continue
                assert moved <= gspmd_bytes(fn, pl, (nd,), nd, (x,)), (shape, dims, nd)
                block = x.nbytes // np.prod([n for n, s in zip(pl.shape, nd) if isinstance(s, sj.sbp.Split)])
                mirrored = [n for n, s in zip(pl.shape, nd) if isinstance(s, sj.sbp.Split) and s.dim in dims]
                staying = pl.size // int(np.prod(mirrored)) if all(n % 2 for n in mirrored) else 0
                want = (pl.size - staying) * block if mirrored else 0
                assert moved == want, (shape, dims, nd, str(f.explain(x)))


def test_a_reversed_index_gathers_no_table(pl8):
    """``t[i] + t[i[::-1]]`` with the ids split: the reversed ids are
    permuted, not gathered (1,792 B before, GSPMD's 256 now)."""
    rng = np.random.default_rng(1)
    t = rng.normal(size=(40, 16)).astype(np.float32)
    i = rng.integers(0, 40, 64).astype(np.int32)

    def fn(t, i):
        return t[i] * 2 + t[i[::-1]]

    f = sj.jit(fn, placement=pl8, in_sbp=((B,), (S0,)), out_sbp=(S0,))
    np.testing.assert_allclose(f(t, i).numpy(), t[i] * 2 + t[i[::-1]], rtol=1e-6, atol=1e-6)
    moved = sum(c.bytes for c in sj.collectives(f.lower(t, i).compile()))
    assert moved == f.explain(t, i).bytes == 8 * 8 * 4
    assert moved <= gspmd_bytes(fn, pl8, ((B,), (S0,)), (S0,), (t, i))


def test_the_gradient_of_a_reversal_reverses_the_cotangent_in_place(pl24):
    """The VJP of a flip is a flip: a sequence-split reversed RNN-style loss
    (a right-to-left pass) trains with its split kept, values equal to the
    single-device gradient."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 32, 4)).astype(np.float32)
    w = rng.normal(size=(32, 4)).astype(np.float32)

    def loss(w, x):
        back = jnp.flip(x, 1)
        return jnp.sum(jnp.cumsum(back * w, axis=1) ** 2)

    g = jax.grad(loss)
    sbp = ((B, S0), (S0, S1))
    f = sj.jit(g, placement=pl24, in_sbp=sbp, out_sbp=(B, S0))
    want = np.asarray(jax.jit(g)(w, x))
    np.testing.assert_allclose(f(w, x).numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    moved = sum(c.bytes for c in sj.collectives(f.lower(w, x).compile()))
    assert moved == f.explain(w, x).bytes
    assert moved <= gspmd_bytes(g, pl24, sbp, (B, S0), (w, x))


def test_partial_odd_placements_shared_permutes_and_scans():
    """A partial operand reversed as it is; a 3x2 placement (odd axis: the
    middle row keeps its blocks); two reversals of one operand over the same
    axes share their permute; a reversal inside a scan's body. Values are
    NumPy's and the compiled program moves what explain() says."""
    rng = np.random.default_rng(3)
    pl32 = sj.placement((3, 2), ("a", "b"))
    x = rng.normal(size=(6, 4, 6)).astype(np.float32)
    for nd, dims in (((S0, sj.S(2)), (0, 2)), ((sj.S(2), S1), (1, 2)), ((sj.S(2), S0), (0, 2))):
        f = sj.jit(lambda a, dims=dims: jnp.flip(a, dims), placement=pl32, in_sbp=(nd,), out_sbp=nd)
        np.testing.assert_array_equal(f(x).numpy(), np.flip(x, dims))
        assert sum(c.bytes for c in sj.collectives(f.lower(x).compile())) == f.explain(x).bytes
    w = rng.normal(size=(4, 6)).astype(np.float32)

    def partial_then_flip(w, v):  # a contraction over the split dim: a partial, reversed
        return jnp.flip(v @ w, 0)

    v = rng.normal(size=(6, 4)).astype(np.float32)
    f = sj.jit(partial_then_flip, placement=pl32, in_sbp=((S0, B), (sj.S(1), B)), out_sbp=(B, B))
    np.testing.assert_allclose(f(w, v).numpy(), np.flip(v @ w, 0), rtol=1e-5, atol=1e-5)
    assert sum(c.bytes for c in sj.collectives(f.lower(w, v).compile())) == f.explain(w, v).bytes
    y = rng.normal(size=(4, 4)).astype(np.float32)
    pl22 = sj.placement((2, 2), ("a", "b"))

    def twice(a):
        return jnp.flip(a, (0,)) + jnp.flip(a, (0, 1))

    f = sj.jit(twice, placement=pl22, in_sbp=((S0, B),), out_sbp=(S0, B))
    assert_close(f(y).numpy(), np.flip(y, 0) + np.flip(y, (0, 1)), rtol=1e-6)
    moved = sum(c.bytes for c in sj.collectives(f.lower(y).compile()))
    assert moved == f.explain(y).bytes == 4 * y.nbytes // 2  # one permute of each device's block

    def scanned(h, ws):
        def body(h, w):
            return jnp.tanh(jnp.flip(h, 1) @ w), None

        return jax.lax.scan(body, h, ws)[0]

    h = rng.normal(size=(8, 16)).astype(np.float32)
    ws = rng.normal(size=(3, 16, 16)).astype(np.float32) / 4
    f = sj.jit(scanned, placement=pl22, in_sbp=((S0, S1), (B, B)), out_sbp=(S0, B))
    want = np.asarray(jax.jit(scanned)(h, ws))
    np.testing.assert_allclose(f(h, ws).numpy(), want, rtol=1e-5, atol=1e-5)
    assert sum(c.bytes for c in sj.collectives(f.lower(h, ws).compile())) == f.explain(h, ws).bytes
