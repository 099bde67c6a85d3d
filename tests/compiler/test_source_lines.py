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
    """A loop that still runs whole on every device (here ``nnx.while_loop``
    with a side effect in its body) warns at the line that built it, not
    inside Flax."""

    def body(c):
        jax.debug.callback(lambda v: None, c)  # a side effect: the loop is not planned
        return c * 2 + 1

    def fn(xs):
        out = nnx.while_loop(lambda c: c.sum() < 1e3, body, xs)  # the loop's line
        return out

    f = sj.jit(fn, placement=pl8, in_sbp=(sj.B,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(np.ones((4, 8), np.float32))
    loops = [str(w.message) for w in caught if issubclass(w.category, SBPWarning)]
    with open(HERE) as src:
        line = next(i for i, text in enumerate(src, 1) if "the loop's line" in text)
    assert loops and all(f"{HERE}:{line}" in m for m in loops), loops
