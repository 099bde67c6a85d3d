"""Boxing is differentiable: gradients against NumPy and finite differences."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import sbpjax as sj

SBP = [sj.S(0), sj.S(1), sj.B, sj.P]
OUT = [sj.S(0), sj.S(1), sj.B]


@pytest.mark.parametrize("src", list(itertools.product(SBP, repeat=2)), ids=str)
def test_grad_through_every_2d_boxing(src, pl24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 12)).astype(np.float32)
    w = rng.normal(size=(8, 12)).astype(np.float32)
    for dst in itertools.product(OUT, repeat=2):

        def loss(v, dst=dst):
            u = sj.to_global(v, pl24, src).to_global(sbp=dst)
            return jnp.sum(u.to_jax() ** 2 * w)

        np.testing.assert_allclose(jax.grad(loss)(x), 2 * x * w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("src, dst", [(a, b) for a in SBP for b in OUT], ids=str)
def test_grad_uneven_1d(src, dst):
    pl = sj.placement(3, "x")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 5)).astype(np.float32)
    w = rng.normal(size=(7, 5)).astype(np.float32)
    loss = lambda v: jnp.sum(jnp.sin(sj.to_global(v, pl, src).to_global(sbp=dst).to_jax()) * w)  # noqa: E731
    np.testing.assert_allclose(jax.grad(loss)(x), np.cos(x) * w, rtol=1e-5, atol=1e-6)


def test_grad_matches_finite_differences(pl24):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 8)).astype(np.float64).astype(np.float32)

    def loss(v):
        u = sj.to_global(v, pl24, (sj.P, sj.S(1))).to_global(sbp=(sj.S(1), sj.S(0)))
        return jnp.sum(jnp.tanh(u.to_jax()) ** 2)

    g = jax.grad(loss)(x)
    eps = 1e-2
    for idx in [(0, 0), (1, 5), (3, 7), (2, 3)]:
        e = np.zeros_like(x)
        e[idx] = eps
        fd = (loss(x + e) - loss(x - e)) / (2 * eps)
        # float32 central differences: truncation ~eps^2, rounding ~1e-7/eps
        assert_close(g[idx], fd, rtol=1e-3)


def test_backward_uses_the_transpose_collective(pl8):
    x = np.ones((16, 8), np.float32)
    w = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)

    def loss(v):
        return jnp.sum(sj.to_global(v, pl8, sj.S(0)).to_global(sbp=sj.B).to_jax() ** 2 * w)

    hlo = jax.jit(jax.grad(loss)).lower(x).compile()
    kinds = {c.op for c in sj.collectives(hlo)}
    assert "all-gather" in kinds and "reduce-scatter" in kinds  # forward gather, backward scatter


def test_grad_of_max_reduction_goes_to_the_argmax():
    pl = sj.placement(4, "x")
    rng = np.random.default_rng(3)
    terms = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(4)]
    w = rng.normal(size=(3, 5)).astype(np.float32)
    t = sj.from_local_tensors(terms, pl, sj.P_max, (3, 5))

    def loss(phys):
        u = sj.GlobalTensor(phys, (3, 5), np.float32, pl, (sj.P_max,))
        return jnp.sum(u.to_global(sbp=sj.B).to_jax() * w)

    g = np.asarray(jax.grad(loss)(t.physical))
    top = np.stack(terms).argmax(0)
    np.testing.assert_array_equal(g, np.stack([(top == i) * w for i in range(4)]))
