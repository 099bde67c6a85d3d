"""Products of reduced values run whole (``Domains._derive_reduced``).

A product contracting a split dim leaves a partial that every plan reduces.
Products of such values (a Gram matrix's powers in Muon's Newton-Schulz
iterations, ``optax.contrib.muon``) may run whole on the axis, as GSPMD runs
them: one all-reduce per iteration. Before, the rule that a product uses every
device split them and gathered them back: two collectives per iteration and,
under the latency price, half again the bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, gspmd_bytes
from jax import lax

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler.arguments import state_sbp

COEFFS = np.tile(np.array([3.4445, -4.7750, 2.0315], np.float32), (5, 1))


def _iteration(x, c):
    a = x @ x.T
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x


def _written_out(x):
    for c in COEFFS:
        x = _iteration(x, jnp.asarray(c))
    return x


def _scanned(x):
    return lax.scan(lambda x, c: (_iteration(x, c), None), x, jnp.asarray(COEFFS))[0]


def _vmapped(x):  # as optax orthogonalizes: vmapped over a leading dim of 1
    return jax.vmap(_scanned)(x[None])[0]


def _count(f, *args) -> tuple[int, int]:
    found = sj.collectives(f.lower(*args).compile())
    return sum(c.bytes for c in found), sum(c.count for c in found)


@pytest.mark.parametrize("fn", [_written_out, _scanned, _vmapped], ids=["written-out", "scan", "vmap"])
def test_newton_schulz_reduces_each_gram_matrix_once(pl24, fn):
    """A 32x64 matrix split by columns over y: each iteration all-reduces its
    32x32 Gram matrix over y and computes its powers whole, GSPMD's 245,760 B
    in 5 collectives (before: 368,640 B in 10)."""
    x = (np.random.default_rng(0).normal(size=(32, 64)) / 50).astype(np.float32)
    f = sj.jit(fn, placement=pl24, in_sbp=((B, S(1)),), out_sbp=(B, S(1)))
    nbytes, count = _count(f, x)
    assert nbytes == f.explain(x).bytes
    gspmd = gspmd_bytes(fn, pl24, ((B, S(1)),), (B, S(1)), (x,))
    assert nbytes <= gspmd
    assert count <= len(COEFFS)
    want = jax.jit(fn)(x)
    assert_close(f(x).numpy(), want, rtol=1e-4)


def test_a_muon_update_moves_what_gspmd_moves(pl24):
    """``optax.contrib.muon``'s update of a 64x256 gradient split by columns
    over y, its momentum mirroring it: 983,088 B in 6 collectives, as GSPMD
    (before: 1,474,608 B in 11)."""
    g = np.random.default_rng(1).normal(size=(64, 256)).astype(np.float32)
    opt = optax.contrib.muon(1e-2)
    s = opt.init({"w": g})
    sbp = (B, S(1))
    ssbp = state_sbp(s, {"w": sbp}, (B, B))

    def update(g, s):
        u, s = opt.update({"w": g}, s, {"w": g})
        return u["w"], s

    f = sj.jit(update, placement=pl24, in_sbp=(sbp, ssbp), out_sbp=(sbp, ssbp))
    nbytes, count = _count(f, g, s)
    assert nbytes == f.explain(g, s).bytes
    assert nbytes <= gspmd_bytes(update, pl24, (sbp, ssbp), (sbp, ssbp), (g, s))
    assert count <= len(COEFFS) + 1  # a Gram matrix per iteration and the norm
    got, want = f(g, s), jax.jit(update)(g, s)
    assert_close(got[0].numpy(), want[0], rtol=1e-4)
    state = jax.tree.leaves(got[1], is_leaf=lambda t: isinstance(t, sj.GlobalTensor))
    for have, ref in zip(state, jax.tree.leaves(want[1]), strict=True):
        assert_close(np.asarray(have.numpy()), np.asarray(ref), rtol=1e-5)
