"""Layouts a value reaches from one it has without an invented conversion:
its partials reduced, whole axes sliced locally (no bytes), a partial beside
a whole factor; and whether a weight's layout is split over two axes. The
candidate screen (:mod:`sbpjax.compiler.domains`) widens each operand's
allowed layouts by these."""

from __future__ import annotations

import itertools

from sbpjax.sbp import Broadcast, Partial, Split


def two_d(nd, grid) -> bool:
    """Whether layout ``nd`` splits its value over two or more axes of
    ``grid`` (a 2-D weight, ``Domains._gathered``)."""
    return sum(isinstance(q, Split) for q, p in zip(nd, grid) if p > 1) >= 2


def beside_partial(operand, out) -> bool:
    """Whether a product or quotient may read a same-shape operand in layout
    ``operand`` for output layout ``out``: on each axis the output's own
    layout, or whole where the output is a partial sum (the factor ``b`` of
    ``(sum_i a_i) * b``; the op's rule says which operand may be so)."""
    return all(a == o or (o == Partial("sum") and isinstance(a, Broadcast)) for a, o in zip(operand, out))


def sliced_to(src, dst) -> bool:
    """Whether ``dst`` is ``src`` with some whole (B) axes split locally (no
    bytes; see ``local_slices`` for which splits are local)."""
    return src != dst and all(
        p == q or (isinstance(p, Broadcast) and isinstance(q, Split) and q.dim not in _later_splits(src, a))
        for a, (p, q) in enumerate(zip(src, dst))
    )


def reductions(nd, ndim) -> set:
    """The layouts ``nd`` reduces to: each partial axis made whole or split on a dim."""
    out = set()
    for a, q in enumerate(nd):
        if isinstance(q, Partial):
            out.add(nd[:a] + (Broadcast(),) + nd[a + 1 :])
            out.update(nd[:a] + (Split(d),) + nd[a + 1 :] for d in range(ndim))
    return out


def local_slices(lays, shape) -> set:
    """Every layout each of ``lays`` slices to locally (no bytes): whole (B)
    axes split on a dim of ``shape`` longer than 1 that no later axis splits
    already. An axis splits its dim's pieces in placement order, so an
    earlier axis splitting what a later one split (``(B, S(2))`` to
    ``(S(2), S(2))``) would hand each device another device's piece."""
    out = set()
    for nd in lays:
        whole = [a for a, q in enumerate(nd) if isinstance(q, Broadcast)]
        for pick in itertools.product(*(_free_dims(nd, a, shape) for a in whole)):
            new = list(nd)
            for a, d in zip(whole, pick):
                if d is not None:
                    new[a] = Split(d)
            out.add(tuple(new))
    return out


def _free_dims(nd, axis, shape) -> list:
    """None (stay whole) and the dims ``axis`` of ``nd`` may split locally."""
    later = _later_splits(nd, axis)
    return [None] + [d for d, n in enumerate(shape) if n > 1 and d not in later]


def _later_splits(nd, axis) -> set:
    """The dims the axes after ``axis`` split in ``nd``."""
    return {q.dim for q in nd[axis + 1 :] if isinstance(q, Split)}
