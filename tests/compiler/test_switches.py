"""A ``cond`` / ``switch`` inside ``sj.jit`` runs as a ``lax.switch``
(sbpjax.compiler.switches): only the branch taken computes, each branch's
collectives inside it, values equal to JAX's, the plan's bytes the compiled
program's. Checked on the compiled HLO: the collectives of a branch lie in a
branch computation of a ``conditional``, not in the entry computation."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler import explain, local_plan
from sbpjax.compiler.api import state_sbp

N, D, H = 16, 32, 64
W1_SBP, W2_SBP, X_SBP = (B, S(1)), (B, S(0)), (S(0), B)  # Megatron over 'y', data over 'x'
COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def weights(seed=0, layers=None):
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    w1 = (rng.normal(size=(*lead, D, H)) / np.sqrt(D)).astype(np.float32)
    w2 = (rng.normal(size=(*lead, H, D)) / np.sqrt(H)).astype(np.float32)
    x = rng.normal(size=(N, D)).astype(np.float32)
    return w1, w2, x


def mlp(h, w1, w2):
    return h + jax.nn.gelu(h @ w1) @ w2


def computations(compiled) -> dict:
    """HLO computation name -> its text (the entry one under 'ENTRY')."""
    out, name = {}, None
    for line in compiled.as_text().splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def branch_collectives(compiled) -> tuple[int, int]:
    """(collectives in the entry computation, collectives in branch computations
    of its conditionals)."""
    comps = computations(compiled)
    branches = set()
    for text in comps.values():
        for names in re.findall(r"branch_computations=\{([^}]*)\}", text):
            branches |= {n.strip().lstrip("%") for n in names.split(",")}
    assert branches, "no conditional in the compiled program"
    return len(COLLECTIVE.findall(comps["ENTRY"])), sum(len(COLLECTIVE.findall(comps[b])) for b in branches)


def measured(compiled) -> int:
    return sum(c.bytes for c in sj.collectives(compiled))


@pytest.mark.parametrize("as_switch", [True, False], ids=["switch", "written_out"])
def test_a_cond_runs_only_the_branch_it_takes_with_its_collectives_inside(pl24, as_switch, monkeypatch):
    """A cond that cannot run as a switch (here: none may) runs written out,
    every branch computed and a select picking: the same values."""
    if not as_switch:
        for module in (local_plan, explain):
            monkeypatch.setattr(module, "plan_switches", lambda prop, runs: ({}, {}))
    w1, w2, x = weights()

    def fn(x, w1, w2, flag):
        # tanh after the block: its partial sum must be reduced inside the branch
        return jax.lax.cond(flag, lambda *a: jnp.tanh(mlp(*a)), lambda h, *_: h * 2.0, x, w1, w2)

    f = sj.jit(fn, placement=pl24, in_sbp=(X_SBP, W1_SBP, W2_SBP, (B, B)), out_sbp=X_SBP)
    for flag in (True, False):
        y = f(x, w1, w2, np.bool_(flag))
        assert_close(y.numpy(), np.asarray(fn(x, w1, w2, flag)), rtol=1e-5)
    compiled = f.lower(x, w1, w2, np.bool_(True)).compile()
    assert [kept for *_, kept in f.explain(x, w1, w2, np.bool_(True)).conds] == [as_switch]
    if not as_switch:
        assert " conditional(" not in compiled.as_text()
        assert measured(compiled) == f.explain(x, w1, w2, np.bool_(True)).bytes > 0
        return
    in_entry, in_branches = branch_collectives(compiled)
    # the Megatron block's all-reduce runs in its branch only
    assert in_entry == 0 and in_branches >= 1
    assert measured(compiled) == f.explain(x, w1, w2, np.bool_(True)).bytes > 0


def test_switch_with_an_index_made_from_a_partial_value(pl24):
    """The index is computed from a product that is partial over 'y': it is
    reduced before the switch, so every device takes the same branch."""
    w1, w2, x = weights(1)
    branches = [
        lambda h, w1, w2: mlp(h, w1, w2),
        lambda h, w1, w2: jnp.tanh(h) @ w1 @ w2,
        lambda h, w1, w2: h - 1.0,
    ]

    def fn(x, w1, w2, shift):
        k = (jnp.sum(jax.nn.relu(x @ w1) @ w2) + shift > 0).astype(jnp.int32) + (shift > 100).astype(
            jnp.int32
        )
        return jax.lax.switch(k, branches, x, w1, w2)

    f = sj.jit(fn, placement=pl24, in_sbp=(X_SBP, W1_SBP, W2_SBP, (B, B)), out_sbp=X_SBP)
    base = float(jnp.sum(jax.nn.relu(x @ w1) @ w2))
    for shift in (-base - 10.0, -base + 10.0, 1000.0):  # branches 0, 1 and 2
        y = f(x, w1, w2, np.float32(shift))
        want = fn(x, w1, w2, np.float32(shift))
        assert_close(y.numpy(), np.asarray(want), rtol=1e-5, scale=10.0)
    compiled = f.lower(x, w1, w2, np.float32(0.0)).compile()
    assert " conditional(" in compiled.as_text()
    assert measured(compiled) == f.explain(x, w1, w2, np.float32(0.0)).bytes


def test_a_value_boxed_in_a_branch_and_read_after_the_cond(pl24):
    """``x`` is sorted along its split dim in a branch and after the cond: the
    boxing both read runs once, before the switch, where both see it (the
    propagation recorded it at the branch's sort, its first reader)."""
    w1, w2, x = weights(2)

    def fn(x, w1, flag):
        y = jax.lax.cond(flag, lambda v: jnp.sort(v, axis=0)[-1], lambda v: v[0] * 3.0, x)
        return y + jnp.sort(x, axis=0)[0]

    f = sj.jit(fn, placement=pl24, in_sbp=(X_SBP, W1_SBP, (B, B)), out_sbp=(B, B))
    for flag in (True, False):
        assert_close(f(x, w1, np.bool_(flag)).numpy(), np.asarray(fn(x, w1, flag)), rtol=1e-6, scale=4.0)
    compiled = f.lower(x, w1, np.bool_(True)).compile()
    in_entry, in_branches = branch_collectives(compiled)
    assert in_entry >= 2 and in_branches >= 1  # x's boxing and the output's before / after; a branch's own
    assert measured(compiled) == f.explain(x, w1, np.bool_(True)).bytes


def test_nested_conds_and_a_cond_inside_scanned_layers(pl24):
    w1, w2, x = weights(3, layers=3)

    def layer(h, w):
        inner = lambda v: jax.lax.cond(jnp.sum(v) > 0, lambda u: u * 0.5, jnp.tanh, v)  # noqa: E731
        h = jax.lax.cond(w[0][0, 0] > 0, lambda v: mlp(v, *w), inner, h)
        return h, None

    def loss(w1, w2, x):
        h, _ = jax.lax.scan(layer, x, (w1, w2))
        return jnp.mean(h**2)

    g = jax.value_and_grad(loss, argnums=(0, 1))
    wl = ((B, S(2)), (B, S(1)))  # the stacked dim whole, Megatron over 'y'
    f = sj.jit(g, placement=pl24, in_sbp=(*wl, X_SBP), out_sbp=(None, wl))
    assert (w1[:, 0, 0] > 0).any() and (w1[:, 0, 0] <= 0).any()  # both branches taken
    with warnings.catch_warnings():
        warnings.simplefilter("error", sj.SBPWarning)
        value, grads = f(w1, w2, x)
    want_value, want_grads = jax.jit(g)(w1, w2, x)
    assert_close(value.numpy(), np.asarray(want_value), rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert_close(got.numpy(), np.asarray(want), rtol=1e-4, scale=np.abs(want).max())
    compiled = f.lower(w1, w2, x).compile()
    text = compiled.as_text()
    assert " conditional(" in text and " while(" in text  # the scan kept as a loop, its conds inside
    assert measured(compiled) == f.explain(w1, w2, x).bytes


def test_scanned_layers_then_a_cond_train_like_jax_grad(pl24):
    """The issue's program: Megatron layers under lax.scan, a cond after them."""
    w1, w2, x = weights(4, layers=4)

    def loss(w1, w2, x):
        h, _ = jax.lax.scan(lambda h, w: (mlp(h, *w), None), x, (w1, w2))
        h = jax.lax.cond(jnp.mean(h) > 0, lambda v: v @ w1[0], lambda v: jnp.sin(v) @ w1[1], h)
        return jnp.mean(h**2)

    g = jax.value_and_grad(loss, argnums=(0, 1))
    wl = ((B, S(2)), (B, S(1)))  # the stacked dim whole, Megatron over 'y'
    f = sj.jit(g, placement=pl24, in_sbp=(*wl, X_SBP), out_sbp=(None, wl))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sj.SBPWarning)
        value, grads = f(w1, w2, x)
    want_value, want_grads = jax.jit(g)(w1, w2, x)
    assert_close(value.numpy(), np.asarray(want_value), rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert got.sbp in wl
        assert_close(got.numpy(), np.asarray(want), rtol=1e-4, scale=np.abs(want).max())
    compiled = f.lower(w1, w2, x).compile()
    text = compiled.as_text()
    assert text.count(" while(") == 2 and " conditional(" in text
    assert measured(compiled) == f.explain(w1, w2, x).bytes


@pytest.mark.parametrize("steps", [3])
def test_gradient_accumulation_with_optax_multisteps(pl24, steps):
    """optax.MultiSteps applies its inner optimizer in a lax.cond every k-th step."""
    w1, w2, x = weights(5)
    y = np.random.default_rng(6).normal(size=x.shape).astype(np.float32)
    params = {"w1": w1, "w2": w2}
    ps = {"w1": W1_SBP, "w2": W2_SBP}
    opt = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2)

    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(x, p["w1"], p["w2"]) - y) ** 2))(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    state = opt.init(params)
    ss = state_sbp(state, ps, (B, B))
    f = sj.jit(step, placement=pl24, in_sbp=(ps, ss, X_SBP, X_SBP), out_sbp=(ps, ss, (B, B)))
    ref = jax.jit(step)
    p, s, rp, rs = params, state, params, state
    for _ in range(steps):
        with warnings.catch_warnings():
            warnings.simplefilter("error", sj.SBPWarning)
            out = f(p, s, x, y)
        p, s, loss = jax.tree.map(lambda t: t.numpy(), out, is_leaf=lambda t: isinstance(t, sj.GlobalTensor))
        rp, rs, rloss = ref(rp, rs, x, y)
        assert_close(loss, np.asarray(rloss), rtol=1e-5)
        for got, want in zip(jax.tree.leaves(p), jax.tree.leaves(rp)):
            assert_close(got, np.asarray(want), rtol=1e-5)


def test_a_reduction_one_branch_needs_is_made_inside_that_branch(pl24):
    """The Megatron block's output is partial over 'y'; the other branch's is
    not. Reducing after the cond (the other branch's result turned partial by
    zero-filling) moves the same bytes but runs on every step; the layout
    choice prices what runs inside a branch by the chance it runs, so the
    all-reduce is made inside the block's branch."""
    w1, w2, x = weights(7)

    def fn(x, w1, w2, flag):
        return jax.lax.cond(flag, mlp, lambda h, *_: h * 2.0, x, w1, w2)

    f = sj.jit(fn, placement=pl24, in_sbp=(X_SBP, W1_SBP, W2_SBP, (B, B)), out_sbp=X_SBP)
    for flag in (True, False):
        assert_close(f(x, w1, w2, np.bool_(flag)).numpy(), np.asarray(fn(x, w1, w2, flag)), rtol=1e-5)
    compiled = f.lower(x, w1, w2, np.bool_(True)).compile()
    assert branch_collectives(compiled) == (0, 1)
    assert measured(compiled) == f.explain(x, w1, w2, np.bool_(True)).bytes


X_SMALL = np.random.default_rng(8).normal(size=(8, 12)).astype(np.float32)
W_SMALL = np.random.default_rng(9).normal(size=(12, 16)).astype(np.float32) / 4
CONDS = {
    "identity_branch": lambda x, w, k: jax.lax.cond(k > 0, lambda v: v, lambda v: jnp.tanh(v @ w @ w.T), x),
    "zeros_branch": lambda x, w, k: jax.lax.cond(k > 0, jnp.zeros_like, lambda v: v @ w @ w.T, x),
    "two_results": lambda x, w, k: jax.lax.cond(
        k > 0, lambda v: (v @ w, v.sum(0)), lambda v: (jnp.sin(v) @ w, v.max(0)), x
    ),
    "literal_branch": lambda x, w, k: jax.lax.cond(k > 0, lambda v: 1.0, jnp.sum, x),
    "grad_through_identity": jax.grad(
        lambda x, w, k: jnp.sum(
            jax.lax.cond(k > 0, lambda v: v, lambda v: jnp.tanh(v @ w.T @ w), x @ w) ** 2
        ),
        argnums=(0, 1),
    ),
    "grad_through_switch": jax.grad(
        lambda x, w, k: jnp.sum(
            jax.lax.switch(k, [lambda v: v @ w, lambda v: jnp.cos(v) @ w, lambda v: (v * 2) @ w], x) ** 2
        ),
        argnums=(0, 1),
    ),
    "nested": lambda x, w, k: jax.lax.cond(
        k > 0,
        lambda v: jax.lax.cond(k > 1, lambda u: u @ w, lambda u: (u * u) @ w, v),
        lambda v: v[:, :1] @ w[:1],
        x,
    ),
    "index_from_data": lambda x, w, k: jax.lax.cond(jnp.sum(x @ w) > k, lambda v: v @ w, lambda v: -v @ w, x),
}
LAYOUTS = [((S(0), B), (B, S(1))), ((S(0), S(1)), (S(0), B)), ((B, S(1)), (S(1), B)), ((S(1), S(0)), (B, B))]


@pytest.mark.slow
@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda ls: "_".join(map(sj.format_sbp, ls)))
@pytest.mark.parametrize("name", sorted(CONDS))
def test_conds_of_every_shape_in_every_layout(pl24, name, layouts):
    """Identity and constant branches, several results, literals, gradients
    through a cond and a switch, nested conds, an index made from the data:
    each branch value equals JAX's, the cond runs as a switch, the plan's
    bytes are the compiled program's."""
    fn = CONDS[name]
    f = sj.jit(fn, placement=pl24, in_sbp=(*layouts, (B, B)))
    for k in (0, 1, 2):
        got = jax.tree.leaves(
            f(X_SMALL, W_SMALL, np.int32(k)), is_leaf=lambda t: isinstance(t, sj.GlobalTensor)
        )
        want = jax.tree.leaves(fn(X_SMALL, W_SMALL, np.int32(k)))
        for g, w in zip(got, want):
            assert_close(g.numpy(), np.asarray(w), rtol=1e-5, scale=8.0)
    explanation = f.explain(X_SMALL, W_SMALL, np.int32(0))
    assert explanation.conds and all(kept for *_, kept in explanation.conds)
    assert measured(f.lower(X_SMALL, W_SMALL, np.int32(0)).compile()) == explanation.bytes
