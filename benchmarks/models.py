"""Model zoo benchmark: real-model train steps by sbpjax against GSPMD and one device.

    python benchmarks/models.py            # default sizes (several minutes on 8 CPU devices)
    python benchmarks/models.py --quick    # small sizes, same fields, every model

Each model's train step (loss, gradients by ``jax.value_and_grad`` and an optax
update; SGD with momentum, so that the values can be checked: Adam turns
rounding noise in a near-zero gradient into +-lr) is compiled three ways:

* ``sj.jit(step, placement=..., in_sbp=..., out_sbp=...)``;
* GSPMD: ``jax.jit`` of the same step given the NamedShardings those layouts
  stand for (``spec_of``), for inputs and outputs;
* one device: ``jax.jit(step)``, the reference.

Models:

1. ``decoder_scan``: a MaxText-style decoder (token embedding, pre-norm
   attention + MLP blocks, LM head) with Megatron layouts on a 2x4 (data x
   tensor) placement; the layers' parameters are stacked (leading dim L,
   unsplit) and run under ``jax.lax.scan`` with ``jax.checkpoint`` on the
   layer body.
2. ``decoder_unrolled``: the same decoder with the layers as a Python loop over
   a list of per-layer parameters (``jax.checkpoint`` on each layer too).
3. ``resnet_bn``: a small ResNet-like CNN (``lax.conv_general_dilated``, NHWC)
   with training-mode BatchNorm (batch statistics; running statistics are an
   output), data parallel on 8x1 (the batch S(0), everything else B).
4. ``resnet_bn_height``: the same CNN on 2x4 with the images split along
   the batch over the first axis and along height over the second (spatial
   parallelism: convolutions exchange halos, BatchNorm's statistics are
   partial sums over the pieces).
5. ``moe``: a mixture-of-experts layer (softmax router, top-k by ``lax.top_k``,
   GShard-style capacity-limited einsum dispatch and combine) with expert
   parallelism on 2x4: the batch over the first axis, the experts' weights
   split on their expert dim over the second.
6. ``vit``: a small ViT (patch embedding by reshape + matmul, learned position
   embedding, non-causal blocks, mean pool, classifier) with 2-D layouts on 2x4
   (batch over the first axis, Megatron over the second). Its plan all-gathers
   the blocks' weights (FSDP style) and, by ``sj.jit``'s default
   ``regather="auto"``, gathers the largest again for the backward pass
   rather than holding them across the memory peak
   (``sbpjax.compiler.regather``).
7. ``linen_mlp``: a ``flax.linen`` MLP (Dense + LayerNorm) whose kernels carry
   ``sjf.linen.with_sbp`` annotations (column / row Megatron on 2x4); its
   layouts are read with ``sjf.linen.get_sbp``.

Per model (row fields):

* ``max_error`` / ``gspmd_max_error``: the largest, over the step's outputs
  (new parameters, optimizer state, loss, extra outputs), of
  ``max|got - ref| / max|ref|`` against the single-device step;
* ``sbpjax_bytes`` / ``gspmd_bytes``: bytes the collectives of each compiled
  program move per step (``sj.collectives``), ``sbpjax_explained_bytes`` the
  plan's (``explain().bytes``);
* ``sbpjax_peak_bytes`` / ``gspmd_peak_bytes``: per-device memory of the
  compiled program from ``compiled.memory_analysis()``:
  ``argument_size + output_size + temp_size - alias_size`` (the detail is in
  ``*_memory``); neither program donates; ``estimated_peak_bytes``: the
  plan's own estimate of that peak (``explain().estimated_peak_bytes``), and
  ``estimated_over_measured_peak`` its ratio to ``sbpjax_peak_bytes``;
* ``sbpjax_flops`` / ``gspmd_flops``: per-device FLOPs of each compiled
  program by XLA's ``cost_analysis()`` (a loop's body counted once, as XLA
  counts it: a scanned model's figures are per iteration of its loops, plus
  whatever runs outside them); ``sbpjax_loop_flops`` / ``gspmd_loop_flops``:
  the matmuls' and convolutions' FLOPs per device with each loop counted as
  often as it runs (``_hlo_flops.loop_flops``), and ``flops_ratio_vs_gspmd``
  their ratio: by XLA's count, a plan that writes a scan's first iteration
  out of the loop would be charged that iteration again;
* ``sbpjax_while_loops`` / ``gspmd_while_loops``: loops in each compiled
  program (a scanned model's forward and backward loops are kept);
* ``sbpjax_compile_s`` (trace + layout choice + lowering + XLA) and
  ``gspmd_compile_s`` (lowering + XLA);
* ``sbp_warnings``: SBPWarnings raised while sbpjax compiles the step
  (``warnings.catch_warnings(record=True)``), their first messages in
  ``sbp_warning_messages``.

A model that fails is recorded with ``error`` (the exception's text) and the run
goes on. Targets: 0 warnings, bytes <= GSPMD, memory <= GSPMD + 5%, FLOPs <= GSPMD + 2%.
Writes ``benchmarks/results/models.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _devices.py, also when imported
from _devices import simulate_devices  # noqa: E402
from _hlo_flops import loop_flops  # noqa: E402

simulate_devices(8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from compiler import collective_bytes, memory, spec_of  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.flax as sjf  # noqa: E402
from sbpjax.compiler.api import state_sbp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
S0, S1, S2, B = sj.S(0), sj.S(1), sj.S(2), sj.B
REP = (B, B)
MODELS = [
    "decoder_scan",
    "decoder_unrolled",
    "resnet_bn",
    "resnet_bn_height",
    "moe",
    "vit",
    "linen_mlp",
]


def _is_gt(v):
    return isinstance(v, sj.GlobalTensor)


def sgd():
    return optax.sgd(0.1, momentum=0.9)


def train_step(loss_fn, opt, has_aux=False):
    """``step(params, opt_state, *batch) -> (params, opt_state, loss[, aux])``."""

    def step(params, opt_state, *batch):
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if has_aux:
            loss, aux = out
            return params, opt_state, loss, aux
        return params, opt_state, out

    return step


def nrm(rng, *shape, fan_in=None):
    return (rng.normal(size=shape) / np.sqrt(fan_in or shape[0])).astype(np.float32)


def layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g


def gelu(x):
    return jax.nn.gelu(x, approximate=True)


def xent(logits, labels):
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def attention_block(x, p, heads, causal):
    b, t, _ = x.shape
    h = layernorm(x, p["g1"])
    q, k, v = ((h @ p[w]).reshape(b, t, heads, -1) for w in ("wq", "wk", "wv"))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    att = jax.nn.softmax(att, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ p["wo"]
    return x + gelu(layernorm(x, p["g2"]) @ p["w1"]) @ p["w2"]


def block_params(rng, d, hid):
    return {
        "g1": np.ones((d,), np.float32),
        "wq": nrm(rng, d, d),
        "wk": nrm(rng, d, d),
        "wv": nrm(rng, d, d),
        "wo": nrm(rng, d, d),
        "g2": np.ones((d,), np.float32),
        "w1": nrm(rng, d, hid),
        "w2": nrm(rng, hid, d),
    }


# Megatron on the second placement axis: column-split q/k/v/w1, row-split wo/w2
MEGATRON = {
    "g1": REP,
    "wq": (B, S1),
    "wk": (B, S1),
    "wv": (B, S1),
    "wo": (B, S0),
    "g2": REP,
    "w1": (B, S1),
    "w2": (B, S0),
}


def stacked_sbp(nd):
    """The layout of a parameter stacked on a new leading dim (that dim unsplit)."""
    return tuple(sj.S(s.dim + 1) if isinstance(s, sj.Split) else s for s in nd)


# ---------------------------------------------------------------------------
# Models: each returns a spec dict
#   step, args (params, opt_state, *batch), in_sbp, out_sbp, placement
# ---------------------------------------------------------------------------


def decoder(cfg, rng, scanned):
    vocab, seq, d, heads, layers, batch = (
        cfg[k] for k in ("vocab", "seq", "d_model", "heads", "layers", "batch")
    )
    pl = sj.placement((2, 4), ("x", "y"))
    blocks = [block_params(rng, d, 4 * d) for _ in range(layers)]
    params = {
        "emb": nrm(rng, vocab, d, fan_in=d),
        "gf": np.ones((d,), np.float32),
        "head": nrm(rng, d, vocab),
    }
    ps = {"emb": REP, "gf": REP, "head": (B, S1)}
    if scanned:
        params["layers"] = {k: np.stack([b[k] for b in blocks]) for k in blocks[0]}
        ps["layers"] = {k: stacked_sbp(v) for k, v in MEGATRON.items()}
    else:
        params["layers"] = blocks
        ps["layers"] = [dict(MEGATRON) for _ in blocks]
    layer = jax.checkpoint(lambda x, p: attention_block(x, p, heads, causal=True))

    def loss(p, tokens, labels):
        x = p["emb"][tokens]
        if scanned:
            x, _ = lax.scan(lambda x, lp: (layer(x, lp), None), x, p["layers"])
        else:
            for lp in p["layers"]:
                x = layer(x, lp)
        return xent(layernorm(x, p["gf"]) @ p["head"], labels)

    tokens = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    return functional(loss, params, ps, (tokens, labels), ((S0, B), (S0, B)), pl)


def functional(loss, params, ps, batch, batch_sbp, pl, has_aux=False, aux_sbp=None):
    opt = sgd()
    state = opt.init(params)
    rep = (B,) * pl.ndim
    ss = state_sbp(state, ps, rep)
    out_sbp = (ps, ss, rep) + ((aux_sbp,) if has_aux else ())
    return {
        "step": train_step(loss, opt, has_aux),
        "args": (params, state, *batch),
        "in_sbp": (ps, ss, *batch_sbp),
        "out_sbp": out_sbp,
        "placement": pl,
    }


def resnet(cfg, rng, height_split=False):
    """Data parallel on 8x1; with ``height_split``, the batch over 2 and image
    height over 4 (spatial parallelism for large images: convolutions run with
    halo exchanges, BatchNorm's statistics are partial sums over the pieces)."""
    n, hw, c, classes, blocks = (cfg[k] for k in ("batch", "image", "channels", "classes", "res_blocks"))
    pl = sj.placement((2, 4) if height_split else (8, 1), ("x", "y"))
    dn = ("NHWC", "HWIO", "NHWC")

    def conv(x, w, stride=1):
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=dn)

    def bn(x, p):
        mean = x.mean((0, 1, 2))
        var = ((x - mean) ** 2).mean((0, 1, 2))
        return (x - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"], (mean, var)

    def bn_params(ch):
        return {"scale": np.ones((ch,), np.float32), "bias": np.zeros((ch,), np.float32)}

    params = {"stem": nrm(rng, 3, 3, 3, c, fan_in=27), "stem_bn": bn_params(c), "blocks": []}
    for _ in range(blocks):
        params["blocks"].append(
            {
                "w1": nrm(rng, 3, 3, c, c, fan_in=9 * c),
                "bn1": bn_params(c),
                "w2": nrm(rng, 3, 3, c, c, fan_in=9 * c),
                "bn2": bn_params(c),
            }
        )
    params["head"] = nrm(rng, c, classes)
    params["head_b"] = np.zeros((classes,), np.float32)

    def loss(p, images, labels):
        stats = []
        x, st = bn(conv(images, p["stem"], 2), p["stem_bn"])
        stats.append(st)
        x = jax.nn.relu(x)
        for blk in p["blocks"]:
            h, st1 = bn(conv(x, blk["w1"]), blk["bn1"])
            h, st2 = bn(conv(jax.nn.relu(h), blk["w2"]), blk["bn2"])
            stats += [st1, st2]
            x = jax.nn.relu(x + h)
        logits = x.mean((1, 2)) @ p["head"] + p["head_b"]
        return xent(logits, labels), stats

    images = rng.normal(size=(n, hw, hw, 3)).astype(np.float32)
    labels = rng.integers(0, classes, size=(n,)).astype(np.int32)
    ps = jax.tree.map(lambda _: REP, params)
    image_sbp = (S0, sj.S(1)) if height_split else (S0, B)
    return functional(loss, params, ps, (images, labels), (image_sbp, (S0, B)), pl, has_aux=True, aux_sbp=REP)


def moe(cfg, rng):
    batch, seq, d, experts, k, hid = (
        cfg[x] for x in ("batch", "seq", "d_model", "experts", "top_k", "expert_hidden")
    )
    pl = sj.placement((2, 4), ("x", "y"))
    cap = max(1, int(np.ceil(seq * k / experts * 1.25)))  # capacity per expert per group
    params = {
        "router": nrm(rng, d, experts),
        "w1": nrm(rng, experts, d, hid, fan_in=d),
        "w2": nrm(rng, experts, hid, d, fan_in=hid),
        "g": np.ones((d,), np.float32),
    }
    ps = {"router": REP, "w1": (B, S0), "w2": (B, S0), "g": REP}

    def loss(p, x, target):
        h = layernorm(x, p["g"])  # (groups = batch rows, seq, d)
        probs = jax.nn.softmax(h @ p["router"], axis=-1)  # (g, s, e)
        gate, idx = lax.top_k(probs, k)  # (g, s, k)
        mask = jax.nn.one_hot(idx, experts, dtype=x.dtype)  # (g, s, k, e)
        # position of each (token, choice) in its expert's buffer: choices in order, then tokens
        flat = mask.transpose(0, 2, 1, 3).reshape(x.shape[0], k * x.shape[1], experts)
        pos = (jnp.cumsum(flat, axis=1) - 1.0) * flat
        pos = pos.reshape(x.shape[0], k, x.shape[1], experts).transpose(0, 2, 1, 3)
        keep = mask * (pos < cap)
        slot = jax.nn.one_hot(jnp.sum(pos * keep, -1).astype(jnp.int32), cap, dtype=x.dtype)  # (g, s, k, c)
        dispatch = lax.stop_gradient(jnp.einsum("gske,gskc->gsec", keep, slot))
        combine = jnp.einsum("gske,gskc,gsk->gsec", keep, slot, gate)
        xe = jnp.einsum("gsec,gsd->egcd", dispatch, h)
        he = gelu(jnp.einsum("egcd,edf->egcf", xe, p["w1"]))
        ye = jnp.einsum("egcf,efd->egcd", he, p["w2"])
        y = x + jnp.einsum("gsec,egcd->gsd", combine, ye)
        return jnp.mean((y - target) ** 2)

    x = rng.normal(size=(batch, seq, d)).astype(np.float32)
    target = rng.normal(size=(batch, seq, d)).astype(np.float32)
    return functional(loss, params, ps, (x, target), ((S0, B), (S0, B)), pl)


def vit(cfg, rng):
    n, img, patch, d, heads, layers, classes = (
        cfg[k] for k in ("batch", "image", "patch", "d_model", "heads", "layers", "classes")
    )
    pl = sj.placement((2, 4), ("x", "y"))
    npatch = (img // patch) ** 2
    params = {
        "patch": nrm(rng, patch * patch * 3, d),
        "pos": (0.02 * rng.normal(size=(npatch, d))).astype(np.float32),
        "blocks": [block_params(rng, d, 4 * d) for _ in range(layers)],
        "gf": np.ones((d,), np.float32),
        "head": nrm(rng, d, classes),
    }
    ps = {
        "patch": (B, S1),
        "pos": (B, S1),
        "blocks": [dict(MEGATRON) for _ in range(layers)],
        "gf": REP,
        "head": REP,
    }

    def loss(p, images, labels):
        b = images.shape[0]
        g = img // patch
        x = images.reshape(b, g, patch, g, patch, 3).transpose(0, 1, 3, 2, 4, 5).reshape(b, g * g, -1)
        x = x @ p["patch"] + p["pos"]
        for blk in p["blocks"]:
            x = attention_block(x, blk, heads, causal=False)
        return xent(layernorm(x, p["gf"]).mean(1) @ p["head"], labels)

    images = rng.normal(size=(n, img, img, 3)).astype(np.float32)
    labels = rng.integers(0, classes, size=(n,)).astype(np.int32)
    return functional(loss, params, ps, (images, labels), ((S0, B), (S0, B)), pl)


class LinenMLP(nn.Module):
    hidden: int
    out: int
    layers: int

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        for _ in range(self.layers):
            h = nn.LayerNorm()(x)
            h = nn.Dense(self.hidden, kernel_init=sjf.linen.with_sbp(init, (B, S1)))(h)
            h = nn.gelu(h)
            x = x + nn.Dense(x.shape[-1], kernel_init=sjf.linen.with_sbp(init, (B, S0)))(h)
        return nn.Dense(self.out)(nn.LayerNorm()(x))


def linen_mlp(cfg, rng):
    batch, d, hid, layers = (cfg[k] for k in ("batch", "d_model", "hidden", "layers"))
    pl = sj.placement((2, 4), ("x", "y"))
    model = LinenMLP(hid, d, layers)
    x = rng.normal(size=(batch, d)).astype(np.float32)
    y = rng.normal(size=(batch, d)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    ps = sjf.linen.get_sbp(variables["params"], pl)  # the with_sbp boxes; B elsewhere
    params = jax.tree.map(np.asarray, sjf.linen.unbox(variables["params"]))

    def loss(p, x, y):
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    return functional(loss, params, ps, (x, y), ((S0, B), (S0, B)), pl)


def build(name, cfg, rng):
    return {
        "decoder_scan": lambda: decoder(cfg["decoder"], rng, scanned=True),
        "decoder_unrolled": lambda: decoder(cfg["decoder"], rng, scanned=False),
        "resnet_bn": lambda: resnet(cfg["resnet"], rng),
        "resnet_bn_height": lambda: resnet(cfg["resnet"], rng, height_split=True),
        "moe": lambda: moe(cfg["moe"], rng),
        "vit": lambda: vit(cfg["vit"], rng),
        "linen_mlp": lambda: linen_mlp(cfg["linen"], rng),
    }[name]()


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def flops(compiled) -> float | None:
    """Per-device FLOPs of ``compiled`` by XLA's cost analysis (None where the
    backend gives none). Older JAX returns one dict per program in a list."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    value = (ca or {}).get("flops")
    return float(value) if value is not None else None


def max_error(got, ref) -> float:
    """max over leaves of max|got - ref| / max|ref| (1 where the reference is 0 everywhere)."""
    g_leaves, r_leaves = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert len(g_leaves) == len(r_leaves), (len(g_leaves), len(r_leaves))
    worst = 0.0
    for g, r in zip(g_leaves, r_leaves):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape, (g.shape, r.shape)
        scale = max(float(np.max(np.abs(r))) if r.size else 0.0, 1e-30)
        worst = max(worst, float(np.max(np.abs(g - r))) / scale if r.size else 0.0)
    return worst


def run_model(spec) -> dict:
    step, args, pl = spec["step"], spec["args"], spec["placement"]
    row = {"placement": "x".join(map(str, pl.shape))}
    row["param_count"] = int(sum(np.size(v) for v in jax.tree.leaves(args[0])))
    ref = jax.tree.map(np.asarray, jax.jit(step)(*args))

    # sbpjax
    f = sj.jit(step, placement=pl, in_sbp=spec["in_sbp"], out_sbp=spec["out_sbp"])
    gargs, tree = f._globals(args, {})
    g_args, _ = jax.tree_util.tree_unflatten(tree, gargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        compiled = f.lower(*g_args).compile()
        row["sbpjax_compile_s"] = time.perf_counter() - t0
    sbp_w = [w for w in caught if issubclass(w.category, sj.SBPWarning)]
    row["sbp_warnings"] = len(sbp_w)
    row["sbp_warning_messages"] = [str(w.message)[:300] for w in sbp_w[:3]]
    row["sbpjax_bytes"] = collective_bytes(compiled)
    explanation = f.explain(*g_args)
    row["sbpjax_explained_bytes"] = explanation.bytes
    mem = memory(compiled)
    row["sbpjax_peak_bytes"], row["sbpjax_memory"] = mem.get("peak"), mem
    row["estimated_peak_bytes"] = explanation.estimated_peak_bytes
    if row["sbpjax_peak_bytes"]:
        row["estimated_over_measured_peak"] = row["estimated_peak_bytes"] / row["sbpjax_peak_bytes"]
    row["sbpjax_flops"] = flops(compiled)
    row["sbpjax_loop_flops"] = loop_flops(compiled.as_text())
    row["sbpjax_while_loops"] = compiled.as_text().count(" while(")
    out = f(*g_args)
    row["max_error"] = max_error(jax.tree.map(lambda t: t.numpy(), out, is_leaf=_is_gt), ref)

    # GSPMD: the same layouts as NamedShardings, inputs and outputs
    def sharding(t):
        return NamedSharding(pl.mesh, spec_of(t.sbp, t.ndim, pl))

    out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=_is_gt)
    flat_args = [t.to_jax() for t in gargs]

    def flat_step(*leaves):
        a, _ = jax.tree_util.tree_unflatten(tree, leaves)
        return jax.tree.leaves(step(*a))

    gspmd = jax.jit(
        flat_step,
        in_shardings=[sharding(t) for t in gargs],
        out_shardings=[sharding(t) for t in out_leaves],
    )
    t0 = time.perf_counter()
    g_compiled = gspmd.lower(*flat_args).compile()
    row["gspmd_compile_s"] = time.perf_counter() - t0
    row["gspmd_bytes"] = collective_bytes(g_compiled)
    mem = memory(g_compiled)
    row["gspmd_peak_bytes"], row["gspmd_memory"] = mem.get("peak"), mem
    row["gspmd_flops"] = flops(g_compiled)
    row["gspmd_loop_flops"] = loop_flops(g_compiled.as_text())
    row["gspmd_while_loops"] = g_compiled.as_text().count(" while(")
    g_out = jax.tree_util.tree_unflatten(out_tree, [np.asarray(v) for v in g_compiled(*flat_args)])
    row["gspmd_max_error"] = max_error(g_out, ref)
    if row["sbpjax_peak_bytes"] and row["gspmd_peak_bytes"]:
        row["peak_ratio_vs_gspmd"] = row["sbpjax_peak_bytes"] / row["gspmd_peak_bytes"]
    if row["sbpjax_loop_flops"] and row["gspmd_loop_flops"]:
        row["flops_ratio_vs_gspmd"] = row["sbpjax_loop_flops"] / row["gspmd_loop_flops"]
    return row


def configs(quick):
    if quick:
        return {
            "decoder": dict(vocab=64, seq=16, d_model=32, heads=4, layers=2, batch=8),
            "resnet": dict(batch=16, image=16, channels=8, classes=10, res_blocks=1),
            "moe": dict(batch=4, seq=16, d_model=32, experts=8, top_k=2, expert_hidden=64),
            "vit": dict(batch=8, image=16, patch=4, d_model=32, heads=4, layers=1, classes=10),
            "linen": dict(batch=16, d_model=32, hidden=128, layers=2),
        }
    return {
        "decoder": dict(vocab=256, seq=64, d_model=128, heads=8, layers=4, batch=16),
        "resnet": dict(batch=32, image=32, channels=32, classes=10, res_blocks=2),
        "moe": dict(batch=8, seq=64, d_model=128, experts=8, top_k=2, expert_hidden=256),
        "vit": dict(batch=16, image=32, patch=4, d_model=128, heads=8, layers=2, classes=10),
        "linen": dict(batch=64, d_model=256, hidden=1024, layers=4),
    }


def fmt_bytes(v):
    return "-" if v is None else f"{v / 1e6:.3f}M"


def fmt_ratio(v):
    return "-" if v is None else f"{v:.3f}"


def table(rows) -> str:
    head = (
        f"{'model':<18}{'max_err':>9}{'sbpjax B':>11}{'GSPMD B':>11}{'sbp peak':>11}"
        f"{'GSPMD peak':>11}{'FLOPs/g':>8}{'warn':>5}{'compile s (sj/g)':>18}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<18} FAILED: {r['error'].splitlines()[0][:100]}")
            continue
        lines.append(
            f"{r['name']:<18}{r['max_error']:>9.1e}{fmt_bytes(r['sbpjax_bytes']):>11}"
            f"{fmt_bytes(r['gspmd_bytes']):>11}{fmt_bytes(r['sbpjax_peak_bytes']):>11}"
            f"{fmt_bytes(r['gspmd_peak_bytes']):>11}{fmt_ratio(r.get('flops_ratio_vs_gspmd')):>8}"
            f"{r['sbp_warnings']:>5}"
            f"{r['sbpjax_compile_s']:>10.1f}/{r['gspmd_compile_s']:<7.1f}"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="model names to run (default: all)")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "models.json"))
    args = ap.parse_args()
    cfg = configs(args.quick)
    names = [m for m in MODELS if not args.only or m in args.only]
    rows = []
    for name in tqdm(names, desc="models benchmark", unit="model", disable=None):
        rng = np.random.default_rng(0)
        row = {"name": name}
        try:
            row.update(run_model(build(name, cfg, rng)))
        except Exception as e:  # recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-3000:]
        rows.append(row)
        jax.clear_caches()
    ok = [r for r in rows if "error" not in r]
    summary = {
        "models": len(rows),
        "failed": [r["name"] for r in rows if "error" in r],
        "zero_warnings": [r["name"] for r in ok if r["sbp_warnings"] == 0],
        "bytes_at_or_below_gspmd": [r["name"] for r in ok if r["sbpjax_bytes"] <= r["gspmd_bytes"]],
        "peak_within_5pct_of_gspmd": [
            r["name"] for r in ok if r["sbpjax_peak_bytes"] <= 1.05 * r["gspmd_peak_bytes"]
        ],
        "flops_within_2pct_of_gspmd": [
            r["name"]
            for r in ok
            if r.get("flops_ratio_vs_gspmd") is not None and r["flops_ratio_vs_gspmd"] <= 1.02
        ],
    }
    result = {
        "config": {"quick": args.quick, "jax": jax.__version__, "devices": jax.device_count(), **cfg},
        "models": rows,
        "summary": summary,
    }
    print(table(rows))
    for k, v in summary.items():
        print(f"{k}: {v}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
