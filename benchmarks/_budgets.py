"""The compiler benchmark's ``budget`` section: memory budgets against the layouts a
user would write by hand.

A GPT train step (AdamW, 2x4, the batch split over x) with its parameters and
optimizer state ``AUTO`` under budgets between ZeRO-3's need and data
parallel's (per device: arguments and results, a donated pair once, by XLA's
``memory_analysis()``). Beside each plan, each hand-written layout: data
parallel, ZeRO-1/2 (parameters whole, state split 8 ways) and ZeRO-3/FSDP
(both split 8 ways), compiled by sj.jit and by GSPMD given those layouts,
with what it holds and whether it fits. ``cheapest_fitting_bytes``: the fewest
bytes any hand-written layout that fits moves, by either compiler.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
from _specs import spec_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import sbpjax as sj
from sbpjax.compiler.api import is_nd_sbp, state_sbp

B = sj.B
FRACTIONS = (0.8, 0.5, 0.2)  # of the way from ZeRO-3's need up to data parallel's


def _gpt_step(loss_fn, d, layers, rng):
    vocab, heads = 64, 8
    nrm = lambda *s: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    blocks = [
        {
            **{w: nrm(d, d) for w in ("wq", "wk", "wv", "wo")},
            "w1": nrm(d, 4 * d),
            "w2": nrm(4 * d, d),
            "g1": np.ones((d,), np.float32),
            "g2": np.ones((d,), np.float32),
        }
        for _ in range(layers)
    ]
    params = {"emb": nrm(vocab, d), "blocks": blocks, "head": nrm(d, vocab)}
    opt = optax.adamw(1e-3, weight_decay=0.1)
    tokens = rng.integers(0, vocab, size=(16, 16)).astype(np.int32)
    labels = rng.integers(0, vocab, size=(16, 16)).astype(np.int32)

    def step(p, s, tok, lab):
        loss, g = jax.value_and_grad(loss_fn)(p, tok, lab, heads)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step, (params, opt.init(params), tokens, labels)


def _split8(leaf):
    for k, n in enumerate(np.shape(leaf)):
        if n % 8 == 0:
            return (sj.S(k), sj.S(k))
    return (B, B)


def _held(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def _moved(compiled) -> int:
    return sum(c.bytes for c in sj.collectives(compiled))


def _by_hand(step, args, pl) -> list[dict]:
    params, state = args[0], args[1]
    rep = jax.tree.map(lambda _: (B, B), params)
    split = jax.tree.map(_split8, params)
    layouts = {
        "dp": (rep, state_sbp(state, rep, (B, B))),
        "zero-1/2": (rep, state_sbp(state, split, (B, B))),
        "zero-3/fsdp": (split, state_sbp(state, split, (B, B))),
    }
    data = (sj.S(0), B)
    out = []
    for name, (ps, ss) in layouts.items():
        f = sj.jit(
            step, placement=pl, in_sbp=(ps, ss, data, data), out_sbp=(ps, ss, None), donate_argnums=(0, 1)
        )
        compiled = f.lower(*args).compile()

        def shard(tree, values):
            return jax.tree.map(
                lambda nd, v: NamedSharding(pl.mesh, spec_of(nd, np.ndim(v), pl)),
                tree,
                values,
                is_leaf=is_nd_sbp,
            )

        batch = NamedSharding(pl.mesh, PS("x"))
        gspmd = jax.jit(
            step,
            in_shardings=(shard(ps, params), shard(ss, state), batch, batch),
            out_shardings=(shard(ps, params), shard(ss, state), NamedSharding(pl.mesh, PS())),
            donate_argnums=(0, 1),
        )
        out.append(
            dict(
                layout=name,
                sbpjax_bytes=_moved(compiled),
                gspmd_bytes=_moved(gspmd.lower(*args).compile()),
                held_bytes=_held(compiled),
            )
        )
    return out


def budget_section(quick: bool, rng, loss_fn, size: tuple[int, int] | None = None) -> dict:
    """The ``budget`` section of ``compiler.json`` (see the module's docstring);
    ``loss_fn(params, tokens, labels, heads)``: the sweep's GPT loss; ``size``:
    (d_model, layers), by default (32, 1) with ``quick`` and (128, 2) without
    (``tests/compiler/test_budgets.py`` runs this section at (64, 2))."""
    d, layers = size or ((32, 1) if quick else (128, 2))
    pl = sj.placement((2, 4), ("x", "y"))
    step, args = _gpt_step(loss_fn, d, layers, rng)
    hand = _by_hand(step, args, pl)
    need = {h["layout"]: h["held_bytes"] for h in hand}
    rows = []
    for frac in FRACTIONS:
        budget = int(need["zero-3/fsdp"] + frac * (need["dp"] - need["zero-3/fsdp"]))
        t0 = time.perf_counter()
        f = sj.jit(
            step,
            placement=pl,
            in_sbp=(sj.AUTO, sj.AUTO, (sj.S(0), B), (sj.S(0), B)),
            donate_argnums=(0, 1),
            memory_budget=budget,
        )
        compiled = f.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        fitting = [min(h["sbpjax_bytes"], h["gspmd_bytes"]) for h in hand if h["held_bytes"] <= budget]
        moved = _moved(compiled)
        choice = f.explain(*args).choice
        rows.append(
            dict(
                budget_bytes=budget,
                fraction=frac,
                sbpjax_bytes=moved,
                sbpjax_held_bytes=_held(compiled),
                method=choice.method,
                # [layout, bytes, bytes held] of each hand-written layout the plan was held to
                candidates=[list(c) for c in choice.candidates],
                compile_s=compile_s,
                by_hand=[dict(h, fits=h["held_bytes"] <= budget) for h in hand],
                cheapest_fitting_bytes=min(fitting),
                ratio_vs_cheapest_fitting=moved / min(fitting),
            )
        )
    return dict(model=f"gpt d_model {d}, {layers} layers, adamw, 2x4, batch over x", budgets=rows)
