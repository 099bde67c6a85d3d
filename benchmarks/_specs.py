"""The PartitionSpec GSPMD is given for an S/B nd-SBP: one definition for
every benchmark's ``jax.jit`` baseline, so that GSPMD lays each array out on
the same devices as sbpjax does (``Geometry.partition_spec``: a dim split
over several placement axes lists them in sbpjax's order)."""

from __future__ import annotations

from sbpjax.boxing.plan import normalized_layout
from sbpjax.layout import Geometry


def spec_of(nd, ndim, pl):
    """The PartitionSpec GSPMD uses for an S/B nd-SBP on ``pl`` for an array of rank ``ndim``."""
    return Geometry((1,) * ndim, pl.shape).partition_spec(
        normalized_layout(nd, ndim, pl.shape), pl.axis_names
    )
