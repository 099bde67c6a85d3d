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

import jax.numpy as jnp
import numpy as np

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
    "eq_to",  # total-order comparisons (-0.0 < 0.0, NaNs ordered): jnp.searchsorted, sort's keys
    "le_to",
    "lt_to",
    "rem",
    "atan2",
    "nextafter",
    "square",
    "clamp",
    "population_count",
    "clz",  # count leading zeros
    "mulhi",  # the high half of an integer product
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "lgamma",
    "digamma",
    "bessel_i0e",
    "bessel_i1e",
    "igamma",
    "igammac",
    "igamma_grad_a",  # the derivative of gammainc in a
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


@register("reduce_precision", "copy", "copy_p", "stop_gradient", "optimization_barrier", "name")
def passthrough(eqn, in_avals):
    """``y_i = x_i`` (up to rounding for ``reduce_precision``; ``name`` is
    ``checkpoint_name``'s tag): every layout and every partial passes."""
    n = len(in_avals)
    return _split_and_broadcast(eqn, in_avals) + [
        Sig((P(op),) * n, (P(op),) * n) for op in ("sum", "max", "min")
    ]


@register("sharding_constraint", "reshard", local=lambda eqn, ins, ctx: list(ins))
def sharding_hint(eqn, in_avals):
    """``jax.lax.with_sharding_constraint`` / ``jax.sharding.reshard``: a layout
    for GSPMD, which ``sj.jit`` does not run; its own solve lays the value out
    and the op passes it through as it is (``sj.constrain`` pins an nd-SBP).
    Decision: a hint, not an error, so that a model written for ``jax.jit``
    with such hints runs unchanged; its ``PartitionSpec`` names the mesh's
    axes, which inside the program sj.jit writes are manual."""
    return passthrough(eqn, in_avals)


def _kind(dtype) -> str:
    """b(ool), i(nt), u(int), f(loat) or c(omplex), bfloat16 included."""
    if np.dtype(dtype) == np.bool_:
        return "b"
    for k, t in (
        ("f", jnp.floating),
        ("c", jnp.complexfloating),
        ("i", jnp.signedinteger),
        ("u", jnp.unsignedinteger),
    ):
        if jnp.issubdtype(dtype, t):
            return k
    return "?"


def cast_keeps_partial(src, dst, op: str) -> bool:
    """Whether ``cast(op_i x_i) == op_i cast(x_i)`` for every value.

    P(sum): casts between floats are linear up to rounding; an integer cast to
    the same or a narrower width is arithmetic modulo 2**bits, which commutes
    with a wrapping sum. A widening or int-to-float cast does not: the partial
    sum of int8 terms wraps (100 + 100 = -56) where the cast terms would not.
    P(max)/P(min): monotone casts only: float to float, int or bool to float,
    float to int (truncation), and int to a wider int that does not drop the
    sign. A cast to bool (x != 0) or a narrowing / sign-changing integer cast
    reorders values (-1 -> True, 0 -> False; int32 200 -> int8 -56).
    """
    s, d = _kind(src), _kind(dst)
    wider = np.dtype(dst).itemsize > np.dtype(src).itemsize
    if np.dtype(src) == np.dtype(dst):
        return True
    if op == "sum":
        return (s == d == "f") or (s in "iu" and d in "iu" and not wider)
    if d == "f":
        return s in "bfiu"
    if d in "iu":
        if s == "f" or s == "b":
            return True
        return s in "iu" and wider and (d == "i" or s == "u")
    return False


@register("convert_element_type")
def convert(eqn, in_avals):
    """``y_i = cast(x_i)``: splits and broadcast; a partial passes where the cast
    commutes with its reduction (:func:`cast_keeps_partial`)."""
    src, dst = in_avals[0].dtype, eqn.outvars[0].aval.dtype
    return _split_and_broadcast(eqn, in_avals) + [
        Sig((P(op),), (P(op),)) for op in ("sum", "max", "min") if cast_keeps_partial(src, dst, op)
    ]


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
    "name",
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
