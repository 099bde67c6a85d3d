"""Primitives every device runs on the whole value: random number generation
(every device draws the same numbers from a broadcast key), sorting along a dim.

Control flow (``scan``, ``while``, ``cond``) and primitives without a rule are
handled by the compiler: their operands are boxed to B and they run whole on
every device, with a warning naming them and their source line.
"""

from __future__ import annotations

from sbpjax.rules import B, Sig, rank, register
from sbpjax.sbp import Split

RANDOM = ("random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
          "random_split", "threefry2x32", "random_clone", "rng_bit_generator", "rng_uniform")


@register(*RANDOM)
def random(eqn, in_avals):
    """``y = f(key)`` on every device: B in, B out (the same stream everywhere)."""
    return [Sig((B,) * len(in_avals), (B,) * len(eqn.outvars))]


@register("sort")
def sort(eqn, in_avals):
    """``y_i = sort(x_i, dim)`` for splits off the sorted dim."""
    dim = eqn.params["dimension"]
    n_in, n_out = len(in_avals), len(eqn.outvars)
    return [Sig((Split(d),) * n_in, (Split(d),) * n_out) for d in range(rank(in_avals[0])) if d != dim] + [
        Sig((B,) * n_in, (B,) * n_out)]
