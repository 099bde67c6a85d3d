"""A Llama-style step whose head is the tied embedding, read transposed
(``x @ emb.T``). The replicated table seen through a transpose is still a
weight the caller left whole on the tensor axis (``Domains.weights``), so the
head may run whole there, on the residual stream Megatron keeps whole, as
GSPMD runs it. Without that, the only heads left in the layout choice's space
split the batch over the tensor axis too, and the last block's MLP moved to
that layout by all-to-alls and gathered its kernels: 16,192,568 B against
GSPMD's 15,216,672 B on this step (now 9,501,728 B)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import assert_close, gspmd_bytes

import sbpjax as sj
from sbpjax.compiler.api import state_sbp

S0, S1, B = sj.S(0), sj.S(1), sj.B
V, D, T, N = 256, 128, 64, 8


def _rms(x, g):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g


def _rope(x):
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(half) / half))
    c, s = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    return jnp.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., :half] * s + x[..., half:] * c], -1)


def _loss(p, tok):
    """RMSNorm, RoPE, 8 query heads over 2 key/value heads, SwiGLU, a tied head."""
    x = p["emb"][tok]
    h = _rms(x, p["g1"])
    q = _rope((h @ p["wq"]).reshape(N, T, 8, 16))
    k = jnp.repeat(_rope((h @ p["wk"]).reshape(N, T, 2, 16)), 4, axis=2)
    v = jnp.repeat((h @ p["wv"]).reshape(N, T, 2, 16), 4, axis=2)
    mask = jnp.tril(jnp.ones((T, T), bool))
    a = jax.nn.softmax(jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1e9), -1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(N, T, D) @ p["wo"]
    h = _rms(x, p["g2"])
    x = x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
    logits = _rms(x, p["gf"]) @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tok[:, 1:]).mean()


# eps=1e-3: Adam's first step divides each gradient by its own size, which
# turns summation-order differences in near-zero gradients into whole steps
OPT = optax.adamw(1e-3, eps=1e-3)


def _step(p, s, tok):
    loss, g = jax.value_and_grad(_loss)(p, tok)
    u, s = OPT.update(g, s, p)
    return optax.apply_updates(p, u), s, loss


def test_a_tied_head_runs_whole_on_the_tensor_axis_as_gspmd_runs_it(pl24):
    r = np.random.default_rng(0)
    nrm = lambda *s: (r.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    params = {"emb": nrm(V, D), "wq": nrm(D, D), "wk": nrm(D, 32), "wv": nrm(D, 32), "wo": nrm(D, D)}
    params |= {"w1": nrm(D, 3 * D), "w3": nrm(D, 3 * D), "w2": nrm(3 * D, D)}
    params |= {g: np.ones(D, np.float32) for g in ("g1", "g2", "gf")}
    tok = r.integers(0, V, (N, T)).astype(np.int32)
    col, row, rep = (B, S1), (B, S0), (B, B)
    ps = {"emb": rep, "wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w3": col, "w2": row}
    ps |= {g: rep for g in ("g1", "g2", "gf")}
    state = OPT.init(params)
    ss = state_sbp(state, ps, rep)
    in_sbp, out_sbp = (ps, ss, (S0, B)), (ps, ss, rep)
    f = sj.jit(_step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp)

    got = jax.tree.map(
        lambda t: t.numpy(), f(params, state, tok), is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
    )
    want = jax.jit(_step)(params, state, tok)
    for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g_, w_, rtol=2e-4)

    ours = sum(c.bytes for c in sj.collectives(f.lower(params, state, tok).compile()))
    theirs = gspmd_bytes(_step, pl24, in_sbp, out_sbp, (params, state, tok))
    assert ours <= theirs, (ours, theirs)
