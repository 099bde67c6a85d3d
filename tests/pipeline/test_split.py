"""B (input cotangent) then W (weight cotangent) from one traced VJP equals the
whole backward, on random stage functions, and does no more work than it."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sbpjax.pipeline.split import split_vjp

D = 6


def _close(got, want):
    """Equal up to float32 rounding: rtol, and an atol scaled to the operands' size."""
    got, want = np.asarray(got), np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale)


# -- a library of layers, each fn(params, x) -> y, drawn at random into stages ---


def dense(p, x):
    return x @ p["w"] + p["b"]


def tanh_dense(p, x):
    return jnp.tanh(dense(p, x))


def gelu_mlp(p, x):
    return x + jax.nn.gelu(x @ p["w"]) @ p["w"].T


def remat_block(p, x):  # the user's own remat: its residuals are its inputs
    return jax.checkpoint(lambda x: jnp.sin(dense(p, x)) * x)(x)


def jitted_block(p, x):  # a nested jit: inlined, so B and W each take their part
    return jax.jit(lambda p, x: jax.nn.relu(dense(p, x)) + x)(p, x)


def scanned_layers(p, x):  # stacked weights: the backward scan is written out and split
    ws = jnp.stack([p["w"], 0.5 * p["w"].T, p["w"] @ p["w"]]) / D

    def body(h, w):  # kept near 1 in size: a well-conditioned composition of random layers
        return 0.5 * (jnp.tanh(h @ w) + h), jnp.mean(h)

    # unrolled for XLA (a rolled loop's cost analysis counts its body once); the split writes it out either way
    h, sums = jax.lax.scan(body, x, ws, unroll=True)
    return h + jnp.mean(sums)


@jax.custom_vjp
def _scaled(x, w):
    return x * w


_scaled.defvjp(lambda x, w: (x * w, (x, w)), lambda r, g: (g * r[1], jnp.sum(g * r[0], axis=0)))


def custom_vjp_layer(p, x):
    return _scaled(x, p["b"]) + x


def norm(p, x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * p["b"]


LAYERS = [dense, tanh_dense, gelu_mlp, remat_block, jitted_block, scanned_layers, custom_vjp_layer, norm]


def _params(rng, n):
    return [
        {
            "w": (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32),
            "b": rng.normal(size=(D,)).astype(np.float32),
        }
        for _ in range(n)
    ]


def _stage(layers):
    def fn(ps, x):
        for f, p in zip(layers, ps):
            x = f(p, x)
        return x

    return fn


def _run_split(fn, p, x, rest=(), differentiate_input=True, ct=None):
    """Flat-leaf plumbing around split_vjp; returns (split, outputs, B then W, whole, reference)."""
    leaves_p, tp = jax.tree_util.tree_flatten(p)
    leaves_x, tx = jax.tree_util.tree_flatten(x)
    leaves_r, tr = jax.tree_util.tree_flatten(rest)
    n_p, n_x = len(leaves_p), len(leaves_x)

    def flat(*a):
        return fn(
            jax.tree_util.tree_unflatten(tp, a[:n_p]),
            jax.tree_util.tree_unflatten(tx, a[n_p : n_p + n_x]),
            *jax.tree_util.tree_unflatten(tr, a[n_p + n_x :]),
        )

    args = [*leaves_p, *leaves_x, *leaves_r]
    split = split_vjp(flat, args, n_p, n_x if differentiate_input else 0)
    out, saved = split.forward(args)
    cts = (
        ct
        if ct is not None
        else [np.cos(np.arange(np.size(o), dtype=np.float32)).reshape(np.shape(o)) for o in out]
    )
    dx, kept = split.backward_input(args, [saved[i] for i in split.saved_for_input], cts)
    dp = split.backward_weight(args, [saved[i] for i in split.saved_for_weight], cts, kept)
    whole = split.backward(args, saved, cts)
    n_diff = n_p + (n_x if differentiate_input else 0)
    y, vjp = jax.vjp(lambda *d: flat(*d, *args[n_diff:]), *args[:n_diff])
    want = vjp(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(y), cts))
    for got, ref in zip(out, jax.tree_util.tree_leaves(y)):
        _close(got, ref)
    return split, (list(dp), list(dx)), whole, list(want), args, cts


@pytest.mark.parametrize("seed", range(len(LAYERS)))
def test_b_then_w_equals_the_whole_backward_on_random_stages(seed):
    """Each layer kind once, followed by up to two random others."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    layers = [LAYERS[seed]] + [pick.choice(LAYERS) for _ in range(pick.randint(0, 2))]
    params = _params(rng, len(layers))
    x = rng.normal(size=(3, D)).astype(np.float32)
    split, (dp, dx), (whole_dx, whole_dp), want, *_ = _run_split(_stage(layers), params, x)
    n_p = len(dp)
    for got, ref in zip(dp + dx, want):  # B then W
        _close(got, ref)
    for got, ref in zip(list(whole_dp) + list(whole_dx), want):  # the one-program backward
        _close(got, ref)
    assert len(want) == n_p + 1
    # each equation of the backward runs once: in B or in W
    assert not set(map(id, split.input_ops)) & set(map(id, split.weight_ops))


def test_split_keeps_what_w_needs_and_w_is_not_empty():
    rng = np.random.default_rng(0)
    params = _params(rng, 2)
    x = rng.normal(size=(3, D)).astype(np.float32)
    split, *_ = _run_split(_stage([tanh_dense, dense]), params, x)
    # W computes both weights' cotangents from the output cotangent and the inner one B made
    assert split.weight_ops and split.input_ops
    assert split.weight_reads_ct
    assert [tuple(r.aval.shape) for r in split.kept_refs] == [(3, D)]
    # residuals: the tanh output (for both B and W), nothing that depends on the parameters alone
    assert split.saved_for_weight and split.saved_for_input


def test_residuals_that_depend_on_the_parameters_alone_are_not_saved():
    rng = np.random.default_rng(1)
    params = _params(rng, 1)
    x = rng.normal(size=(3, D)).astype(np.float32)
    split, *_ = _run_split(_stage([scanned_layers]), params, x)
    # the stacked weights are computed again in the backward, not kept per microbatch
    assert all(tuple(r.aval.shape) != (3, D, D) for r in split.saved_refs)


def test_first_stage_integer_input_and_last_stage_loss():
    rng = np.random.default_rng(2)
    emb = {"e": rng.normal(size=(10, D)).astype(np.float32), "w": rng.normal(size=(D, D)).astype(np.float32)}
    tokens = rng.integers(0, 10, size=(4,)).astype(np.int32)

    def first(p, t):
        return jnp.tanh(p["e"][t] @ p["w"])

    split, (dp, dx), _, want, *_ = _run_split(first, emb, tokens, differentiate_input=False)
    assert dx == [] and not split.input_ops  # no input cotangent: W does the whole backward
    for got, ref in zip(dp, want):
        _close(got, ref)

    def last(p, x, t):
        return jnp.mean((dense(p, x) - t) ** 2)

    p = _params(rng, 1)[0]
    x, t = rng.normal(size=(3, D)).astype(np.float32), rng.normal(size=(3, D)).astype(np.float32)
    scale = [np.float32(0.25)]  # the last stage is seeded with 1 / m
    _, (dp, dx), _, want, *_ = _run_split(last, p, x, (t,), ct=scale)
    for got, ref in zip(dp + dx, want):
        _close(got, ref)


def _flops(fn, *args):
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.parametrize("layers", [[tanh_dense, gelu_mlp], [remat_block, dense], [scanned_layers]])
def test_f_b_w_do_no_more_work_than_jax_vjp(layers):
    """No forward recompute beyond the user's remat: F, B and W together cost
    what JAX's own VJP costs as two programs (``jax.vjp`` forward returning its
    residuals, then the backward; XLA's flop count of each compiled program),
    and B + W what the one-program backward costs. 256 rows, so that the
    parameter-only work the backward redoes (stacking the scanned weights) is
    small next to the batch's."""
    rng = np.random.default_rng(3)
    params = _params(rng, len(layers))
    x = rng.normal(size=(256, D)).astype(np.float32)
    split, _, _, _, args, cts = _run_split(_stage(layers), params, x)
    saved = split.forward(args)[1]
    saved_b = [saved[i] for i in split.saved_for_input]
    saved_w = [saved[i] for i in split.saved_for_weight]
    kept = split.backward_input(args, saved_b, cts)[1]
    f = _flops(lambda a: split.forward(a), args)
    b = _flops(lambda a, s, c: split.backward_input(a, s, c), args, saved_b, cts)
    w = _flops(lambda a, s, c, k: split.backward_weight(a, s, c, k), args, saved_w, cts, kept)
    whole = _flops(lambda a, s, c: split.backward(a, s, c), args, saved, cts)
    fn = _stage(layers)
    _, vjp = jax.jit(lambda p, x: jax.vjp(fn, p, x))(params, x)
    jax_f = _flops(lambda p, x: jax.vjp(fn, p, x), params, x)
    jax_b = _flops(lambda v, c: v(c), vjp, cts[0])
    assert abs((b + w) - whole) <= 0.01 * whole, (b, w, whole)
    assert f + b + w <= 1.02 * (jax_f + jax_b), (f, b, w, jax_f, jax_b)
