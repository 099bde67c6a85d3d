"""The floating-point work one device does under a plan, estimated from its layouts.

``explain()`` prints it beside the bytes moved and the estimated peak, so a
plan's compute is read where its communication is: a layout that leaves an op
whole on an axis runs it on every device of that axis, and a plan that
gathers a split weight runs its matmul on a larger block. The count is of
the program as traced, where a ``jax.checkpoint`` region's recomputation is
written out like any other op, so remat's extra work is in it.

Counted as XLA's ``cost_analysis()`` counts them: a ``dot_general`` is
``2 x`` (its local output's elements) ``x`` (its local contracted size); a
convolution ``2 x`` output elements ``x`` the kernel's elements per output
feature; an elementwise op one per output element; a reduction one per
input element. Shape ops (reshape, transpose, slices, gathers, converts,
broadcasts) count nothing. Collectives count nothing here: their bytes are
the plan's other figure. A loop the compiled program keeps rolled counts
every iteration (the program was written out to choose its layouts), where
``cost_analysis()`` counts its body once.
"""

from __future__ import annotations

import math

from sbpjax.compiler.propagation import Propagation
from sbpjax.rules import local_shape

# elementwise primitives: one FLOP per output element (as XLA's HLO cost analysis counts them)
ELEMENTWISE = frozenset(
    """
    add add_any sub mul div neg max min pow integer_pow exp exp2 log log1p expm1 tanh logistic
    sin cos tan sqrt rsqrt cbrt abs sign floor ceil round erf erfc erf_inv atan2 square rem
    select_n clamp nextafter is_finite lt le gt ge eq ne and or not xor
    """.split()
)
REDUCTIONS = frozenset(
    ["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum", "cummax"]
)


def _elements(shape) -> int:
    return math.prod(shape) if shape else 1


def op_flops(decision, grid) -> int:
    """The FLOPs one device spends on one op in its chosen layouts."""
    node = decision.node
    name = node.name
    if name == "dot_general":
        (lhs_contract, _), _ = node.eqn.params["dimension_numbers"]
        lhs = local_shape(node.ins[0].shape, decision.in_sbp[0], grid)
        out = local_shape(node.outs[0].shape, decision.out_sbp[0], grid)
        return 2 * _elements(out) * _elements([lhs[d] for d in lhs_contract])
    if name == "conv_general_dilated":
        rhs = local_shape(node.ins[1].shape, decision.in_sbp[1], grid)
        out = local_shape(node.outs[0].shape, decision.out_sbp[0], grid)
        out_feature = node.eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * _elements(out) * (_elements(rhs) // max(rhs[out_feature], 1))
    if name in ELEMENTWISE:
        return sum(_elements(local_shape(v.shape, nd, grid)) for v, nd in zip(node.outs, decision.out_sbp))
    if name in REDUCTIONS:
        return _elements(local_shape(node.ins[0].shape, decision.in_sbp[0], grid))
    return 0


def estimated_flops(prop: Propagation) -> int:
    """Per device, the FLOPs of every op of the plan (see the module's docstring)."""
    grid = prop.placement.shape
    return sum(op_flops(d, grid) for d in prop.decisions)
