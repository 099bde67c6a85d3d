"""Small models for compiler tests: an MLP and a transformer block, trained with
optax AdamW; and helpers that give optimizer states their parameter's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sbpjax.compiler.api import is_nd_sbp, state_sbp  # noqa: F401 - re-exported for the tests

D, H, HEADS, T, BATCH, VOCAB = 16, 32, 4, 8, 8, 32


def mlp_params(seed=0):
    r = np.random.default_rng(seed)
    return {"w1": (r.normal(size=(D, H)) / 4).astype(np.float32),
            "w2": (r.normal(size=(H, D)) / 6).astype(np.float32)}


def mlp_loss(p, x, y):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def block_params(seed=0):
    r = np.random.default_rng(seed)
    n = lambda *s: (r.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    return {"wq": n(D, D), "wk": n(D, D), "wv": n(D, D), "wo": n(D, D), "w1": n(D, H), "w2": n(H, D),
            "g": np.ones((D,), np.float32), "emb": n(VOCAB, D), "head": n(D, VOCAB)}


def layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g


def block_loss(p, tokens, labels):
    x = p["emb"][tokens]  # (B, T, D)
    h = layernorm(x, p["g"])
    b, t, _ = h.shape
    q = (h @ p["wq"]).reshape(b, t, HEADS, D // HEADS)
    k = (h @ p["wk"]).reshape(b, t, HEADS, D // HEADS)
    v = (h @ p["wv"]).reshape(b, t, HEADS, D // HEADS)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, D)
    x = x + o @ p["wo"]
    x = x + jax.nn.gelu(layernorm(x, p["g"]) @ p["w1"]) @ p["w2"]
    logits = x @ p["head"]
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def train_step(loss_fn, opt):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss
    return step


def adamw():
    return optax.adamw(1e-2, weight_decay=0.1)
