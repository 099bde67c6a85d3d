"""Small products of reduced values run whole (``WholeProducts._small_reduced_product``).

A product contracting a split dim leaves a partial. Small products of such
values (a Gram matrix's powers in Muon's Newton-Schulz iterations,
``optax.contrib.muon``) may run whole on the axis, as GSPMD runs them: one
all-reduce per iteration. Before, the rule that a product uses every device
split them and gathered them back: two collectives per iteration and, under
the latency price, half again the bytes. Products of activations keep using
every device."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, gspmd_bytes, gspmd_compiled, load_module
from jax import lax

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler.arguments import state_sbp

HERE = os.path.dirname(os.path.abspath(__file__))
hlo_flops = load_module(os.path.join(HERE, "..", "..", "benchmarks", "_hlo_flops.py"), "bench_hlo_flops")
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


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_newton_schulz_on_columns_split_over_both_axes_reduces_once(pl24, tall):
    """Newton-Schulz after a Frobenius normalization, a 32x128 matrix (or its
    128x32 transpose, orthogonalized as Muon does, transposed) split along
    its 128 over both axes of 2x4. Each Gram matrix is a partial over both
    axes; its powers run whole after one all-reduce, GSPMD's 286,776 B in 6
    collectives. Before, the normalized matrix could also be split by rows
    over x, so the Gram matrix was not counted as reduced there, its square
    was split by rows and gathered back each iteration: 368,696 B in 11."""
    x = np.random.default_rng(2).normal(size=(32, 128)).astype(np.float32)

    def ns(g):
        m = g.T if tall else g
        y = _written_out(m / (jnp.linalg.norm(m) + 1e-7))
        return y.T if tall else y

    arg = x.T.copy() if tall else x
    sbp = (S(0), S(0)) if tall else (S(1), S(1))
    f = sj.jit(ns, placement=pl24, in_sbp=(sbp,), out_sbp=sbp)
    nbytes, count = _count(f, arg)
    assert nbytes == f.explain(arg).bytes
    assert nbytes <= gspmd_bytes(ns, pl24, (sbp,), sbp, (arg,))
    assert count <= len(COEFFS) + 1  # a Gram matrix per iteration and the norm
    assert_close(f(arg).numpy(), jax.jit(ns)(arg), rtol=1e-4)


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


def test_a_muon_step_runs_its_iterations_as_gspmd_does(pl24):
    """A whole MLP step with Muon on 2x4 (a 32x64 kernel split by columns over
    y, the batch over x): the gradient reduced over x, decayed into the
    momentum (``b1 * mu + (1 - b1) * g``), is orthogonalized whole on x as
    GSPMD does it, each Gram matrix all-reduced over y alone: GSPMD's bytes,
    as many collectives and no more FLOPs (628,864 B in 27 collectives before
    the Gram matrices could run whole on x; 390,272 B in 13 before a
    boxing that borrows an axis the value is whole on was priced with its
    launches; GSPMD 339,072 B in 13)."""
    rng = np.random.default_rng(2)
    p = {
        "w0": (rng.normal(size=(32, 64)) / 6).astype(np.float32),
        "b0": np.zeros(64, np.float32),
        "w1": (rng.normal(size=(64, 16)) / 8).astype(np.float32),
        "b1": np.zeros(16, np.float32),
    }
    x, y = rng.normal(size=(16, 32)).astype(np.float32), rng.normal(size=(16, 16)).astype(np.float32)
    psbp = {"w0": (B, S(1)), "b0": (B, S(0)), "w1": (B, S(0)), "b1": (B, B)}
    opt = optax.contrib.muon(1e-2)
    s = opt.init(p)
    ssbp = state_sbp(s, psbp, (B, B))

    def loss(p, x, y):
        return ((jax.nn.gelu(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"] - y) ** 2).mean()

    def step(p, s, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    in_sbp, out_sbp = (psbp, ssbp, (S(0), B), (S(0), B)), (psbp, ssbp, (B, B))
    f = sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp)
    compiled = f.lower(p, s, x, y).compile()
    gspmd = gspmd_compiled(step, pl24, in_sbp, out_sbp, (p, s, x, y))
    count = lambda c: sum(k.count for k in sj.collectives(c))  # noqa: E731
    assert count(compiled) <= count(gspmd)
    assert sum(k.bytes for k in sj.collectives(compiled)) <= sum(k.bytes for k in sj.collectives(gspmd))
    assert hlo_flops.loop_flops(compiled.as_text()) <= hlo_flops.loop_flops(gspmd.as_text())
    assert sum(k.bytes for k in sj.collectives(compiled)) == f.explain(p, s, x, y).bytes
    got, want = f(p, s, x, y), jax.jit(step)(p, s, x, y)
    leaves = jax.tree.leaves(got, is_leaf=lambda t: isinstance(t, sj.GlobalTensor))
    for have, ref in zip(leaves, jax.tree.leaves(want), strict=True):
        assert_close(np.asarray(have.numpy()), np.asarray(ref), rtol=1e-4)


def test_products_of_activations_keep_using_every_device(pl24):
    """An attention-like block over a row-parallel MLP's partial output,
    normalized (reduced over y): its products have a batch and a sequence
    longer than the width, so none of them runs whole on y."""
    rng = np.random.default_rng(3)
    p = {
        "w1": (rng.normal(size=(64, 256)) / 8).astype(np.float32),
        "w2": (rng.normal(size=(256, 64)) / 16).astype(np.float32),
    }
    x = rng.normal(size=(16, 32, 64)).astype(np.float32)

    def forward(p, x):
        h = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-5)
        scores = jnp.einsum("btd,bsd->bts", h, h)
        return jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, -1), h)

    f = sj.jit(
        forward, placement=pl24, in_sbp=({"w1": (B, S(1)), "w2": (B, S(0))}, (S(0), B)), out_sbp=(S(0), B)
    )
    products = [d for d in f.explain(p, x).propagation.decisions if d.node.name == "dot_general"]
    assert len(products) == 4
    for d in products:
        layouts = list(d.in_sbp) + list(d.out_sbp)
        assert all(any(not isinstance(nd[a], sj.Broadcast) for nd in layouts) for a in range(2)), d
    assert_close(f(p, x).numpy(), jax.jit(forward)(p, x), rtol=1e-4)
