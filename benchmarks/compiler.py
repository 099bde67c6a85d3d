"""Compiler benchmark: sj.jit against GSPMD and hand-written shard_map programs.

    python benchmarks/compiler.py            # default sizes (over an hour on a 2-core machine)
    python benchmarks/compiler.py --quick    # small sizes, same fields, under two minutes

Programs on 8 devices: (a) a Megatron MLP block forward+backward on a 2x4
(data x tensor) placement; (b) a transformer-block train step (AdamW) with
data, tensor and 2-D layouts; (c) ``U @ V @ W`` with U S(1), V S(0), W B;
(d) a model-parallel softmax cross-entropy over 8 class shards; (e) the GPT
sweep: AdamW steps of GPTs of several widths and depths with Megatron
annotations over the second placement axis and the batch over the first, on
2x4, 4x2, 8x1 and 1x8 (rows ``gpt_sweep_d{d_model}_L{layers}_{placement}``,
with the solver's time (``solve_s``, building included), its proven gap and
the collective counts of both compiled programs); (f) the same sweep on 4x4,
8x8 and 16x16, compiled only, in child processes that simulate 16, 64 and
256 devices (rows with ``"compile_only": true``: bytes, collectives and
compile times, no step times). The sweep includes a 32-layer GPT whose layers
run by ``lax.scan`` (``_scan``). (g) ``budget``: a GPT step with ``AUTO``
layouts under memory budgets, beside the hand-written data parallel,
ZeRO-1/2 and ZeRO-3/FSDP layouts (``benchmarks/_budgets.py``;
``--budget-only`` measures it alone into an existing results file). For each
program:
bytes moved by sbpjax (measured in the compiled program), by GSPMD (``jax.jit``
given the same input and parameter shardings) and by a hand-written
``shard_map``; time ratios (medians of interleaved repeats, same process); and
what a first call costs (medians over cold compiles after the first, JAX's and
sbpjax's caches cleared before each, see ``compile_times``): sbpjax's front
end (``front_end_s``: trace, layout choice, the shard_map and JAX's lowering
of it) and XLA's compile of its program (``xla_compile_s``) against GSPMD's
whole ``jax.jit`` lower and compile (``gspmd_compile_s``), as
``first_call_ratio``; the same with the plan read from the plan cache
(``cached_call_ratio``); and the layout choice's size (``ops``, ``groups``,
``variables``) and ``proven_gap``; per-device memory by XLA's
``memory_analysis()`` (``sbpjax_peak_bytes``, ``gspmd_peak_bytes``:
arguments + outputs + temporaries - aliased) beside the plan's own estimate
(``estimated_peak_bytes``, ``explain().estimated_peak_bytes``). Python's garbage collector is paused
while timing, as ``timeit`` does. Every program's result is checked against
the single-device program.
Writes ``benchmarks/results/compiler.json``. After a change to the estimate
alone, ``--estimates-only`` compiles each program (no baselines, no timing)
and writes its two peaks into the file's rows, recording why in
``config.rerun``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _devices.py, also when imported
from _devices import simulate_devices, xla_flags_with_devices  # noqa: E402

simulate_devices(8)
# plans are made here, not read from the user's plan cache (compile_times uses its own)
os.environ.setdefault("SBPJAX_PLAN_CACHE", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _budgets import budget_section  # noqa: E402
from _specs import spec_of  # noqa: E402 (the other benchmarks import it from here)
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS
from tqdm import tqdm  # noqa: E402

import sbpjax as sj  # noqa: E402
from sbpjax.boxing.plan import clear_caches  # noqa: E402
from sbpjax.compiler import small_jaxprs, sub_plans  # noqa: E402
from sbpjax.compiler.api import is_nd_sbp, state_sbp  # noqa: E402
from sbpjax.rules import shifts  # noqa: E402
from sbpjax.solver._kept_plans import clear as clear_kept_plans  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ONLY: list = []  # --only: program name parts to run
WHY = ""  # --why: recorded with the rows an --only run measures again
# --estimates-only: each program's plan compiled, its peak by XLA and by explain() (PEAK_FIELDS)
ESTIMATES_ONLY = False
PEAK_FIELDS = ("sbpjax_peak_bytes", "estimated_peak_bytes")
# --min-seconds: the least time each median_times call spends in timing rounds
MIN_TIMING_SECONDS = 2.0
S0, S1, B, P = sj.S(0), sj.S(1), sj.B, sj.P


def collective_bytes(compiled) -> int:
    return sum(c.bytes for c in sj.collectives(compiled))


def collective_count(compiled) -> int:
    """Collectives one run of the program executes (a combined tuple collective counts once)."""
    return sum(c.count for c in sj.collectives(compiled))


def memory(compiled) -> dict:
    """Per-device memory of ``compiled`` by XLA's ``memory_analysis()``, its
    parts and ``peak`` = arguments + outputs + temporaries - aliased (empty
    where the backend gives none)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {
        k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
        for k in ("argument", "output", "temp", "alias", "generated_code")
    }
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def median_times(runs, repeats, min_seconds=None):
    """Median seconds per call of each ``(fn, args)`` in ``runs``, timed in
    interleaved rounds (one call of each per round) so that a change in the
    machine's load falls on all of them alike; at least ``repeats`` rounds and
    at least ``min_seconds`` of them (short programs get more rounds; default
    ``MIN_TIMING_SECONDS``, which ``--min-seconds`` sets)."""
    if min_seconds is None:
        min_seconds = MIN_TIMING_SECONDS
    t0 = time.perf_counter()
    for fn, args in runs:
        jax.block_until_ready(fn(*args))
    rounds = max(repeats, min(200, int(min_seconds / max(time.perf_counter() - t0, 1e-6))))
    samples = [[] for _ in runs]
    with gc_paused():
        for _ in range(rounds):
            for k, (fn, args) in enumerate(runs):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples[k].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in samples]


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic collector off while timing (timeit's convention): with
    JAX loaded a full collection takes ~50 ms, and where one lands is chance."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _forget_plans() -> None:
    """Every cache a process's planning fills (boxing searches, the shifts of
    slices and pads, solver plans, the plans a budget solves on the way,
    traced scans' slices) and JAX's: the next sj.jit plans as a fresh
    process would."""
    clear_caches()
    shifts.clear_caches()
    clear_kept_plans()
    sub_plans.clear()
    small_jaxprs.clear()
    jax.clear_caches()


def compile_times(fn, pl, leaves_sbp, out_sbp, g_args, gspmd_fn, in_shardings, flat_args, samples) -> dict:
    """Medians over ``samples`` cold compiles, each from nothing: JAX's caches
    and sbpjax's planner caches (boxing plans and schedules, the solver's
    elimination plans) cleared, a new ``sj.jit`` (plan cache in a
    new empty directory) and a new function for ``jax.jit``.

    ``front_end_s``: ``f.lower(...)`` (trace, layout choice, building the
    shard_map and JAX's lowering of it); ``xla_compile_s``: XLA's compile of
    that; ``gspmd_compile_s``: ``jax.jit(...).lower(...).compile()`` of the
    same step with the same shardings; ``cached_s``: ``f.lower().compile()``
    of a new ``sj.jit`` whose plan cache holds the plan (JAX's and the
    planner's caches cleared again: what a fresh process with a warm plan
    cache does, but for importing the libraries); ``sbpjax_overhead_s``: the
    front end without JAX's lowering (``last_overhead_s``). The first
    sample's ratio is reported too (the first compile of the process)."""
    rows = []
    for _ in range(samples):
        with tempfile.TemporaryDirectory() as cache:
            row = {}
            _forget_plans()
            f = sj.jit(fn, placement=pl, in_sbp=leaves_sbp, out_sbp=out_sbp, plan_cache=cache)
            with gc_paused():
                t0 = time.perf_counter()
                lowered = f.lower(*g_args)
                t1 = time.perf_counter()
                lowered.compile()
                t2 = time.perf_counter()
            row.update(front_end_s=t1 - t0, xla_compile_s=t2 - t1, sbpjax_overhead_s=f.last_overhead_s)
            _forget_plans()
            g = sj.jit(fn, placement=pl, in_sbp=leaves_sbp, out_sbp=out_sbp, plan_cache=cache)
            with gc_paused():
                t0 = time.perf_counter()
                g.lower(*g_args).compile()
                row["cached_s"] = time.perf_counter() - t0
            jax.clear_caches()
            fresh = jax.jit(
                lambda *a: gspmd_fn(*a), in_shardings=in_shardings
            )  # a new function: no trace cached
            with gc_paused():
                t0 = time.perf_counter()
                fresh.lower(*flat_args).compile()
                row["gspmd_compile_s"] = time.perf_counter() - t0
            rows.append(row)
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["first_call_ratio"] = (out["front_end_s"] + out["xla_compile_s"]) / out["gspmd_compile_s"]
    out["cached_call_ratio"] = out["cached_s"] / out["gspmd_compile_s"]
    first = rows[0]
    out["first_call_ratio_first"] = (first["front_end_s"] + first["xla_compile_s"]) / first["gspmd_compile_s"]
    return out


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def gelu(x):
    return jax.nn.gelu(x, approximate=True)


def mlp_loss(p, x, t):
    h = gelu(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - t) ** 2)


def layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * g


def block_forward(p, tokens, heads, psum_t=None, local_ce=None):
    """Transformer block + LM head. ``psum_t``: the hand-written tensor-parallel
    reduction; ``local_ce``: the hand-written model-parallel cross-entropy."""
    red = psum_t or (lambda v: v)
    x = p["emb"][tokens]
    h = layernorm(x, p["g"])
    b, t, _ = h.shape
    q = (h @ p["wq"]).reshape(b, t, heads, -1)
    k = (h @ p["wk"]).reshape(b, t, heads, -1)
    v = (h @ p["wv"]).reshape(b, t, heads, -1)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1)
    x = x + red(o @ p["wo"])
    x = x + red(gelu(layernorm(x, p["g"]) @ p["w1"]) @ p["w2"])
    return x @ p["head"]


def gpt_forward(p, tokens, heads, psum_t=None):
    """A GPT of ``len(p["blocks"])`` pre-norm blocks and an LM head;
    ``psum_t``: the hand-written tensor-parallel reduction (Megatron's g)."""
    red = psum_t or (lambda v: v)
    x = p["emb"][tokens]
    b, t, _ = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))
    for blk in p["blocks"]:
        h = layernorm(x, blk["g1"])
        q, k, v = ((h @ blk[w]).reshape(b, t, heads, -1) for w in ("wq", "wk", "wv"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + red(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ blk["wo"])
        x = x + red(gelu(layernorm(x, blk["g2"]) @ blk["w1"]) @ blk["w2"])
    return x @ p["head"]


def scanned_gpt_forward(p, tokens, heads, psum_t=None):
    """``gpt_forward`` with the blocks' parameters stacked (each leaf with a
    leading layer dim) and the layers run by ``lax.scan``."""
    red = psum_t or (lambda v: v)
    x = p["emb"][tokens]
    b, t, _ = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))

    def layer(x, blk):
        h = layernorm(x, blk["g1"])
        q, k, v = ((h @ blk[w]).reshape(b, t, heads, -1) for w in ("wq", "wk", "wv"))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + red(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ blk["wo"])
        return x + red(gelu(layernorm(x, blk["g2"]) @ blk["w1"]) @ blk["w2"]), None

    x, _ = lax.scan(layer, x, p["blocks"])
    return x @ p["head"]


def gpt_loss(p, tokens, labels, heads):
    forward = scanned_gpt_forward if isinstance(p["blocks"], dict) else gpt_forward
    lp = jax.nn.log_softmax(forward(p, tokens, heads), axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def block_step(rng, quick: bool):
    """Benchmark (b)'s program: one transformer block (embedding, attention,
    MLP, head) trained with adamw. Returns ``(step, args, opt, heads)``,
    ``args`` being (params, optimizer state, tokens, labels) drawn from ``rng``."""
    vocab, dm, hid, heads, tt, bb = (64, 32, 64, 8, 8, 16) if quick else (1024, 256, 1024, 8, 64, 32)

    def nrm(*s):
        return (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)

    params = {
        "wq": nrm(dm, dm),
        "wk": nrm(dm, dm),
        "wv": nrm(dm, dm),
        "wo": nrm(dm, dm),
        "w1": nrm(dm, hid),
        "w2": nrm(hid, dm),
        "g": np.ones((dm,), np.float32),
        "emb": nrm(vocab, dm),
        "head": nrm(dm, vocab),
    }
    tokens = rng.integers(0, vocab, size=(bb, tt)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(bb, tt)).astype(np.int32)
    opt = optax.adamw(1e-3, weight_decay=0.1)

    def step(p, s, tok, lab):
        loss, g = jax.value_and_grad(block_loss)(p, tok, lab, heads)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step, (params, opt.init(params), tokens, labels), opt, heads


def block_sbp(kind: str, pl, params) -> dict:
    """The parameters' layouts of ``block_step`` for a ``kind`` of
    parallelism: "data" (every one B), "tensor" or "2d" (Megatron's column and
    row splits on the placement's last axis)."""
    rep = (B,) * pl.ndim
    if kind == "data":
        return {k: rep for k in params}
    col, row = rep[:-1] + (S1,), rep[:-1] + (S0,)
    return {
        "wq": col,
        "wk": col,
        "wv": col,
        "wo": row,
        "w1": col,
        "w2": row,
        "g": rep,
        "emb": rep,
        "head": col,
    }


def block_loss(p, tokens, labels, heads):
    lp = jax.nn.log_softmax(block_forward(p, tokens, heads), axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def ce(z, y):
    m = lax.stop_gradient(z.max(-1, keepdims=True))
    zz = z - m
    return (jnp.log(jnp.exp(zz).sum(-1)) - jnp.take_along_axis(zz, y[:, None], axis=1)[:, 0]).mean()


# ---------------------------------------------------------------------------
# Hand-written shard_map programs
# ---------------------------------------------------------------------------


def handwritten_mlp(mesh, data="x", tensor="y"):
    """Megatron MLP: column-parallel w1, row-parallel w2 (psum over tensor), data
    parallel gradients. check_vma=True so psum transposes to a no-op broadcast
    (Megatron's f/g pair) and invariant weights get their gradient psum."""

    def body(w1, w2, x, t):
        def local(w1, w2):
            y = lax.psum(gelu(x @ w1) @ w2, tensor)
            n = x.shape[0] * lax.axis_size(data)
            return jnp.sum((y - t) ** 2) / (n * y.shape[1])

        # w1, w2 are invariant over the data axis: JAX's transpose of their implicit
        # broadcast is the data-parallel gradient psum
        loss, (g1, g2) = jax.value_and_grad(local, argnums=(0, 1))(w1, w2)
        return lax.psum(loss, data), g1, g2

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(PS(None, tensor), PS(tensor, None), PS(data), PS(data)),
            out_specs=(PS(), PS(None, tensor), PS(tensor, None)),
        )
    )


def handwritten_block_step(mesh, heads, opt, data, tensor, psbp_specs, forward=None, gather_dims=None):
    """Transformer train step by hand: Megatron tensor parallelism over
    ``tensor`` (column-parallel q/k/v/w1/head, row-parallel wo/w2 with a psum,
    a model-parallel cross-entropy over the vocabulary shards) and data
    parallelism over ``data`` (gradient psum). ``gather_dims``: per parameter,
    the dim split over ``data`` too (FSDP; -1: none), gathered in the loss,
    so that its gradient is reduce-scattered (the all-gather's transpose)."""
    n_t = mesh.shape[tensor] if tensor else 1

    def mp_ce(logits, labels):
        if not tensor:
            lp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.sum(jnp.take_along_axis(lp, labels[..., None], axis=-1))
        m = lax.pmax(lax.stop_gradient(logits.max(-1)), tensor)
        z = logits - m[..., None]
        lse = jnp.log(lax.psum(jnp.exp(z).sum(-1), tensor))
        v = logits.shape[-1]
        local = labels - lax.axis_index(tensor) * v
        ok = (local >= 0) & (local < v)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, v - 1)[..., None], axis=-1)[..., 0]
        picked = lax.psum(jnp.where(ok, picked, 0.0), tensor)
        return jnp.sum(lse - picked)

    def body(p, s, tokens, labels):
        n_global = tokens.size * (mesh.shape[data] if data else 1)

        def local_loss(p):
            if gather_dims is not None:
                p = jax.tree.map(
                    lambda w, dim: w if dim < 0 else lax.all_gather(w, data, axis=dim, tiled=True),
                    p,
                    gather_dims,
                )
            logits = (forward or block_forward)(
                p, tokens, heads // n_t, psum_t=(lambda v: lax.psum(v, tensor)) if tensor else None
            )
            return mp_ce(logits, labels) / n_global

        loss, g = jax.value_and_grad(local_loss)(p)  # gradient psums: inserted by JAX (check_vma)
        if data:
            loss = lax.psum(loss, data)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    in_specs = (psbp_specs, None, PS(data) if data else PS(), PS(data) if data else PS())
    return body, in_specs


def handwritten_uvw(mesh):
    return jax.jit(
        jax.shard_map(
            lambda u, v, w: lax.psum(u @ v @ w, "x"),
            mesh=mesh,
            in_specs=(PS(None, "x"), PS("x", None), PS()),
            out_specs=PS(),
        )
    )


def handwritten_ce(mesh):
    def body(z, y):
        m = lax.pmax(z.max(-1, keepdims=True), "x")
        zz = z - m
        lse = jnp.log(lax.psum(jnp.exp(zz).sum(-1), "x"))
        c = z.shape[1]
        local = y - lax.axis_index("x") * c
        ok = (local >= 0) & (local < c)
        picked = jnp.take_along_axis(zz, jnp.clip(local, 0, c - 1)[:, None], axis=1)[:, 0]
        picked = lax.psum(jnp.where(ok, picked, 0.0), "x")
        return (lse - picked).mean()

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(None, "x"), PS()), out_specs=PS()))


# ---------------------------------------------------------------------------
# Running one program three ways
# ---------------------------------------------------------------------------


def run_program(
    name, fn, pl, leaves_sbp, args, out_sbp, handwritten, repeats, check, compile_samples, execute=True
):
    """fn: the program; leaves_sbp: in_sbp pytree; args: host values;
    handwritten: (jitted fn, its args) or None. None when --only skips it.
    ``execute=False``: compile only (bytes, collectives, compile times; no
    values checked, no step times), for placements of more simulated devices
    than two cores can run in reasonable time."""
    if ONLY and not any(o in name for o in ONLY):
        return None
    row = {"name": name}
    f = sj.jit(fn, placement=pl, in_sbp=leaves_sbp, out_sbp=out_sbp)
    is_gt = lambda v: isinstance(v, sj.GlobalTensor)  # noqa: E731
    # global inputs once (layout conversion is not part of the step)
    gargs = f._globals(args, {})[0]
    tree = jax.tree_util.tree_structure((args, {}), is_leaf=is_gt)
    g_args, _ = jax.tree_util.tree_unflatten(tree, gargs)
    if ESTIMATES_ONLY:
        peak = memory(f.lower(*g_args).compile()).get("peak")
        return dict(row, sbpjax_peak_bytes=peak, estimated_peak_bytes=f.explain(*g_args).estimated_peak_bytes)
    # GSPMD: jax.jit with the same input shardings
    in_shardings = [NamedSharding(pl.mesh, spec_of(t.sbp, t.ndim, pl)) for t in gargs]
    flat_args = [t.to_jax() for t in gargs]

    def flat_fn(*leaves):
        a, _ = jax.tree_util.tree_unflatten(tree, leaves)
        return fn(*a)

    timed = ("front_end_s", "xla_compile_s", "gspmd_compile_s", "first_call_ratio", "cached_call_ratio")
    timed += ("first_call_ratio_first", "overhead_share", "sbpjax_overhead_ms", "xla_compile_ms")
    row.update(dict.fromkeys(timed))
    if compile_samples >= 0:
        # cold compiles; the first of a process also warms JAX's and sbpjax's code paths
        times = compile_times(
            fn, pl, leaves_sbp, out_sbp, g_args, flat_fn, in_shardings, flat_args, 1 + compile_samples
        )
        row.update({k: times[k] for k in timed[:6]})
        row["overhead_share"] = times["sbpjax_overhead_s"] / times["xla_compile_s"]
        row["sbpjax_overhead_ms"] = times["sbpjax_overhead_s"] * 1e3
        row["xla_compile_ms"] = times["xla_compile_s"] * 1e3
    compiled = f.lower(*g_args).compile()
    row["sbpjax_bytes"] = collective_bytes(compiled)
    row["sbpjax_collectives"] = collective_count(compiled)
    explanation = f.explain(*g_args)
    row["sbpjax_explained_bytes"] = explanation.bytes
    row["sbpjax_peak_bytes"] = memory(compiled).get("peak")
    row["estimated_peak_bytes"] = explanation.estimated_peak_bytes
    choice = explanation.choice
    row["solver"] = choice.method if choice is not None else None
    row["solve_s"] = choice.solve_s + choice.build_s if choice is not None else None
    row["solver_gap"] = row["proven_gap"] = choice.gap if choice is not None else None
    row["ops"] = choice.ops if choice is not None else None
    row["groups"] = choice.groups if choice is not None else None
    row["variables"] = choice.variables if choice is not None else None
    row["greedy_bytes"] = choice.greedy_bytes if choice is not None else None
    phys = [t.physical for t in gargs]
    prog = f._compile(gargs, tree)[1]
    if execute:
        sj_out = f(*g_args)
        check("sbpjax", jax.tree.map(lambda t: t.numpy(), sj_out, is_leaf=is_gt))
    gspmd = jax.jit(flat_fn, in_shardings=in_shardings)
    g_compiled = gspmd.lower(*flat_args).compile()
    row["gspmd_bytes"] = collective_bytes(g_compiled)
    row["gspmd_collectives"] = collective_count(g_compiled)
    row["gspmd_peak_bytes"] = memory(g_compiled).get("peak")
    row["handwritten_bytes"] = None
    if handwritten is not None:
        hw, hw_args = handwritten
        row["handwritten_bytes"] = collective_bytes(hw.lower(*hw_args).compile())
    if not execute:
        row["compile_only"] = True
        row["time_ratio_vs_gspmd"] = row["time_ratio_vs_handwritten"] = None
        row["sbpjax_ms"] = row["gspmd_ms"] = None
        return row
    check("gspmd", jax.tree.map(np.asarray, gspmd(*flat_args)))
    runs = [(prog, phys), (gspmd, flat_args)]
    if handwritten is not None:
        check("handwritten", jax.tree.map(np.asarray, hw(*hw_args)))
        runs.append((hw, hw_args))
    t_sj, t_g, *t_h = median_times(runs, repeats)
    row["time_ratio_vs_gspmd"] = t_sj / t_g
    row["time_ratio_vs_handwritten"] = t_sj / t_h[0] if t_h else None
    row["sbpjax_ms"], row["gspmd_ms"] = t_sj * 1e3, t_g * 1e3
    return row


def make_check(name, reference, rtol):
    def check(who, got):
        ref_leaves = jax.tree_util.tree_leaves(reference)
        got_leaves = jax.tree_util.tree_leaves(got)
        assert len(ref_leaves) == len(got_leaves), (name, who)
        for r, g in zip(ref_leaves, got_leaves):
            np.testing.assert_allclose(
                np.asarray(g, np.float32),
                np.asarray(r, np.float32),
                rtol=rtol,
                atol=rtol,
                err_msg=f"{name}: {who}",
            )

    return check


def gpt_sweep_configs(quick):
    """(d_model, layers, placement shape) of the GPT sweep rows run on 8
    devices. --quick keeps four small rows; the default covers d_model
    64..512, 1..32 layers and the four 8-device placements."""
    if quick:
        return [(32, 1, (2, 4)), (32, 1, (4, 2)), (32, 1, (8, 1)), (64, 1, (1, 8))]
    return [
        (64, 1, (2, 4)),
        (128, 2, (2, 4)),
        (256, 2, (2, 4)),
        (512, 2, (2, 4)),
        (128, 2, (4, 2)),
        (128, 2, (8, 1)),
        (128, 2, (1, 8)),
        (64, 4, (2, 4)),
        (64, 8, (2, 4)),
        (64, 16, (2, 4)),
        (64, 32, (2, 4)),
        (64, 32, (2, 4), "scan"),
        (64, 2, (2, 4), "scan", "fsdp"),
    ]


def with_fsdp(nd, ndim, stacked):
    """Layout ``nd`` (whole over the first axis) with the first axis splitting
    a matrix (a kernel, a table; ``stacked``: behind a leading layer dim)
    along its last dim the second axis leaves whole: a kernel's input dim
    where the second splits its output (column-parallel), its output dim
    where the second splits its input (row-parallel), a table's width. A
    vector (a layernorm's scale) stays as it is. Not ``sbpjax.flax.zero_layout``,
    ZeRO's stored layout, which splits the first dim that divides: a stack's
    layer dim here, so each layer would live on one half of x, not the FSDP
    layout the held-out test ``scanned_fsdp_tp`` and MaxText-style models use."""
    free = [k for k in (ndim - 2, ndim - 1) if sj.S(k) not in nd]
    if ndim - stacked != 2 or not free:
        return nd
    return (sj.S(free[-1]),) + tuple(nd[1:])


def gpt_sweep_compile_only_configs(quick):
    """Sweep rows on 4x4 and 8x8 placements: compiled (bytes, collectives,
    solve and compile times) in a child process that simulates 64 devices,
    not run (64 simulated devices on a few cores would time the machine, not
    the program)."""
    if quick:
        return [(32, 1, (4, 4))]
    return [(128, 2, (4, 4)), (128, 2, (8, 8)), (128, 2, (16, 16))]


def compile_only_rows(args) -> list:
    """The compile-only sweep rows, each placement size from a child process
    of this script with that many simulated devices (a process's device
    count is fixed when JAX starts)."""
    rows = []
    for devices in sorted({c[2][0] * c[2][1] for c in gpt_sweep_compile_only_configs(args.quick)}):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--compile-only-child",
                str(devices),
                "--output",
                out,
            ]
            cmd += ["--quick"] if args.quick else []
            cmd += ["--estimates-only"] if args.estimates_only else []
            cmd += ["--only", args.only] if args.only else []
            cmd += [] if args.compile_samples is None else ["--compile-samples", str(args.compile_samples)]
            env = dict(os.environ, XLA_FLAGS=xla_flags_with_devices(devices))
            subprocess.run(cmd, env=env, check=True)
            with open(out) as f:
                rows += json.load(f)["programs"]
    return rows


def gpt_sweep_row(cfg, repeats, samples, rng, execute=True):
    """One sweep row: an AdamW step of a GPT with Megatron annotations over the
    placement's second axis and the batch split over its first, by sbpjax,
    GSPMD and a hand-written Megatron shard_map. ``cfg``: (d_model, layers,
    placement shape, and "scan" for stacked layers run by ``lax.scan``, and
    "fsdp" for every weight split over the first axis too, along the dim
    tensor parallelism leaves whole: FSDP with tensor parallelism, which
    the hand-written program gathers over the first axis in the loss, so
    that the gradients are reduce-scattered)."""
    d, layers, shape, *kind = cfg
    scan, fsdp = "scan" in kind, "fsdp" in kind
    # 8 heads, or as many as the tensor axis has devices (16x16): the tensor axis divides them
    vocab, seq, batch, heads = 64, 16, 16, max(8, shape[1])
    name = (
        f"gpt_sweep_d{d}_L{layers}_{shape[0]}x{shape[1]}"
        + ("_scan" if scan else "")
        + ("_fsdp" if fsdp else "")
    )
    if ONLY and not any(o in name for o in ONLY):
        return None
    pl = sj.placement(shape, ("x", "y"))
    nrm = lambda *s: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    blocks = [
        {
            "wq": nrm(d, d),
            "wk": nrm(d, d),
            "wv": nrm(d, d),
            "wo": nrm(d, d),
            "w1": nrm(d, 4 * d),
            "w2": nrm(4 * d, d),
            "g1": np.ones((d,), np.float32),
            "g2": np.ones((d,), np.float32),
        }
        for _ in range(layers)
    ]
    if scan:  # each parameter stacked over the layers, the layers run by lax.scan
        blocks = {k: np.stack([blk[k] for blk in blocks]) for k in blocks[0]}
    params = {"emb": nrm(vocab, d), "blocks": blocks, "head": nrm(d, vocab)}
    tokens = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    opt = optax.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)

    def step(p, s, tok, lab):
        loss, g = jax.value_and_grad(gpt_loss)(p, tok, lab, heads)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rep, col, row_ = (B, B), (B, S1), (B, S0)
    blk = {"wq": col, "wk": col, "wv": col, "wo": row_, "w1": col, "w2": row_, "g1": rep, "g2": rep}
    if scan:  # the layer dim stays whole
        stacked = {
            k: (B, sj.S(nd[1].dim + 1)) if isinstance(nd[1], sj.sbp.Split) else nd for k, nd in blk.items()
        }
        ps = {"emb": rep, "blocks": stacked, "head": col}
    else:
        ps = {"emb": rep, "blocks": [dict(blk) for _ in blocks], "head": col}
    gather_dims = None
    if fsdp:  # the first axis splits each weight along the dim the second leaves whole
        ps = {
            "emb": with_fsdp(ps["emb"], 2, False),
            "blocks": jax.tree.map(
                lambda nd, leaf: with_fsdp(nd, np.ndim(leaf), scan),
                ps["blocks"],
                params["blocks"],
                is_leaf=is_nd_sbp,
            ),
            "head": with_fsdp(ps["head"], 2, False),
        }
        gather_dims = jax.tree.map(
            lambda nd: nd[0].dim if isinstance(nd[0], sj.sbp.Split) else -1, ps, is_leaf=is_nd_sbp
        )
    ss = state_sbp(state, ps, rep)
    data_sbp = (S0, B)
    data_axis = "x" if shape[0] > 1 else None
    tensor_axis = "y" if shape[1] > 1 else None
    pspecs = jax.tree.map(lambda nd, leaf: spec_of(nd, np.ndim(leaf), pl), ps, params, is_leaf=is_nd_sbp)
    sspecs = jax.tree.map(lambda nd, leaf: spec_of(nd, np.ndim(leaf), pl), ss, state, is_leaf=is_nd_sbp)
    forward = scanned_gpt_forward if scan else gpt_forward
    body, _ = handwritten_block_step(
        pl.mesh, heads, opt, data_axis, tensor_axis, pspecs, forward=forward, gather_dims=gather_dims
    )
    dspec = PS(data_axis) if data_axis else PS()
    hw = jax.jit(
        jax.shard_map(
            body, mesh=pl.mesh, in_specs=(pspecs, sspecs, dspec, dspec), out_specs=(pspecs, sspecs, PS())
        )
    )
    put = lambda v, s: jax.device_put(v, NamedSharding(pl.mesh, s))  # noqa: E731
    hw_args = [
        jax.tree.map(put, params, pspecs),
        jax.tree.map(put, state, sspecs),
        put(tokens, dspec),
        put(labels, dspec),
    ]
    ref = jax.jit(step)(params, state, tokens, labels) if execute else None
    # Adam turns rounding noise in a near-zero gradient into +-lr: lr as the atol
    row = run_program(
        name,
        step,
        pl,
        (ps, ss, data_sbp, data_sbp),
        (params, state, tokens, labels),
        (ps, ss, rep),
        (hw, hw_args),
        repeats,
        make_check(name, ref, 2e-3),
        samples,
        execute,
    )
    row.update(d_model=d, layers=layers, placement=f"{shape[0]}x{shape[1]}")
    return row


def main():
    global ONLY, MIN_TIMING_SECONDS, WHY, ESTIMATES_ONLY
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--only", default="", help="comma-separated parts of program names to run (all by default)"
    )
    ap.add_argument(
        "--compile-samples",
        type=int,
        default=None,
        help="cold compiles per program after the first (median taken); -1: none at all, the "
        "timing fields left None (the tests' run: values, bytes, collectives and the plan)",
    )
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=MIN_TIMING_SECONDS,
        help="the least time the timing rounds of one program take (default %(default)s s); 0: "
        "--repeats rounds only (the tests' run, which reads no times)",
    )
    ap.add_argument("--output", default=os.path.join(HERE, "results", "compiler.json"))
    ap.add_argument(
        "--why",
        default="measured again with --only",
        help="with --only: why these rows were measured again (recorded in the results' config.rerun)",
    )
    ap.add_argument("--compile-only-child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument(
        "--budget-only",
        action="store_true",
        help="measure the budget section alone and write it into --output, keeping its programs",
    )
    ap.add_argument(
        "--skip-budget",
        action="store_true",
        help="leave the budget section out (the tests' run: tests/compiler/test_budgets.py runs it)",
    )
    ap.add_argument(
        "--estimates-only",
        action="store_true",
        help="only compile each program and refresh its peak by XLA and by explain() in --output "
        "(after a change to the estimate; the other fields as they stand)",
    )
    args = ap.parse_args()
    ESTIMATES_ONLY = args.estimates_only
    ONLY = [o for o in (args.only or "").split(",") if o]
    WHY = args.why
    MIN_TIMING_SECONDS = args.min_seconds
    repeats = args.repeats or (3 if args.quick else 10)
    samples = args.compile_samples if args.compile_samples is not None else (2 if args.quick else 5)
    q = args.quick
    rng = np.random.default_rng(0)
    if args.compile_only_child:
        n = args.compile_only_child
        configs = [c for c in gpt_sweep_compile_only_configs(q) if c[2][0] * c[2][1] == n]
        rows = [gpt_sweep_row(cfg, 0, min(samples, 1), rng, execute=False) for cfg in configs]
        with open(args.output, "w") as f:
            json.dump({"programs": [r for r in rows if r is not None]}, f)
        return
    if args.budget_only:
        with open(args.output) as f:
            old = json.load(f)
        write(args.output, old["programs"], old["config"], budget_section(q, rng, gpt_loss))
        print(f"wrote the budget section of {args.output}")
        return
    pl8 = sj.placement(8, "x")
    pl24 = sj.placement((2, 4), ("x", "y"))
    rows = []
    sweep = gpt_sweep_configs(q)
    # a bar on a terminal, nothing in a log (tqdm's disable=None); one tick per program measured
    bar = tqdm(total=6 + len(sweep), desc="compiler programs", unit="program", disable=None)

    def add(row):
        rows.append(row)
        bar.update(1)

    # (a) Megatron MLP forward + backward on 2x4 (data x tensor)
    n, d, h = (32, 64, 256) if q else (256, 512, 2048)
    mp = {
        "w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
        "w2": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32),
    }
    x, t = rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)
    grad_fn = jax.value_and_grad(mlp_loss)
    psbp = {"w1": (B, S1), "w2": (B, S0)}
    ref = jax.jit(grad_fn)(mp, x, t)
    hw = handwritten_mlp(pl24.mesh)
    hw_args = [
        jax.device_put(v, NamedSharding(pl24.mesh, s))
        for v, s in [(mp["w1"], PS(None, "y")), (mp["w2"], PS("y", None)), (x, PS("x")), (t, PS("x"))]
    ]
    add(
        run_program(
            "megatron_mlp_fwd_bwd_2x4",
            grad_fn,
            pl24,
            (psbp, (S0, B), (S0, B)),
            (mp, x, t),
            (None, psbp),
            (hw, hw_args),
            repeats,
            make_check("mlp", ref, 2e-4),
            samples,
        )
    )

    # (b) transformer block train step: data, tensor, 2-D
    step, (bp, state, tokens, labels), opt, heads = block_step(rng, q)
    ref = jax.jit(step)(bp, state, tokens, labels)
    for kind, pl in [("data", pl8), ("tensor", pl8), ("2d", pl24)]:
        rep = (B,) * pl.ndim
        ps = block_sbp(kind, pl, bp)
        ss = state_sbp(state, ps, rep)
        data_sbp = (S0,) if kind == "data" else ((B,) if kind == "tensor" else (S0, B))
        data_axis = {"data": "x", "tensor": None, "2d": "x"}[kind]
        tensor_axis = {"data": None, "tensor": "x", "2d": "y"}[kind]
        pspecs = {k: spec_of(v, np.ndim(bp[k]), pl) for k, v in ps.items()}
        sspecs = jax.tree.map(
            lambda nd, leaf, pl=pl: spec_of(nd, np.ndim(leaf), pl), ss, state, is_leaf=is_nd_sbp
        )
        body, _ = handwritten_block_step(pl.mesh, heads, opt, data_axis, tensor_axis, pspecs)
        dspec = PS(data_axis) if data_axis else PS()
        hw = jax.jit(
            jax.shard_map(
                body, mesh=pl.mesh, in_specs=(pspecs, sspecs, dspec, dspec), out_specs=(pspecs, sspecs, PS())
            )
        )
        put = lambda v, s, pl=pl: jax.device_put(v, NamedSharding(pl.mesh, s))  # noqa: E731
        hw_args = [
            jax.tree.map(put, bp, pspecs),
            jax.tree.map(put, state, sspecs),
            put(tokens, dspec),
            put(labels, dspec),
        ]
        add(
            run_program(
                f"transformer_step_{kind}",
                step,
                pl,
                (ps, ss, data_sbp, data_sbp),
                (bp, state, tokens, labels),
                (ps, ss, rep),
                (hw, hw_args),
                repeats,
                make_check(f"transformer_{kind}", ref, 2e-3),
                samples,
            )
        )

    # (c) U @ V @ W
    m = 64 if q else 1024
    U, V, W = (rng.normal(size=(m, m)).astype(np.float32) / np.sqrt(m) for _ in range(3))
    uvw = lambda u, v, w: u @ v @ w  # noqa: E731
    hw = handwritten_uvw(pl8.mesh)
    hw_args = [
        jax.device_put(U, NamedSharding(pl8.mesh, PS(None, "x"))),
        jax.device_put(V, NamedSharding(pl8.mesh, PS("x", None))),
        jax.device_put(W, NamedSharding(pl8.mesh, PS())),
    ]
    add(
        run_program(
            "uvw",
            uvw,
            pl8,
            ((S1,), (S0,), (B,)),
            (U, V, W),
            (B,),
            (hw, hw_args),
            repeats,
            make_check("uvw", uvw(U, V, W), 1e-3),
            samples,
        )
    )

    # (d) model-parallel softmax cross-entropy over 8 class shards
    nn, cc = (32, 256) if q else (512, 16384)
    Z = rng.normal(size=(nn, cc)).astype(np.float32)
    Y = rng.integers(0, cc, size=(nn,)).astype(np.int32)
    hw = handwritten_ce(pl8.mesh)
    hw_args = [
        jax.device_put(Z, NamedSharding(pl8.mesh, PS(None, "x"))),
        jax.device_put(Y, NamedSharding(pl8.mesh, PS())),
    ]
    add(
        run_program(
            "model_parallel_softmax_ce",
            ce,
            pl8,
            ((S1,), (B,)),
            (Z, Y),
            (B,),
            (hw, hw_args),
            repeats,
            make_check("ce", ce(Z, Y), 1e-4),
            samples,
        )
    )

    # (e) the GPT sweep: Megatron over the last axis, data over the first
    for cfg in sweep:
        # at most one cold compile after the first: a plan per compile is the slow part
        add(gpt_sweep_row(cfg, repeats, min(samples, 1), rng))
    bar.close()
    rows = [r for r in rows if r is not None]
    if ESTIMATES_ONLY:
        rows += [r for r in compile_only_rows(args) if r is not None]
        refresh_estimates(args.output, rows, q)
        return
    # written before the compile-only rows too: a child that fails (raising here) leaves the
    # 8-device rows of a long run on disk, marked partial
    write(args.output, rows, dict(quick=q, repeats=repeats, compile_samples=samples, partial=True))
    # (f) the sweep on 4x4, 8x8 and 16x16, compiled only, in a process with more devices
    rows += [r for r in compile_only_rows(args) if r is not None]
    print(
        f"{'program':<34}{'sbpjax B':>12}{'gspmd B':>12}{'hand B':>12}{'t/gspmd':>9}{'t/hand':>8}"
        f"{'1st call':>9}{'cached':>8}{'solver':>8}{'solve s':>9}{'gap':>7}{'coll sj/gspmd':>15}"
    )
    for r in rows:
        hb = "-" if r["handwritten_bytes"] is None else str(r["handwritten_bytes"])
        th = "-" if r["time_ratio_vs_handwritten"] is None else f"{r['time_ratio_vs_handwritten']:.2f}"
        tg = "-" if r["time_ratio_vs_gspmd"] is None else f"{r['time_ratio_vs_gspmd']:.2f}"
        gap = "-" if r["solver_gap"] is None else f"{100 * r['solver_gap']:.1f}%"
        first = "-" if r["first_call_ratio"] is None else f"{r['first_call_ratio']:.2f}"
        cached = "-" if r["cached_call_ratio"] is None else f"{r['cached_call_ratio']:.2f}"
        print(
            f"{r['name']:<34}{r['sbpjax_bytes']:>12}{r['gspmd_bytes']:>12}{hb:>12}"
            f"{tg:>9}{th:>8}{first:>9}{cached:>8}{r['solver']:>8}"
            f"{r['solve_s']:>9.2f}{gap:>7}{r['sbpjax_collectives']:>8}/{r['gspmd_collectives']:<6}"
        )
    # (g) memory budgets against the hand-written layouts that fit them (benchmarks/_budgets.py)
    skip = args.skip_budget or (ONLY and "budget" not in ONLY)
    budget = None if skip else budget_section(q, rng, gpt_loss)
    if budget is not None:
        for b in budget["budgets"]:
            print(
                f"budget {b['budget_bytes']} B: sbpjax {b['sbpjax_bytes']} B ({b['method']}), cheapest "
                f"hand-written layout that fits {b['cheapest_fitting_bytes']} B"
            )
    write(args.output, rows, dict(quick=q, repeats=repeats, compile_samples=samples), budget)
    print(f"wrote {args.output}")


def refresh_estimates(path, rows, quick):
    """``--estimates-only``: the ``PEAK_FIELDS`` of ``rows`` written into the rows of
    the results file that bear their names (made by a run with the same ``quick``),
    recorded in ``config.rerun`` with the commit and ``--why``."""
    with open(path) as f:
        old = json.load(f)
    if old["config"].get("quick") != quick:
        raise SystemExit(f"{path} was written {'with' if not quick else 'without'} --quick; run it so")
    ran = {r["name"]: r for r in rows}
    for r in old["programs"]:
        if r["name"] in ran:
            r.update({k: ran[r["name"]][k] for k in PEAK_FIELDS})
            est, xla = r["estimated_peak_bytes"], r["sbpjax_peak_bytes"]
            print(f"{r['name']:<34} estimated {est:>11} XLA {xla:>11} {est / xla:.3f}")
    rerun = old["config"].setdefault("rerun", [])
    rerun.append({"rows": sorted(ran), "fields": list(PEAK_FIELDS), "commit": _commit(), "why": WHY})
    with open(path, "w") as f:
        json.dump(old, f, indent=1)


def write(path, rows, config, budget=None):
    """The results file: ``config`` (``partial``: the compile-only rows missing), the rows,
    and the ``budget`` section where measured. A run with ``--only`` replaces its rows in
    the file as it stands (same ``quick``), keeping the others and the budget section;
    ``config.rerun`` records which rows were measured again, at which commit and why
    (``--why``)."""
    config = dict(
        config, devices=8, timing="medians; calls interleaved across programs; gc paused while timed"
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if ONLY and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("config", {}).get("quick") == config.get("quick"):
            ran = {r["name"]: r for r in rows}
            before = {r["name"] for r in old["programs"]}
            rows = [ran.get(r["name"], r) for r in old["programs"]] + [
                r for r in rows if r["name"] not in before
            ]
            record = {"rows": sorted(ran), "commit": _commit(), "why": WHY}
            rerun = list(old["config"].get("rerun", []))
            last = rerun[-1] if rerun else {}
            # this run's own partial write (before the compile-only rows): replaced, not repeated
            ours = (last.get("commit"), last.get("why")) == (record["commit"], WHY)
            if ours and set(last.get("rows", ())) <= set(record["rows"]):
                rerun[-1] = record
            else:
                rerun.append(record)
            config = dict(old["config"], rerun=rerun)
            budget = old.get("budget") if budget is None else budget
    out = {"config": config, "programs": rows}
    if budget is not None:
        out["budget"] = budget
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def _commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


if __name__ == "__main__":
    main()
