"""Primitives that newer JAX releases emit where older ones did not.

jax 0.11 introduced ``one_minus_square`` (``1 - x**2``) for the derivatives of
tanh, asin, acos and atanh. Without a rule, every model with a tanh-GELU
ran that op whole on every device (an SBPWarning, and twice the bytes on the
GPT demo). The checks here pass on every supported JAX: on the older ones the
same derivatives are spelled with other primitives.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import sbpjax as sj
from sbpjax._errors import SBPWarning

# on both CI legs (pyproject.toml's markers): the primitives differ between JAX releases
pytestmark = pytest.mark.jax_versions

S0 = sj.S(0)


@pytest.mark.parametrize(
    "fn",
    [jnp.tanh, jnp.arcsin, jnp.arccos, jnp.arctanh, jax.nn.gelu],
    ids=["tanh", "asin", "acos", "atanh", "gelu"],
)
def test_elementwise_derivatives_stay_split_and_move_nothing(pl8, fn):
    x = np.random.default_rng(0).uniform(-0.9, 0.9, size=(16, 8)).astype(np.float32)

    def grad_of(v):
        return jax.grad(lambda u: fn(u).sum())(v)

    f = sj.jit(grad_of, placement=pl8, in_sbp=(S0,), out_sbp=S0)
    t = sj.to_global(x, pl8, S0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)  # every primitive has a rule
        got = f(t)
        compiled = f.lower(t).compile()
    assert_close(got.numpy(), np.asarray(jax.grad(lambda u: fn(u).sum())(x)), rtol=1e-5)
    assert f.explain(t).bytes == 0 and sj.collectives(compiled) == []


def test_one_minus_square_has_a_rule_when_jax_has_the_primitive():
    from sbpjax.rules import RULES

    if not hasattr(jax.lax, "one_minus_square"):
        # jax 0.10.2 (CI's first leg) predates the primitive; the newest-jax leg runs this
        pytest.skip(f"jax {jax.__version__} has no one_minus_square primitive")
    jaxpr = jax.make_jaxpr(jax.lax.one_minus_square)(jnp.ones(3))
    assert {e.primitive.name for e in jaxpr.eqns} <= set(RULES)


def test_incomplete_gamma_gradients_stay_split(pl8):
    """``jax.scipy.special.gammainc``'s gradient in ``a`` is ``igamma_grad_a``."""
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 3.0, size=(16,)).astype(np.float32)
    x = rng.uniform(0.1, 4.0, size=(16,)).astype(np.float32)

    def grads(a, x):
        return jax.grad(lambda a, x: jax.scipy.special.gammainc(a, x).sum(), argnums=(0, 1))(a, x)

    f = sj.jit(grads, placement=pl8, in_sbp=(S0, S0), out_sbp=(S0, S0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        got = f(a, x)
        assert f.explain(a, x).bytes == 0
    for g, w in zip(got, grads(a, x)):
        assert_close(g.numpy(), np.asarray(w), rtol=1e-5)
