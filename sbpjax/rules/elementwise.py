"""Elementwise primitives: the same op on every element, so any split works.

Per device: ``y_i = f(x_i)`` where every input is split the same way (or
broadcast). Partial algebra (per device ``i``, logical ``x = op_i x_i``):

* ``sum_i a_i + sum_i b_i = sum_i (a_i + b_i)``: P + P -> P (add, sub, add_any);
* ``(sum_i a_i) * b = sum_i (a_i * b)``: P * B -> P, and P / B -> P;
* ``-(max_i a_i) = min_i (-a_i)``: -P(max) -> P(min) and back;
* ``max(max_i a_i, max_i b_i) = max_i max(a_i, b_i)``: P(max) with P(max) or B;
* ``select(c, sum a_i, sum b_i) = sum_i select(c, a_i, b_i)`` for a broadcast c;
* monotone or linear casts keep their partial.
Everything else (exp, log, tanh, erf, integer_pow, comparisons...) needs the
full value: S or B inputs only.
"""

from __future__ import annotations

from sbpjax.rules import B, P, Sig, rank, register
from sbpjax.sbp import Split

NONLINEAR = (
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "erf",
    "erfc",
    "erf_inv",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "integer_pow",
    "pow",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "not",
    "and",
    "or",
    "xor",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "rem",
    "atan2",
    "nextafter",
    "square",
    "clamp",
    "population_count",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "lgamma",
    "digamma",
    "bessel_i0e",
    "bessel_i1e",
    "igamma",
    "igammac",
    "random_gamma_grad",
    "imag",
    "real",
    "conj",
    "complex",
    "exp2",
    "polygamma",
    "zeta",
    "regularized_incomplete_beta",
    "one_minus_square",  # 1 - x**2, new in jax 0.11 (tanh, asin, acos, atanh derivatives)
    "log2",
    "polynomial",  # new in jax 0.12 (jnp.log2; jnp.polyval with scalar coefficients: B)
)


def _split_and_broadcast(eqn, in_avals):
    """S(d) on every (non-scalar) input -> S(d); B -> B."""
    out_shape = tuple(eqn.outvars[0].aval.shape)
    sigs = []
    for d in range(len(out_shape)):
        # an operand of size 1 along d is broadcast there (jaxprs allow it): B
        ins = tuple(
            Split(d) if rank(a) == len(out_shape) and a.shape[d] == out_shape[d] else B for a in in_avals
        )
        sigs.append(Sig(ins, (Split(d),) * len(eqn.outvars)))
    sigs.append(Sig((B,) * len(in_avals), (B,) * len(eqn.outvars)))
    return sigs


@register(*NONLINEAR)
def nonlinear(eqn, in_avals):
    """``y_i = f(x_i)``: splits and broadcast only."""
    return _split_and_broadcast(eqn, in_avals)


@register("add", "sub", "add_any")
def additive(eqn, in_avals):
    """``a + b``: also ``sum_i a_i + sum_i b_i = sum_i (a_i + b_i)`` (P + P -> P)."""
    return _split_and_broadcast(eqn, in_avals) + [Sig((P(),) * len(in_avals), (P(),))]


@register("mul")
def multiply(eqn, in_avals):
    """``a * b``: also ``(sum_i a_i) * b = sum_i a_i * b`` (P * B -> P, B * P -> P)."""
    return _split_and_broadcast(eqn, in_avals) + [Sig((P(), B), (P(),)), Sig((B, P()), (P(),))]


@register("div")
def divide(eqn, in_avals):
    """``a / b``: also ``(sum_i a_i) / b = sum_i a_i / b`` (P / B -> P)."""
    return _split_and_broadcast(eqn, in_avals) + [Sig((P(), B), (P(),))]


@register("neg")
def negate(eqn, in_avals):
    """``-x``: ``-sum_i x_i = sum_i -x_i``; ``-max_i x_i = min_i -x_i``."""
    return _split_and_broadcast(eqn, in_avals) + [
        Sig((P(),), (P(),)),
        Sig((P("max"),), (P("min"),)),
        Sig((P("min"),), (P("max"),)),
    ]


@register("max", "min")
def extreme(eqn, in_avals):
    """``max(a, b)``: ``max(max_i a_i, max_i b_i) = max_i max(a_i, b_i)``, and
    ``max(max_i a_i, b) = max_i max(a_i, b)``."""
    op = eqn.primitive.name
    return _split_and_broadcast(eqn, in_avals) + [
        Sig((P(op), P(op)), (P(op),)),
        Sig((P(op), B), (P(op),)),
        Sig((B, P(op)), (P(op),)),
    ]


@register(
    "convert_element_type", "reduce_precision", "copy", "copy_p", "stop_gradient", "optimization_barrier"
)
def passthrough(eqn, in_avals):
    """``y_i = cast(x_i)``: a cast is monotone (keeps P(max), P(min)) and, between
    floating types or from integers to floats, linear up to rounding (keeps P(sum))."""
    import numpy as np

    n = len(in_avals)
    sigs = _split_and_broadcast(eqn, in_avals) + [
        Sig((P("max"),) * n, (P("max"),) * n),
        Sig((P("min"),) * n, (P("min"),) * n),
    ]
    out_dtype = eqn.outvars[0].aval.dtype
    if np.issubdtype(out_dtype, np.floating) or all(
        np.issubdtype(a.dtype, np.integer) and np.issubdtype(out_dtype, np.integer) for a in in_avals
    ):
        sigs.append(Sig((P(),) * n, (P(),) * n))
    return sigs


@register("select_n")
def select(eqn, in_avals):
    """``select(c, a, b)``: splits and broadcast, and for a broadcast ``c``,
    ``select(c, op_i a_i, op_i b_i) = op_i select(c, a_i, b_i)``."""
    n_cases = len(in_avals) - 1
    sigs = _split_and_broadcast(eqn, in_avals)
    for op in ("sum", "max", "min"):
        sigs.append(Sig((B,) + (P(op),) * n_cases, (P(op),)))
    return sigs


# Same-shape elementwise primitives: a layout wanted at the output is wanted at
# the inputs too (used by the compiler to carry output preferences backwards).
ELEMENTWISE = frozenset(NONLINEAR) | {
    "add",
    "sub",
    "add_any",
    "mul",
    "div",
    "neg",
    "max",
    "min",
    "convert_element_type",
    "copy",
    "copy_p",
    "stop_gradient",
    "select_n",
}


@register("bitcast_convert_type")
def bitcast(eqn, in_avals):
    """``y_i = bitcast(x_i)``: each element's bits read as another type (random
    floats are made this way). Between types of one width the shape is kept;
    otherwise a trailing dim is added or removed, so the leading dims can split."""
    out_shape = tuple(eqn.outvars[0].aval.shape)
    in_shape = tuple(in_avals[0].shape)
    keep = [d for d in range(min(len(in_shape), len(out_shape))) if in_shape[d] == out_shape[d]]
    return [Sig((Split(d),), (Split(d),)) for d in keep] + [Sig((B,), (B,))]
