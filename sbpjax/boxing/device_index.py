"""Which device runs the body, and per-device index tables for uneven pieces.

Inside a ``shard_map`` body a device knows its place only as axis indices
(``lax.axis_index``). :func:`group_index` makes its position in a group of
axes, :func:`table_entry` reads its row of a constant table, and
:class:`IndexTables` builds the tables that arrange uneven pieces before a
scatter and compact them after a gather (:mod:`sbpjax.boxing.lower`), and
that the ops of uneven layouts read.

Every index here is in range (a device's own offset, a table entry), so the
reads say so (``allow_negative_indices=False``): JAX's default wraps negative
indices, a compare and a select per index that XLA compiles into every
program and cannot fold away, since it does not know a device's index is
non-negative.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax.layout import Geometry


class IndexTables:
    """Per-device index maps, indexed by the linear coordinate over the axes
    they depend on (so a value that only depends on ``x`` stays the same for
    every ``y``)."""

    def __init__(self, geom: Geometry, names):
        self.geom = geom
        self.names = names

    def members(self, coord, group):
        for ks in itertools.product(*[range(self.geom.grid[a]) for a in group]):
            c = list(coord)
            for a, k in zip(group, ks):
                c[a] = k
            yield tuple(c)

    def table(self, dep, fn):
        geom = self.geom
        rows = []
        for ks in itertools.product(*[range(geom.grid[a]) for a in dep]):
            c = [0] * len(geom.grid)
            for a, k in zip(dep, ks):
                c[a] = k
            rows.append(fn(tuple(c)))
        return np.asarray(rows, np.int32)

    def lookup(self, dep, table):
        return table_entry(table, group_index(dep, self.names, self.geom.grid))

    def compact(self, parent, group, d):
        """After a gather over ``group``: positions of the parent piece's
        elements in the concatenation of padded child pieces."""
        geom = self.geom
        Mp, Mc = geom.padded_dim(parent, d), geom.padded_dim(parent + group, d)

        def fn(c):
            ps, _ = geom.dim_range(parent, d, c)
            out = np.zeros(Mp, np.int32)
            for k, m in enumerate(self.members(c, group)):
                cs, cn = geom.dim_range(parent + group, d, m)
                out[cs - ps : cs - ps + cn] = k * Mc + np.arange(cn)
            return out

        return parent, self.table(parent, fn)

    def arrange(self, parent, group, d):
        """Before a scatter over ``group``: the parent piece laid out as
        ``g`` padded child pieces."""
        geom = self.geom
        Mc = geom.padded_dim(parent + group, d)

        def fn(c):
            ps, _ = geom.dim_range(parent, d, c)
            out = []
            for m in self.members(c, group):
                cs, cn = geom.dim_range(parent + group, d, m)
                out.extend([cs - ps + t if t < cn else 0 for t in range(Mc)])
            return np.asarray(out, np.int32)

        return parent, self.table(parent, fn)

    def slice(self, parent, child, d):
        geom = self.geom
        Mc = geom.padded_dim(child, d)

        def fn(c):
            ps, _ = geom.dim_range(parent, d, c)
            cs, cn = geom.dim_range(child, d, c)
            return np.asarray([cs - ps + t if t < cn else 0 for t in range(Mc)], np.int32)

        return child, self.table(child, fn)

    def fill(self, parent, child, d):
        """Child piece into the parent's shape; index ``Mc`` is the fill slot."""
        geom = self.geom
        Mp, Mc = geom.padded_dim(parent, d), geom.padded_dim(child, d)

        def fn(c):
            ps, _ = geom.dim_range(parent, d, c)
            cs, cn = geom.dim_range(child, d, c)
            out = np.full(Mp, Mc, np.int32)
            out[cs - ps : cs - ps + cn] = np.arange(cn)
            return out

        return child, self.table(child, fn)


def axis_arg(names):
    return names[0] if len(names) == 1 else tuple(names)


def group_index(group, names, grid):
    """This device's position in its group (group axes in order, outer first:
    nd-SBP's order of the pieces of a dim split over those axes). ``names``
    and ``grid``: every placement axis's name and size."""
    idx = jnp.int32(0)
    for a in group:
        idx = idx * grid[a] + lax.axis_index(names[a])
    return idx


def table_entry(table, index):
    """``table[index]`` for a device's ``index`` (from :func:`group_index`,
    never negative) into a constant table, without the wrapping of negative
    indices that ``table[index]`` compiles (see the module's docstring)."""
    return lax.dynamic_index_in_dim(
        jnp.asarray(table), index, 0, keepdims=False, allow_negative_indices=False
    )
