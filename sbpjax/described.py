"""Global tensors described, not placed: a :class:`~sbpjax.tensor.GlobalTensor`
whose physical array is a ``jax.ShapeDtypeStruct`` (its shape, dtype and
sharding; no data on any device). ``sj.jit``'s ``lower()`` and ``explain()``
place arguments so, as ``jax.jit``'s ``lower()`` reads shapes, not values.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from sbpjax.boxing.lower import boxing_fn
from sbpjax.boxing.plan import plan_boxing
from sbpjax.placement import Placement
from sbpjax.sbp import normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, checked_layout


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
    shape = tuple(int(d) for d in shape)
    sbp, dtype, layout, geom = checked_layout(shape, dtype, placement, sbp)
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


def describe(leaf, placement: Placement, sbp) -> GlobalTensor:
    """``leaf`` (an array, a number, a ``ShapeDtypeStruct`` or a global
    tensor) laid out as ``sbp`` as a call places it (``to_global``, or the
    global tensor's boxing), described."""
    if isinstance(leaf, GlobalTensor):
        return leaf if leaf.sbp == tuple(sbp) else abstract_boxed(leaf, sbp)
    dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
    # weak as placed data: a weak jax array or ShapeDtypeStruct (a number is placed from NumPy)
    weak = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and bool(leaf.weak_type)
    return abstract_global(np.shape(leaf), dtype, placement, sbp, weak)


__all__ = ["abstract_boxed", "abstract_global", "describe"]
