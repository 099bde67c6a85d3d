"""A memory budget's plan is no worse than the ZeRO layouts a user writes by
hand (``sbpjax.compiler.hand_layouts``), including ZeRO over the batch's axis
alone with odd-sized tensors whole (what ``zero="data"`` and
``sbpjax.flax.zero_layout`` write). Each case here was found by a held-out
sweep: the plan moved 1.20-1.61x that layout's bytes while it fit the budget.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from models import train_step

import sbpjax as sj
from sbpjax import B, S


def _mlp(widths, opt, rows=64):
    rng = np.random.default_rng(0)
    params = {}
    for i in range(len(widths) - 1):
        params[f"w{i}"] = (rng.normal(size=(widths[i], widths[i + 1])) / np.sqrt(widths[i])).astype(
            np.float32
        )
        params[f"b{i}"] = np.full(widths[i + 1], 0.01 * i, np.float32)
    x = rng.normal(size=(rows, widths[0])).astype(np.float32)
    y = rng.normal(size=(rows, widths[-1])).astype(np.float32)

    def loss(p, x, y):
        h = x
        for i in range(len(widths) - 1):
            h = h @ p[f"w{i}"] + p[f"b{i}"]
            if i < len(widths) - 2:
                h = jax.nn.gelu(h)
        return jnp.mean((h - y) ** 2)

    return loss, opt, (params, opt.init(params), x, y)


def _embedding(opt, vocab=100, d=48, tokens=(16, 12)):
    rng = np.random.default_rng(0)
    params = {
        "emb": (rng.normal(size=(vocab, d)) * 0.5).astype(np.float32),
        "w": (rng.normal(size=(d, 72)) / np.sqrt(d)).astype(np.float32),
        "head": (rng.normal(size=(72, vocab)) / np.sqrt(72)).astype(np.float32),
        "hb": np.zeros(vocab, np.float32),  # no dim 8 divides
    }
    tok = rng.integers(0, vocab, size=tokens).astype(np.int32)
    lab = rng.integers(0, vocab, size=tokens).astype(np.int32)

    def loss(p, tok, lab):
        logits = jnp.tanh(p["emb"][tok] @ p["w"]) @ p["head"] + p["hb"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, lab).mean()

    return loss, opt, (params, opt.init(params), tok, lab)


def _zero_over(axis: int, pl):
    """sbpjax.flax.zero_layout's layout of a leaf: its first dim the axis
    divides split over that axis, whole elsewhere (and whole where none does)."""

    def nd(a):
        rep = (B,) * pl.ndim
        for d, n in enumerate(np.shape(a)):
            if n % pl.shape[axis] == 0:
                return rep[:axis] + (S(d),) + rep[axis + 1 :]
        return rep

    return nd


def _moved(f, args) -> int:
    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def _held(f, args) -> int:
    """Bytes per device the compiled step holds in arguments and results
    (a donated argument and its result once), as XLA counts them."""
    m = f.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


CASES = {
    # 4x2, batch over x: ZeRO over x alone fits budgets that split everything would need
    "mlp_4x2_sgd_momentum": (
        lambda: _mlp([50, 120, 33, 200, 72, 96, 10], optax.sgd(0.05, momentum=0.9)),
        ((4, 2), ("x", "y")),
        (S(0), B),
        [318_744, 127_497],
    ),
    # 8 devices: the head bias (100,) stays whole, as zero_layout keeps it
    "embedding_8_adam": (lambda: _embedding(optax.adam(1e-2)), ((8,), ("d",)), (S(0),), [28_030]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_budget_plan_moves_no_more_than_zero_over_the_batch_axis(case):
    make, (shape, names), batch, budgets = CASES[case]
    pl = sj.placement(shape, names)
    loss, opt, args = make()
    step = train_step(loss, opt)
    zero_nd = _zero_over(0, pl)
    zp, zs = jax.tree.map(zero_nd, args[0]), jax.tree.map(zero_nd, args[1])
    by_hand = sj.jit(
        step, placement=pl, in_sbp=(zp, zs, batch, batch), out_sbp=(zp, zs, None), donate_argnums=(0, 1)
    )
    hand_bytes = _moved(by_hand, args)
    want = jax.jit(step)(*args)
    for budget in budgets:
        f = sj.jit(
            step,
            placement=pl,
            in_sbp=(None, None, batch, batch),
            auto=True,
            donate_argnums=(0, 1),
            memory_budget=budget,
        )
        e = f.explain(*args)
        assert e.choice.memory_bytes <= budget
        assert _held(by_hand, args) <= budget  # the case's premise: the hand layout fits
        assert _moved(f, args) <= hand_bytes, (budget, e.choice.describe())
        got = jax.tree.leaves(f(*args), is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
        for g, w in zip(got, jax.tree.leaves(want)):
            assert_close(g.numpy(), np.asarray(w), rtol=1e-4)
        # each hand-written layout is listed once
        listed = [c[0] for c in e.choice.candidates]
        assert len(listed) == len(set(listed)), listed


def test_budgets_tried_in_one_process_list_each_candidate_once():
    loss, opt, args = _mlp([96, 200, 72], optax.adamw(1e-2))
    step = train_step(loss, opt)
    pl = sj.placement(8, "d")
    for budget in (900_000, 450_000, 270_000):
        f = sj.jit(
            step,
            placement=pl,
            in_sbp=(None, None, S(0), S(0)),
            auto=True,
            donate_argnums=(0, 1),
            memory_budget=budget,
            plan_cache=False,
        )
        listed = [c[0] for c in f.explain(*args).choice.candidates]
        assert len(listed) == len(set(listed)), (budget, listed)
