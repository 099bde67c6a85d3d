"""A top-2 mixture-of-experts layer (router, top_k, dense dispatch, expert-
parallel weights): no primitive runs whole on every device, the values equal
one device's, and the compiled step moves no more than GSPMD's with the same
shardings (read from both compiled programs)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import sbpjax as sj
from sbpjax._errors import SBPWarning

T, D, H, E = 64, 16, 32, 8
S0, B = sj.S(0), sj.B


def moe_loss(p, x):
    probs = jax.nn.softmax(x @ p["router"], axis=-1)
    gate, idx = jax.lax.top_k(probs, 2)  # top-2 routing
    mask = jax.nn.one_hot(idx, E, dtype=x.dtype)  # (T, 2, E)
    combine = jnp.einsum("tk,tke->te", gate, mask)
    xe = jnp.einsum("te,td->etd", mask.sum(1), x)  # dispatch: tokens to experts
    h = jax.nn.gelu(jnp.einsum("etd,edh->eth", xe, p["w1"]))
    ye = jnp.einsum("eth,ehd->etd", h, p["w2"])
    y = jnp.einsum("etd,te->td", ye, combine)  # combine: experts back to tokens
    return jnp.mean((y - x) ** 2)


@pytest.mark.parametrize(
    "grid,tokens,experts,specs",
    [
        ((8,), (S0,), (S0,), (PS("x"), PS("x"))),
        ((2, 4), (S0, S0), (B, S0), (PS(("x", "y")), PS("y"))),
    ],
    ids=["8-expert-parallel", "2x4-data-x-expert"],
)
def test_top2_moe_step(grid, tokens, experts, specs):
    pl = sj.placement(grid, ("x", "y")[: len(grid)])
    rng = np.random.default_rng(0)
    p = {
        "router": rng.normal(size=(D, E)).astype(np.float32),
        "w1": (0.1 * rng.normal(size=(E, D, H))).astype(np.float32),
        "w2": (0.1 * rng.normal(size=(E, H, D))).astype(np.float32),
    }
    x = rng.normal(size=(T, D)).astype(np.float32)
    replicated = (B,) * len(grid)
    p_sbp = {"router": replicated, "w1": experts, "w2": experts}
    step = jax.value_and_grad(moe_loss)
    f = sj.jit(step, placement=pl, in_sbp=(p_sbp, tokens), out_sbp=(replicated, p_sbp))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        loss, grads = f(p, x)
        compiled = f.lower(p, x).compile()
    want_loss, want_grads = jax.jit(step)(p, x)
    assert_close(loss.numpy(), want_loss, rtol=1e-5)
    for k in p:
        assert_close(grads[k].numpy(), want_grads[k], rtol=1e-4, err_msg=k)
    ours = sum(c.bytes for c in sj.collectives(compiled))
    assert ours == f.explain(p, x).bytes

    token_spec, expert_spec = specs
    shard = lambda s: NamedSharding(pl.mesh, s)  # noqa: E731
    p_specs = {"router": shard(PS()), "w1": shard(expert_spec), "w2": shard(expert_spec)}
    g = jax.jit(step, in_shardings=(p_specs, shard(token_spec)), out_shardings=(shard(PS()), p_specs))
    theirs = sum(c.bytes for c in sj.collectives(g.lower(p, x).compile()))
    assert 0 < ours <= theirs, (ours, theirs)
