"""Small models for compiler tests: an MLP and a transformer block, trained with
optax AdamW; and helpers that give optimizer states their parameter's layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sbpjax as sj
from sbpjax.compiler.api import is_nd_sbp, state_sbp  # noqa: F401 - re-exported for the tests

S0_, S1_, B_ = sj.S(0), sj.S(1), sj.B

D, H, HEADS, T, BATCH, VOCAB = 16, 32, 4, 8, 8, 32


def mlp_params(seed=0):
    r = np.random.default_rng(seed)
    return {
        "w1": (r.normal(size=(D, H)) / 4).astype(np.float32),
        "w2": (r.normal(size=(H, D)) / 6).astype(np.float32),
    }


def mlp_loss(p, x, y):
    h = jax.nn.gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def block_params(seed=0):
    r = np.random.default_rng(seed)
    n = lambda *s: (r.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    return {
        "wq": n(D, D),
        "wk": n(D, D),
        "wv": n(D, D),
        "wo": n(D, D),
        "w1": n(D, H),
        "w2": n(H, D),
        "g": np.ones((D,), np.float32),
        "emb": n(VOCAB, D),
        "head": n(D, VOCAB),
    }


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


# ---------------------------------------------------------------------------
# Parameterized GPT and MLP train steps (the whole-program choice's sweep)
# ---------------------------------------------------------------------------


def gpt_params(d, layers, vocab, hidden=None, seed=0):
    """A GPT of ``layers`` pre-norm blocks (attention + GELU MLP), tied to nothing."""
    r = np.random.default_rng(seed)
    hidden = hidden or 4 * d
    n = lambda *s: (r.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    blocks = [
        {
            "wq": n(d, d),
            "wk": n(d, d),
            "wv": n(d, d),
            "wo": n(d, d),
            "w1": n(d, hidden),
            "w2": n(hidden, d),
            "g1": np.ones((d,), np.float32),
            "g2": np.ones((d,), np.float32),
        }
        for _ in range(layers)
    ]
    return {"emb": n(vocab, d), "blocks": blocks, "head": n(d, vocab)}


def gpt_loss(p, tokens, labels, heads):
    x = p["emb"][tokens]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in p["blocks"]:
        h = layernorm(x, blk["g1"])
        q, k, v = ((h @ blk[w]).reshape(b, t, heads, d // heads) for w in ("wq", "wk", "wv"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ blk["wo"]
        x = x + jax.nn.gelu(layernorm(x, blk["g2"]) @ blk["w1"]) @ blk["w2"]
    lp = jax.nn.log_softmax(x @ p["head"], axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def gpt_sbp(params, kind, n_axes):
    """Layouts of a GPT's parameters: "dp" (all B), "megatron" (column-split
    q/k/v/w1/head and row-split wo/w2 over the last axis, the rest B)."""
    rep = (B_,) * n_axes
    col, row = rep[:-1] + (S1_,), rep[:-1] + (S0_,)
    if kind == "dp":
        return jax.tree.map(lambda _: rep, params)
    blk = {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row, "g1": rep, "g2": rep}
    return {"emb": rep, "blocks": [dict(blk) for _ in params["blocks"]], "head": col}


def deep_mlp_params(d, layers, seed=0):
    r = np.random.default_rng(seed)
    return {f"w{i}": (r.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32) for i in range(2 * layers)}


def deep_mlp_loss(p, x, y):
    h = x
    for i in range(len(p) // 2):
        h = h + jax.nn.gelu(h @ p[f"w{2 * i}"]) @ p[f"w{2 * i + 1}"]
    return jnp.mean((h - y) ** 2)


def deep_mlp_sbp(params, kind, n_axes):
    rep = (B_,) * n_axes
    if kind == "dp":
        return {k: rep for k in params}
    return {k: rep[:-1] + ((S1_,) if int(k[1:]) % 2 == 0 else (S0_,)) for k in params}


# ---------------------------------------------------------------------------
# Checking a train step against one device
# ---------------------------------------------------------------------------


def compiled_bytes(f, *args) -> int:
    """Bytes the collectives of ``f``'s compiled program move (``sj.collectives``)."""
    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def check_train(loss_fn, params, x, y, pl, param_sbp, x_sbp, y_sbp, opt=None, steps=2, options=None):
    """``steps`` sj.jit train steps (``opt``, AdamW by default) against jax.jit's
    on one device, every parameter and loss compared; the plan's bytes equal
    the compiled program's. Returns the sj.jit step and its explain()."""
    from conftest import assert_close

    opt = opt or adamw()
    step = train_step(loss_fn, opt)
    state = opt.init(params)
    rep = (B_,) * pl.ndim
    st_sbp = state_sbp(state, param_sbp, rep)
    f = sj.jit(
        step,
        placement=pl,
        in_sbp=(param_sbp, st_sbp, x_sbp, y_sbp),
        out_sbp=(param_sbp, st_sbp, rep),
        options=options,
    )
    ref = jax.jit(step)
    p_ref, s_ref = params, state
    p_sj, s_sj = params, state
    for _ in range(steps):
        p_ref, s_ref, l_ref = ref(p_ref, s_ref, x, y)
        p_sj, s_sj, l_sj = f(p_sj, s_sj, x, y)
        assert_close(l_sj.numpy(), l_ref, rtol=2e-5)
        got = jax.tree_util.tree_leaves_with_path(p_sj, is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
        for (path, a), b in zip(got, jax.tree_util.tree_leaves(p_ref)):
            assert_close(a.numpy(), np.asarray(b), rtol=2e-4, err_msg=jax.tree_util.keystr(path))
    args = (params, state, x, y)
    e = f.explain(*args)
    assert compiled_bytes(f, *args) == e.bytes
    return f, e
