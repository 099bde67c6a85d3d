"""A global-norm clip (``optax.clip_by_global_norm``) sums every parameter's
squared norm into one scalar (``candidate_filters.scalar_sum``): the layout choice of
a clipped step stays proven within the default effort (without the rule, this
step's solve stopped at a 10.5% gap), and the clip adds at most one
all-reduce of a few bytes to the unclipped step's plan."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes

import sbpjax as sj
from sbpjax.compiler.api import state_sbp

S0, S1, B = sj.S(0), sj.S(1), sj.B
V, D, H, KV, T, N, L = 256, 128, 8, 2, 64, 8, 2


def _params(r):
    nrm = lambda *s: (r.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    blocks = [
        {
            "g": np.ones(D, np.float32),
            "wq": nrm(D, D),
            "wk": nrm(D, KV * D // H),
            "wv": nrm(D, KV * D // H),
            "wo": nrm(D, D),
            "w1": nrm(D, 3 * D),
            "w3": nrm(D, 3 * D),
            "w2": nrm(3 * D, D),
        }
        for _ in range(L)
    ]
    return {"emb": nrm(V, D), "blocks": blocks}


def _loss(p, tok):
    x = p["emb"][tok]
    mask = jnp.tril(jnp.ones((T, T), bool))
    for b in p["blocks"]:
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * b["g"]
        q = (h @ b["wq"]).reshape(N, T, H, -1)
        # grouped-query attention: KV heads repeated for the query heads
        k, v = (jnp.repeat((h @ b[w]).reshape(N, T, KV, -1), H // KV, axis=2) for w in ("wk", "wv"))
        a = jax.nn.softmax(jnp.where(mask, jnp.einsum("bthd,bshd->bhts", q, k), -1e9), -1)
        x = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(N, T, D) @ b["wo"]
        x = x + (jax.nn.silu(x @ b["w1"]) * (x @ b["w3"])) @ b["w2"]
    lg = x @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(lg[:, :-1], tok[:, 1:]).mean()


def _step(opt):
    def step(p, s, tok):
        loss, g = jax.value_and_grad(_loss)(p, tok)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step


@pytest.mark.slow
def test_a_clipped_step_is_proven_and_adds_one_reduction(pl24):
    r = np.random.default_rng(0)
    params, tok = _params(r), r.integers(0, V, (N, T)).astype(np.int32)
    col, row, rep = (B, S1), (B, S0), (B, B)
    ps = {
        "emb": rep,
        "blocks": [
            {"g": rep, "wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w3": col, "w2": row}
            for _ in range(L)
        ],
    }
    moved = {}
    # eps=1e-3: Adam's first step divides each gradient by its own size, which
    # turns summation-order differences in near-zero gradients into whole
    # steps; a larger eps keeps the update a smooth function of the gradient
    for name, opt in [
        ("plain", optax.adamw(1e-3, eps=1e-3)),
        ("clipped", optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-3))),
    ]:
        state = opt.init(params)
        ss = state_sbp(state, ps, rep)
        f = sj.jit(_step(opt), placement=pl24, in_sbp=(ps, ss, (S0, B)), out_sbp=(ps, ss, rep))
        e = f.explain(params, state, tok)
        assert e.choice.gap == 0.0, (name, e.choice.gap)
        moved[name] = e.bytes
        if name == "clipped":
            got = jax.tree.map(
                lambda t: t.numpy(), f(params, state, tok), is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
            )
            want = jax.jit(_step(opt))(params, state, tok)
            for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(g_, w_, rtol=2e-4, atol=2e-5 * max(1.0, float(np.abs(w_).max())))
    # at most one all-reduce of the summed squared norm over all 8 devices: 2 (8 - 1) 4 bytes
    assert moved["clipped"] <= moved["plain"] + 2 * 7 * 4, moved


def test_a_data_parallel_clip_adds_no_collective(pl8):
    """Data parallelism: every gradient is all-reduced whole for the
    replicated parameters, so each squared norm is a sum of whole values and
    the global norm is computed whole on every device, as GSPMD does: the clip
    adds no collective and no byte to the unclipped step (the sum of scalars
    once had to be a partial sum, and one dependent all-reduce of 4 bytes
    followed the gradients' in every such step; held-out sweep)."""
    r = np.random.default_rng(1)
    params = {
        "w1": (r.normal(size=(16, 32)) / 4).astype(np.float32),
        "b1": np.zeros(32, np.float32),
        "w2": (r.normal(size=(32, 4)) / 6).astype(np.float32),
    }
    x, y = r.normal(size=(64, 16)).astype(np.float32), r.normal(size=(64, 4)).astype(np.float32)

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    counts, moved = {}, {}
    for name, opt in [
        ("plain", optax.sgd(0.1)),
        ("clipped", optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1))),
    ]:

        def step(p, s, x, y, opt=opt):
            g = jax.grad(loss)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        state = opt.init(params)
        ps = jax.tree.map(lambda _: (B,), params)
        ss = jax.tree.map(lambda _: (B,), state)
        f = sj.jit(step, placement=pl8, in_sbp=(ps, ss, (S0,), (S0,)), out_sbp=(ps, ss))
        compiled = f.lower(params, state, x, y).compile()
        counts[name] = len(sj.collectives(compiled))
        moved[name] = moved_bytes(f, params, state, x, y)
        assert moved[name] == f.explain(params, state, x, y).bytes
        got = jax.tree.leaves(
            jax.tree.map(
                lambda t: t.numpy(), f(params, state, x, y), is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
            )
        )
        for g_, w_ in zip(got, jax.tree.leaves(jax.jit(step)(params, state, x, y))):
            assert_close(g_, np.asarray(w_), rtol=1e-5)
        if name == "clipped":
            assert moved[name] <= gspmd_bytes(
                step, pl8, (ps, ss, (S0,), (S0,)), (ps, ss), (params, state, x, y)
            )
    assert counts["clipped"] == counts["plain"] and moved["clipped"] == moved["plain"], (counts, moved)
