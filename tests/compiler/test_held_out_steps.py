"""Train steps written apart from the rules, tests and benchmarks (a held-out
check of 2026-12-04), kept as regression cases for op mixes nothing else here
covers: LoRA (frozen tensor-parallel kernels beside trainable low-rank ones,
the optimizer over the adapters alone), a T5-style encoder-decoder (cross
attention over the encoder's output, a tied head scaled by ``D**-0.5``, a
weight-decay mask), a VAE with 2-D kernels on 4x2 (a reparameterization
drawn from a key passed in, a clipped Adam), CLIP's two towers on 2x4
(a contrastive loss over the global batch), a Perceiver's latent block
over a sequence-split input and a scanned decoder with FSDP and tensor
parallelism on a small batch. Each step's new parameters,
state and loss equal the one-device step's, and the compiled collectives
move no more bytes than GSPMD's program with the same layouts.

Adam's ``eps`` is 1e-3 here: its first step divides each gradient by its own
size, which turns summation-order differences in gradients near zero (a
bias of order 1e-8) into whole steps of the learning rate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import checked_step_bytes, gspmd_bytes

import sbpjax as sj
from sbpjax.compiler.api import state_sbp

S0, S1, B = sj.S(0), sj.S(1), sj.B
COL, ROW, REP = (B, S1), (B, S0), (B, B)
rng = np.random.default_rng(4)


def _normal(*shape, fan=None):
    return (rng.normal(size=shape) / np.sqrt(fan or shape[0])).astype(np.float32)


def _norm(x, g):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def _rms(x, g):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g


def _step(loss, opt):
    def step(p, s, *data):
        value, g = jax.value_and_grad(loss)(p, *data)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    return step


# -- LoRA: the base kernels frozen and tensor-parallel, the adapters trained --
D, H, R = 128, 512, 8


def _lora_loss(lora, base, x, y):
    for b, a in zip(base["layers"], lora["layers"]):
        h = _norm(x, b["g"])
        u = jax.nn.gelu(h @ b["w1"] + 2.0 * (h @ a["a1"]) @ a["b1"])
        x = x + u @ b["w2"] + 2.0 * (u @ a["a2"]) @ a["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(x.mean(1) @ base["head"], y).mean()


def _lora_case():
    base = {
        "layers": [{"w1": _normal(D, H), "w2": _normal(H, D), "g": np.ones(D, np.float32)} for _ in range(2)],
        "head": _normal(D, 10),
    }
    lora = {
        "layers": [
            {"a1": _normal(D, R), "b1": 0.01 * _normal(R, H), "a2": _normal(H, R), "b2": 0.01 * _normal(R, D)}
            for _ in range(2)
        ]
    }
    base_sbp = {"layers": [{"w1": COL, "w2": ROW, "g": REP} for _ in range(2)], "head": REP}
    lora_sbp = {"layers": [{"a1": REP, "b1": COL, "a2": ROW, "b2": REP} for _ in range(2)]}
    data = (base, rng.normal(size=(16, 32, D)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32))
    opt = optax.adamw(1e-3, eps=1e-3, weight_decay=0.01)
    return _lora_loss, opt, lora, lora_sbp, data, (base_sbp, (S0, B), (S0, B)), (2, 4)


# -- T5: encoder, decoder with cross attention, a tied head scaled by D**-0.5 --
V, HEADS, TE, TD = 256, 8, 32, 16


def _attention(p, xq, xkv, mask=None):
    b, tq, tk = xq.shape[0], xq.shape[1], xkv.shape[1]
    q = (xq @ p["q"]).reshape(b, tq, HEADS, -1)
    k = (xkv @ p["k"]).reshape(b, tk, HEADS, -1)
    v = (xkv @ p["v"]).reshape(b, tk, HEADS, -1)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if mask is not None:
        s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, tq, D) @ p["o"]


def _t5_loss(p, src, tgt):
    e, d = p["enc"], p["dec"]
    x = p["emb"][src]
    h = _rms(x, e["n1"])
    x = x + _attention(e["sa"], h, h)
    x = x + jax.nn.relu(_rms(x, e["n2"]) @ e["wi"]) @ e["wo"]
    memory = _rms(x, e["nf"])
    y = p["emb"][tgt[:, :-1]]
    h = _rms(y, d["n1"])
    y = y + _attention(d["sa"], h, h, jnp.tril(jnp.ones((TD, TD), bool)))
    y = y + _attention(d["ca"], _rms(y, d["n2"]), memory)
    y = y + jax.nn.relu(_rms(y, d["n3"]) @ d["wi"]) @ d["wo"]
    logits = (_rms(y, d["nf"]) * D**-0.5) @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:]).mean()


def _t5_case():
    def attention():
        return {w: _normal(D, D) for w in "qkvo"}, {"q": COL, "k": COL, "v": COL, "o": ROW}

    ones = lambda: np.ones(D, np.float32)  # noqa: E731
    (esa, esa_sbp), (dsa, dsa_sbp), (dca, dca_sbp) = attention(), attention(), attention()
    enc = {"n1": ones(), "sa": esa, "n2": ones(), "wi": _normal(D, H), "wo": _normal(H, D), "nf": ones()}
    dec = {
        "n1": ones(),
        "sa": dsa,
        "n2": ones(),
        "ca": dca,
        "n3": ones(),
        "wi": _normal(D, H),
        "wo": _normal(H, D),
    }
    dec["nf"] = ones()
    params = {"emb": _normal(V, D, fan=1), "enc": enc, "dec": dec}
    enc_sbp = {"n1": REP, "sa": esa_sbp, "n2": REP, "wi": COL, "wo": ROW, "nf": REP}
    dec_sbp = {"n1": REP, "sa": dsa_sbp, "n2": REP, "ca": dca_sbp, "n3": REP, "wi": COL, "wo": ROW, "nf": REP}
    sbp = {"emb": REP, "enc": enc_sbp, "dec": dec_sbp}
    opt = optax.adamw(1e-3, eps=1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p))
    data = (rng.integers(0, V, (8, TE)).astype(np.int32), rng.integers(0, V, (8, TD + 1)).astype(np.int32))
    return _t5_loss, opt, params, sbp, data, ((S0, B), (S0, B)), (2, 4)


# -- VAE: 2-D kernels on 4x2, a reparameterization from a key passed in --
X, Z = 784, 32


def _vae_loss(p, x, key):
    h = jax.nn.relu(jax.nn.relu(x @ p["e1"] + p["e1b"]) @ p["e2"])
    mu, logvar = h @ p["mu"], h @ p["lv"]
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(jax.random.wrap_key_data(key), mu.shape)
    logits = jax.nn.relu(jax.nn.relu(z @ p["d1"]) @ p["d2"]) @ p["d3"] + p["d3b"]
    reconstruction = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - jnp.exp(logvar)).sum(-1)
    return (reconstruction + kl).mean()


def _vae_case():
    params = {"e1": _normal(X, H), "e1b": np.zeros(H, np.float32), "e2": _normal(H, H), "mu": _normal(H, Z)}
    params |= {"lv": 0.1 * _normal(H, Z), "d1": _normal(Z, H), "d2": _normal(H, H), "d3": _normal(H, X)}
    params["d3b"] = np.zeros(X, np.float32)
    sbp = {k: (S0, S1) if v.ndim == 2 else REP for k, v in params.items()}
    key = np.asarray(jax.random.key_data(jax.random.key(7)))
    data = ((rng.random((64, X)) > 0.5).astype(np.float32), key)
    opt = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(1e-3, eps=1e-3))
    return _vae_loss, opt, params, sbp, data, ((S0, B), REP), (4, 2)


# -- CLIP: two towers, a contrastive loss over the global batch, 2x4 --
def _l2n(z):
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def _clip_loss(p, img, txt):
    zi = _l2n((jax.nn.relu(img @ p["img"]["w1"] + p["img"]["b1"]) @ p["img"]["w2"]) @ p["img"]["proj"])
    zt = _l2n(jnp.tanh(p["txt"]["emb"][txt].mean(1) @ p["txt"]["w1"]) @ p["txt"]["proj"])
    logits = jnp.exp(p["scale"]) * zi @ zt.T
    labels = jnp.arange(logits.shape[0])
    forward = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    backward = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    return (forward + backward) / 2


def _clip_case():
    """The text tower's kernel gradient reads the token means as its forward
    product gathered them (``Domains.product_reads``): 1.24x GSPMD's bytes
    before, when it regathered them split over both axes instead."""
    n, v, d, e = 192, 512, 128, 64
    params = {
        "img": {
            "w1": _normal(n, d),
            "b1": np.zeros(d, np.float32),
            "w2": _normal(d, d),
            "proj": _normal(d, e),
        },
        "txt": {"emb": _normal(v, d), "w1": _normal(d, d), "proj": _normal(d, e)},
        "scale": np.float32(np.log(1 / 0.07)),
    }
    sbp = jax.tree.map(lambda _: REP, params)
    sbp["img"] |= {"w1": COL, "b1": (B, S0), "w2": ROW}
    sbp["txt"] |= {"emb": COL, "w1": COL, "proj": ROW}
    data = (rng.normal(size=(32, n)).astype(np.float32), rng.integers(0, v, (32, 16)).astype(np.int32))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9))
    return _clip_loss, opt, params, sbp, data, ((S0, B), (S0, B)), (2, 4)


# -- Perceiver: a learned latent array over a sequence-split input, 2x4 --
def _perceiver_loss(p, x):
    def attend(scores, v):
        return jnp.einsum("bnm,bmd->bnd", jax.nn.softmax(scores / 8.0, -1), v)

    h = attend(jnp.einsum("nd,bmd->bnm", p["lat"], x @ p["wk"]), x @ p["wv"])
    h = h + attend(jnp.einsum("bnd,bmd->bnm", h @ p["wq"], h @ p["wk2"]), h @ p["wv2"]) @ p["wo"]
    h = h + jax.nn.gelu(h @ p["fc1"]) @ p["fc2"]
    return (h**2).mean()


def _perceiver_case():
    """The latent block runs whole on the sequence's axis, as GSPMD runs it
    (``Domains.whole_derived``): its weights' gradients are then reduced
    over the batch's axis alone. Before, the latents were reduce-scattered
    onto the batch over y and every latent-block gradient was reduced over
    all 8 devices: 1.11x GSPMD's bytes."""
    params = {k: _normal(64, 64) for k in ("wk", "wv", "wq", "wk2", "wv2", "wo")}
    params |= {"lat": _normal(16, 64, fan=1), "fc1": _normal(64, 256), "fc2": _normal(256, 64)}
    sbp = jax.tree.map(lambda _: REP, params)
    data = (rng.normal(size=(8, 128, 64)).astype(np.float32),)
    return _perceiver_loss, optax.sgd(1e-2), params, sbp, data, ((S0, S1),), (2, 4)


# -- a scanned decoder with FSDP and tensor parallelism (MaxText's layouts), 2x4 --
def _scanned_loss(p, tokens, labels):
    x = p["emb"][tokens]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))

    def layer(x, w):
        h = _norm(x, w["g1"])
        q, k, v = ((h @ w[n]).reshape(b, t, 8, d // 8) for n in ("wq", "wk", "wv"))
        s = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 8), -1e9)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d) @ w["wo"]
        return x + jax.nn.gelu(_norm(x, w["g2"]) @ w["w1"]) @ w["w2"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    lp = jax.nn.log_softmax(x @ p["head"], -1)
    return -jnp.take_along_axis(lp, labels[..., None], -1).mean()


def _scanned_fsdp_tp_case():
    """The layer stack split along the model width over x (FSDP) and along
    the heads and the MLP over y, on a batch of 16: GSPMD keeps the weights
    where they are and runs the residual stream split along its width.
    Before, the second layer ran in the layouts the first layer's end made
    (a scan's later iteration could not read its carry as the first did,
    ``Domains._uses``) and the embedding lookup could only split its ids
    over y (``reachable.ids_whole``): 1.20x GSPMD's bytes. Then the second
    layer's layernorm could not slice its scale to the residual stream's
    split (``reachable.local_slices``): 0.99x; the layers' kernels, slices of
    the stack, were not gathered over x as an unrolled model's are, nor the
    embedding table (``reachable.table_gathered``): 0.80x. Now 0.50x: the
    batch split over x, FSDP's gathers, tensor parallelism over y
    (``BELOW_GSPMD``)."""
    L, d = 2, 64
    layers = {n: _normal(L, d, d, fan=d) for n in ("wq", "wk", "wv", "wo")}
    layers |= {"w1": _normal(L, d, 4 * d, fan=d), "w2": _normal(L, 4 * d, d, fan=4 * d)}
    layers |= {"g1": np.ones((L, d), np.float32), "g2": np.ones((L, d), np.float32)}
    params = {"emb": _normal(64, d), "layers": layers, "head": _normal(d, 64)}
    col, row = (sj.S(1), sj.S(2)), (sj.S(2), sj.S(1))
    sbp = {
        "emb": (S1, B),
        "layers": {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row, "g1": REP, "g2": REP},
        "head": (S0, S1),
    }
    data = tuple(rng.integers(0, 64, (16, 16)).astype(np.int32) for _ in range(2))
    opt = optax.adamw(1e-3, eps=1e-3, weight_decay=0.1)
    return _scanned_loss, opt, params, sbp, data, ((S0, B), (S0, B)), (2, 4)


CASES = {
    "lora": _lora_case,
    "t5": _t5_case,
    "vae_2d": _vae_case,
    "clip": _clip_case,
    "perceiver": _perceiver_case,
    "scanned_fsdp_tp": _scanned_fsdp_tp_case,
}


# cases whose plan is well below GSPMD's bytes (ours / GSPMD's at most): a
# bound with room (the plan moves 0.50x on jax 0.10.2, 0.49x on 0.12) that
# the plans before its widenings (0.99x, 0.80x, 0.64x, one by one) do not meet
BELOW_GSPMD = {"scanned_fsdp_tp": 0.6}


# the scanned FSDP case is a wide graph (449 nodes, hubs of up to 58 layouts):
# no exact elimination fits, and the solver's relaxation proves its plan (about
# 7 s with three XLA compiles, as the T5 case; 15-20 s when a heuristic search
# chose it)
@pytest.mark.parametrize("name", list(CASES))
def test_held_out_step(name):
    loss, opt, params, sbp, data, data_sbp, grid = CASES[name]()
    state = opt.init(params)
    state_layouts = state_sbp(state, sbp, REP)
    in_sbp, out_sbp = (sbp, state_layouts, *data_sbp), (sbp, state_layouts, REP)
    step = _step(loss, opt)
    pl = sj.placement(grid, ("x", "y"))
    f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp)
    args = (params, state, *data)

    ours = checked_step_bytes(f, step, args, rtol=2e-4, err_msg=name)
    assert ours <= BELOW_GSPMD.get(name, 1.0) * gspmd_bytes(step, pl, in_sbp, out_sbp, args), name
