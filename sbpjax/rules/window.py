"""Windowed reductions: pooling (``reduce_window_*``) and its derivatives.

Per device: ``y_i = reduce_window(x_i)`` where ``x`` is split only on dims the
window does not slide over (window size 1, stride 1, no padding, no dilation):
the batch and channel dims of a CNN's pooling, so a data-parallel or
channel-split model pools without moving anything. Splits of a spatial dim
would need the neighbouring rows (a halo exchange); they are not offered, so a
spatially split activation is gathered first.

Partial algebra: a window sum is linear (``sum_w sum_i x_i = sum_i sum_w x_i``:
P(sum) passes), a window max/min commutes with a max/min over devices
(P(max)/P(min) pass); the derivatives ``select_and_scatter_add`` (max pooling)
and ``select_and_gather_add`` are linear in the cotangent for a broadcast
operand.
"""

from __future__ import annotations

from sbpjax.rules import B, P, Sig, rank, register
from sbpjax.sbp import Split


def _untouched_dims(eqn, r: int) -> list[int]:
    """Dims the window does not slide over: there any split is exact."""
    p = eqn.params
    ones = (1,) * r
    window = tuple(p["window_dimensions"])
    strides = tuple(p.get("window_strides", ones))
    padding = tuple(tuple(c) for c in p.get("padding", ((0, 0),) * r))
    base = tuple(p.get("base_dilation", ones))
    dil = tuple(p.get("window_dilation", ones))
    return [
        d
        for d in range(r)
        if window[d] == 1 and strides[d] == 1 and padding[d] == (0, 0) and base[d] == 1 and dil[d] == 1
    ]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def pooling(eqn, in_avals):
    """``y_i = pool(x_i)`` for splits of untouched dims; the matching partial passes."""
    op = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}[
        eqn.primitive.name
    ]
    splits = [Sig((Split(d),), (Split(d),)) for d in _untouched_dims(eqn, rank(in_avals[0]))]
    return splits + [Sig((P(op),), (P(op),)), Sig((B,), (B,))]


@register("reduce_window")
def reduce_window(eqn, in_avals):
    """A general window reduction (operands, then one scalar init value each):
    splits of untouched dims, init values broadcast."""
    n = len(eqn.outvars)
    splits = [
        Sig((Split(d),) * n + (B,) * n, (Split(d),) * n) for d in _untouched_dims(eqn, rank(in_avals[0]))
    ]
    return splits + [Sig((B,) * (2 * n), (B,) * n)]


@register("select_and_scatter_add", "select_and_gather_add")
def pooling_derivative(eqn, in_avals):
    """``select_and_scatter_add(ct, x)`` (max pooling's transpose) and
    ``select_and_gather_add(t, x)`` (its tangent): both operands split alike on
    untouched dims; linear in the first operand, so (P, B) -> P."""
    splits = [Sig((Split(d), Split(d)), (Split(d),)) for d in _untouched_dims(eqn, rank(in_avals[1]))]
    return splits + [Sig((P(), B), (P(),)), Sig((B, B), (B,))]
