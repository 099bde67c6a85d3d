"""What the pipeline tests share: a layer, its loss, the whole-batch reference step, comparisons."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sbpjax as sj

D, MB = 8, 2  # feature width; rows per microbatch (fixed, so every m reuses the compiled stages)


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def host(tree):
    """Global tensors as numpy arrays (their logical values)."""
    return jax.tree_util.tree_map(
        lambda t: np.asarray(t.numpy()), tree, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
    )


def assert_close(got, want):
    """float32 rounding of another summation order: rtol, plus an atol scaled to the operands."""

    def one(a, b):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * max(1.0, float(np.max(np.abs(b)))))

    jax.tree_util.tree_map(one, got, want)


def layer_params(rng):
    return {
        "w": (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32),
        "b": (0.1 * rng.normal(size=(D,))).astype(np.float32),
    }


def batch(m, seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(m * MB, D)).astype(np.float32), rng.normal(size=(m * MB, D)).astype(np.float32))


def reference_step(fns, params, x, y, opt, state=None):
    """The non-pipelined step: one jitted value_and_grad of the whole model on
    the whole batch, then the optimizer. Returns (loss, grads, new params, new state)."""

    def loss(ps):
        h = x
        for f, p in zip(fns, ps):
            h = f(p, h)
        return mse(h, y)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    state = opt.init(params) if state is None else state
    updates, state = opt.update(grads, state, params)
    return float(value), grads, optax.apply_updates(params, updates), state
