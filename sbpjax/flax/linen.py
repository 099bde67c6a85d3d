"""SBP annotations for Flax Linen modules.

Linen keeps metadata in boxed parameter values (``nn.Partitioned`` for
shardings); :func:`with_sbp` boxes a parameter with its layout the same way::

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(2048, kernel_init=sjl.with_sbp(nn.initializers.lecun_normal(), (B, S(1))))(x)
            ...

    variables = MLP().init(key, x)
    param_sbp = sjl.get_sbp(variables["params"], pl)     # nd-SBP per parameter
    params = sjl.unbox(variables["params"])             # plain arrays for TrainStep
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import linen as nn
from flax import struct

from sbpjax.flax.annotate import _as_sbp_tuple, shift_stacked
from sbpjax.flax.partitioning import context_rules, sbp_from_spec
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, normalize_nd_sbp


class SBPBoxed(struct.PyTreeNode, nn.meta.AxisMetadata):
    """A Linen parameter value with its layout (unboxed by ``nn.meta.unbox``)."""

    value: Any
    sbp: tuple = struct.field(pytree_node=False)

    def unbox(self):
        return self.value

    def replace_boxed(self, val):
        return self.replace(value=val)

    def add_axis(self, index, params):
        """``nn.scan`` / ``nn.vmap`` stack the parameter along a new dim at
        ``index`` (``variable_axes``): splits at or past it move one dim on,
        the stacked dim is not split (as ``nn.Partitioned`` inserts its axis name)."""
        return self.replace(sbp=shift_stacked(self.sbp, 1, "Linen parameter", index))

    def remove_axis(self, index, params):
        return self.replace(sbp=shift_stacked(self.sbp, -1, "Linen parameter", index))


def with_sbp(initializer, sbp):
    """A Linen initializer whose value is boxed with the layout ``sbp``."""
    sbp = _as_sbp_tuple(sbp, "with_sbp")

    @functools.wraps(initializer)
    def init(*args, **kwargs):
        return SBPBoxed(initializer(*args, **kwargs), sbp)

    return init


def _is_boxed(v) -> bool:
    return isinstance(v, nn.meta.AxisMetadata)


def get_sbp(params, placement: Placement | None = None, *, rules=None):
    """The layout tree of boxed Linen ``params`` (``None`` / B where unannotated).

    With a placement, parameters boxed for ``jax.sharding`` instead
    (``nn.with_partitioning`` mesh axis names, ``nn.with_logical_partitioning``
    logical names) are read as the nd-SBP they mean; logical names go through
    ``rules`` (``[(logical, axis or None), ...]``, as for ``nn.logical_axis_rules``),
    else the box's own rules, else Flax's active ``nn.logical_axis_rules``
    (see :mod:`sbpjax.flax.partitioning`)."""

    def one(path, v):
        sbp = v.sbp if isinstance(v, SBPBoxed) else None
        if placement is None:
            return sbp
        value = v.unbox() if _is_boxed(v) else v
        where = f"parameter {jax.tree_util.keystr(path)}"
        if sbp is None and isinstance(v, nn.Partitioned):
            own = getattr(v, "rules", None)
            sbp = sbp_from_spec(v.names, placement, value.ndim, tuple(rules or own or context_rules()), where)
        if sbp is None:
            return (Broadcast(),) * placement.ndim
        return normalize_nd_sbp(sbp, placement.ndim, value.ndim, where)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_boxed)


def unbox(params):
    """Plain parameter values (what ``module.apply`` and ``TrainStep`` take)."""
    return nn.meta.unbox(params)
