"""The PartitionSpec GSPMD is given for an S/B nd-SBP: one definition for
every benchmark's ``jax.jit`` baseline, so that GSPMD lays each array out on
the same devices as sbpjax does (``Geometry.partition_spec``: a dim split
over several placement axes lists them in sbpjax's order)."""

from __future__ import annotations

from sbpjax.boxing.plan import normalized_layout
from sbpjax.layout import Geometry
from sbpjax.sbp import Split


def spec_of(nd, ndim, pl):
    """The PartitionSpec GSPMD uses for an S/B nd-SBP on ``pl`` (``ndim``:
    the array's rank; None: as many dims as the splits name)."""
    if ndim is None:
        ndim = 1 + max((s.dim for s in nd if isinstance(s, Split)), default=-1)
    return Geometry((1,) * ndim, pl.shape).partition_spec(
        normalized_layout(nd, ndim, pl.shape), pl.axis_names
    )
