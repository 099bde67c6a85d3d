"""GSPMD's layout hints and ``jax.shard_map`` inside ``sj.jit`` (``rules.elementwise.sharding_hint``):
``jax.lax.with_sharding_constraint`` (and the ``reshard`` its gradient may
hold) pass their value through, laid out as sj.jit's solve chooses, so that a model written for
``jax.jit`` with such hints runs unchanged. Before, they ran with no rule (a
warning) and their spec, naming axes the program holds manual, raised a raw
ValueError from JAX."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import sbpjax as sj
from sbpjax import B, S

X = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
W = (np.random.default_rng(1).normal(size=(16, 32)) / 4).astype(np.float32)


def _hinted(hint):
    def loss(w, x):
        h = hint(jnp.tanh(x @ w))
        return jnp.mean(h**2)

    return jax.value_and_grad(loss)


@pytest.mark.parametrize("kind", ["named", "spec"])
def test_a_sharding_hint_passes_its_value_through(pl24, kind):
    mesh = pl24.mesh
    hints = {
        "named": lambda h: jax.lax.with_sharding_constraint(h, NamedSharding(mesh, PS("x", "y"))),
        "spec": lambda h: jax.lax.with_sharding_constraint(h, PS("x", "y")),
    }
    step = _hinted(hints[kind])
    f = sj.jit(step, placement=pl24, in_sbp=((B, S(1)), (S(0), B)), out_sbp=((B, B), (B, S(1))))
    with jax.set_mesh(mesh):  # a PartitionSpec hint needs one, as under jax.jit
        with warnings.catch_warnings():
            warnings.simplefilter("error", sj.SBPWarning)  # a rule, not "runs whole on every device"
            (loss, grad) = f(W, X)
        want_loss, want_grad = jax.jit(_hinted(lambda h: h))(W, X)
    assert_close(loss.numpy(), np.asarray(want_loss), rtol=1e-5)
    assert_close(grad.numpy(), np.asarray(want_grad), rtol=1e-5)


def test_a_shard_map_inside_is_an_sbp_error_that_says_what_to_write(pl24):
    """``jax.shard_map`` inside sj.jit is refused by name (``rules.control.
    nested_shard_map``); before, it ran with no rule and lowering raised a raw
    ``KeyError: 'subfuns'``."""

    def doubled(x):
        return jax.shard_map(lambda b: b * 2, mesh=pl24.mesh, in_specs=PS("x", "y"), out_specs=PS("x", "y"))(
            x
        )

    f = sj.jit(doubled, placement=pl24, in_sbp=((S(0), S(1)),))
    with pytest.raises(sj.SBPError, match="calls jax.shard_map.*plain jax.numpy") as err:
        f(np.ones((8, 12), np.float32))
    # the rule sees an equation; the message names the user's line that made it
    line = doubled.__code__.co_firstlineno + 1
    assert f"(at {__file__}:{line}" in str(err.value) and str(err.value).endswith("doubled))")
