"""Global tensors described, not placed: a :class:`~sbpjax.tensor.GlobalTensor`
whose physical array is a ``jax.ShapeDtypeStruct`` (its shape, dtype and
sharding; no data on any device). ``sj.jit``'s ``lower()`` and ``explain()``
place arguments so, as ``jax.jit``'s ``lower()`` reads shapes, not values.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from sbpjax.boxing.lower import boxing_fn
from sbpjax.boxing.plan import normalized_layout, plan_boxing
from sbpjax.dtypes import canonical_dtype, check_partial_dtype
from sbpjax.layout import Geometry
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import normalize_nd_sbp
from sbpjax.tensor import GlobalTensor


def abstract_global(
    shape, dtype, placement: Placement, sbp, weak: bool = False, boxed: bool = False
) -> GlobalTensor:
    """A described :class:`GlobalTensor` of a ``shape``/``dtype`` array laid
    out as ``sbp``, checked as :func:`~sbpjax.tensor.to_global` checks it.

    ``weak``: the value is weakly typed (a jax array made from a Python
    number), which its physical array stays where ``to_global`` places
    it whole (an even layout without partials: ``device_put`` keeps the
    type; padded and partial blocks are assembled from host pieces) and
    where a global tensor's boxing makes it (``boxed``), so that the
    program lowered is the one a call runs."""
    checked_placement(placement, "to_global")
    shape = tuple(int(d) for d in shape)
    sbp = normalize_nd_sbp(sbp, placement.ndim, len(shape), "to_global")
    dtype = canonical_dtype(dtype)
    check_partial_dtype(dtype, sbp, "to_global")
    layout = normalized_layout(sbp, len(shape), placement.shape)
    geom = Geometry(shape, placement.shape)
    sharding = NamedSharding(placement.mesh, geom.partition_spec(layout, placement.axis_names))
    weak = weak and (boxed or (not layout.partial and geom.even(layout)))
    data = jax.ShapeDtypeStruct(geom.physical_shape(layout), dtype, sharding=sharding, weak_type=weak)
    return GlobalTensor(data, shape, dtype, placement, sbp)


def abstract_boxed(t: GlobalTensor, sbp) -> GlobalTensor:
    """:func:`abstract_global` of global tensor ``t`` boxed to ``sbp``: weakly
    typed where the boxing keeps ``t``'s weak type, as traced (without
    running) by ``jax.eval_shape``: most steps keep it, but a zero-fill along
    a split dim and an empty tensor's zeros make a new array of the dtype."""
    weak = bool(getattr(t.physical, "weak_type", False))
    if weak:
        sbp = normalize_nd_sbp(sbp, t.placement.ndim, len(t.shape), "to_global")
        plan = plan_boxing(t.shape, t.dtype, t.placement, t.sbp, sbp)
        weak = jax.eval_shape(boxing_fn(plan), t.physical).weak_type
    return abstract_global(t.shape, t.dtype, t.placement, sbp, weak=weak, boxed=True)


__all__ = ["abstract_boxed", "abstract_global"]
