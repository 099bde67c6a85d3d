"""Reductions: a reduced split dim becomes the matching partial.

Per device: ``y_i = reduce(x_i, axes)``. If ``x`` is split on a reduced dim,
``y = op_i y_i``: ``reduce_sum`` -> P(sum), ``reduce_max`` -> P(max),
``reduce_min`` -> P(min) (how a model-parallel softmax gets its max and sum
without gathering the logits). A split on a kept dim stays a split (renumbered).
A partial input of the same op stays partial: ``sum(sum_i x_i) = sum_i sum(x_i)``.
``argmax``/``argmin`` need the reduced dim whole. ``cumsum`` and friends keep
splits off their axis; ``cumsum`` is linear (keeps P(sum)), ``cummax`` monotone.
"""

from __future__ import annotations

from sbpjax.rules import B, P, Sig, rank, register
from sbpjax.sbp import Split

_OP = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


@register("reduce_sum", "reduce_max", "reduce_min")
def reduction(eqn, in_avals):
    """``y_i = reduce(x_i)``; a reduced split dim gives ``y = op_i y_i``."""
    axes = tuple(eqn.params["axes"])
    op = _OP[eqn.primitive.name]
    sigs = []
    for d in range(rank(in_avals[0])):
        if d in axes:
            sigs.append(Sig((Split(d),), (P(op),)))
        else:
            sigs.append(Sig((Split(d),), (Split(d - sum(a < d for a in axes)),)))
    sigs += [Sig((P(op),), (P(op),)), Sig((B,), (B,))]
    return sigs


@register("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def kept_dim_reduction(eqn, in_avals):
    """``y_i = reduce(x_i)`` for splits of kept dims only: an argmax, a product
    or a logical and / or / xor over a split dim has no partial kind here, so
    that dim is reduced whole."""
    axes = tuple(eqn.params["axes"])
    sigs = [
        Sig((Split(d),), (Split(d - sum(a < d for a in axes)),))
        for d in range(rank(in_avals[0]))
        if d not in axes
    ]
    return sigs + [Sig((B,), (B,))]


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn, in_avals):
    """``y_i = cumop(x_i, axis)`` for splits off the axis; cumsum keeps P(sum),
    cummax/cummin keep P(max)/P(min)."""
    axis = eqn.params["axis"]
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(rank(in_avals[0])) if d != axis]
    keep = {"cumsum": "sum", "cummax": "max", "cummin": "min"}.get(eqn.primitive.name)
    if keep:
        sigs.append(Sig((P(keep),), (P(keep),)))
    return sigs + [Sig((B,), (B,))]
