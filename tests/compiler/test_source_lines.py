"""Plans and warnings point at the user's line, not at Flax's or sbpjax's."""

import os
import warnings

import flax
import jax
import numpy as np
from flax import nnx

import sbpjax as sj
from sbpjax._errors import SBPWarning

FLAX = os.path.dirname(os.path.abspath(flax.__file__))
HERE = os.path.abspath(__file__)


class Net(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)  # the line an nnx.Linear's ops must point at


def test_ops_inside_flax_layers_point_at_the_calling_line(pl8):
    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def fwd(p, x):
        return nnx.merge(graphdef, p)(x).sum()

    f = sj.jit(fwd, placement=pl8, in_sbp=(sj.B, sj.S(0)))
    x = np.ones((16, 8), np.float32)
    ops = f.explain(state, x).ops
    dots = [src for name, src, _, _ in ops if name == "dot_general"]
    assert dots and all(src.startswith(HERE) and "(Net.__call__)" in src for src in dots), dots
    assert not any(src.startswith(FLAX) for _, src, _, _ in ops)


def test_warning_inside_nnx_while_loop_names_the_users_line(pl8):
    """An op without a rule inside ``nnx.while_loop``'s body (its body is
    planned on its own: sbpjax.compiler.inner_loops) warns at the user's
    line, not inside Flax."""

    def absmax(a):  # a host callback has no rule
        return np.abs(a).max(axis=1).astype(np.float32)

    def body(c):
        peak = jax.pure_callback(absmax, jax.ShapeDtypeStruct(c.shape[:1], np.float32), c)  # the op's line
        return peak[:, None] * 0.5 + c * 2

    def fn(xs):
        return nnx.while_loop(lambda c: c.sum() < 1e3, body, xs)

    f = sj.jit(fn, placement=pl8, in_sbp=(sj.B,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(np.ones((8, 8), np.float32))
    loops = [str(w.message) for w in caught if issubclass(w.category, SBPWarning)]
    with open(HERE) as src:
        line = next(i for i, text in enumerate(src, 1) if "the op's line" in text)
    assert loops and all(f"{HERE}:{line}" in m for m in loops), loops


def test_ops_of_jax_helpers_without_frames_point_at_the_call(pl8):
    """``jnp.take_along_axis`` runs jitted helpers whose equations JAX traces
    with no frame at all; their ops take the line that called the helper."""
    import jax.numpy as jnp

    def pick(x, idx):
        return jnp.take_along_axis(x, idx[:, None], axis=1)  # the line the gather must point at

    f = sj.jit(pick, placement=pl8, in_sbp=(sj.S(0), sj.S(0)))
    x, idx = np.ones((16, 8), np.float32), np.zeros((16,), np.int32)
    ops = f.explain(x, idx).ops
    assert any(name == "gather" for name, _, _, _ in ops)
    assert all(src.startswith(HERE) and src.endswith("pick)") for _, src, _, _ in ops), ops


def test_loops_of_jax_helpers_without_frames_point_at_the_call(pl8):
    """``jnp.searchsorted`` runs a loop inside a jitted helper: the written-out
    loop, like its ops, takes the line that called the helper."""
    import jax.numpy as jnp

    def find(a, v):
        return jnp.searchsorted(a, v)

    f = sj.jit(find, placement=pl8, in_sbp=(sj.B, sj.S(0)))
    a = np.sort(np.random.default_rng(0).normal(size=32)).astype(np.float32)
    v = np.random.default_rng(1).normal(size=16).astype(np.float32)
    ex = f.explain(a, v)
    assert ex.loops and all(src.startswith(HERE) and src.endswith("find)") for src, _, _ in ex.loops), (
        ex.loops
    )
    assert all(src.startswith(HERE) for _, src, _, _ in ex.ops)
    np.testing.assert_array_equal(f(a, v).numpy(), np.asarray(jnp.searchsorted(a, v)))
