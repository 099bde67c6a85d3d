"""Geometry's per-device boxes, against a count device by device."""

import itertools
import math

import pytest

from sbpjax.layout import Geometry, Layout
from sbpjax.sbp import Broadcast, Partial, Split


def layouts(ndim, n_axes):
    """Every nd-SBP of B, P and the splits of the tensor's dims, as layouts."""
    one_d = [Broadcast(), Partial()] + [Split(d) for d in range(ndim)]
    return sorted({Layout.from_nd_sbp(nd, ndim) for nd in itertools.product(one_d, repeat=n_axes)})


def counted(geom, src, dst):
    """(elements the devices hold under dst, of those the ones each already holds
    under src), one device at a time."""
    held = kept = 0
    for c in geom.coords:
        a, b = geom.local_box(src, c), geom.local_box(dst, c)
        held += math.prod(n for _, n in b)
        kept += math.prod(max(0, min(s + n, t + m) - max(s, t)) for (s, n), (t, m) in zip(a, b))
    return held, kept


@pytest.mark.parametrize(
    "shape, grid",
    [
        ((8, 12), (2, 4)),  # even
        ((7, 10), (2, 4)),  # uneven: padded pieces
        ((3, 5), (4, 2)),  # fewer rows than devices on an axis: empty pieces
        ((6,), (2, 2, 2)),
        ((), (2, 4)),  # a scalar: each device holds its one element
    ],
)
def test_overlap_equals_a_count_device_by_device(shape, grid):
    geom = Geometry(shape, grid)
    for src in layouts(len(shape), len(grid)):
        for dst in layouts(len(shape), len(grid)):
            assert geom.overlap(src, dst) == counted(geom, src, dst), (src, dst)


@pytest.mark.parametrize(
    "shape, grid", [((7, 10), (2, 4)), ((3, 5), (4, 2)), ((13,), (2, 3, 2)), ((), (2, 2))]
)
def test_box_arrays_are_every_devices_local_box(shape, grid):
    geom = Geometry(shape, grid)
    for lay in layouts(len(shape), len(grid)):
        starts, sizes = geom.box_arrays(lay)
        boxes = [tuple(zip(s, n)) for s, n in zip(starts.tolist(), sizes.tolist())]
        assert boxes == [geom.local_box(lay, c) for c in geom.coords], lay
