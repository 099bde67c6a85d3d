"""``sj.AUTO``: the layout of an argument the solver chooses, and the layouts
such an argument may take."""

from __future__ import annotations

import itertools

from sbpjax.sbp import Broadcast, Split


class _Auto:
    """The layout of an argument the solver chooses (``sj.AUTO``)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "sj.AUTO"

    def __reduce__(self):
        return (_Auto, ())


AUTO = _Auto()


def auto_layouts(shape, grid) -> list[tuple]:
    """The layouts an ``AUTO`` argument may take: on every placement axis B or
    a split of any dim, where no device would be left without a piece (a dim
    split by axes whose sizes multiply to more than its length). Partials are
    not offered: an argument is data the caller holds, and a partial one
    would mean the caller had summed nothing yet."""
    per_axis = [[Broadcast()] + ([Split(d) for d in range(len(shape))] if p > 1 else []) for p in grid]
    out = []
    for nd in itertools.product(*per_axis):
        pieces = [1] * len(shape)
        for a, q in enumerate(nd):
            if isinstance(q, Split):
                pieces[q.dim] *= grid[a]
        if all(k == 1 or n >= k for n, k in zip(shape, pieces)):  # an unsplit dim may be empty
            out.append(tuple(nd))
    return out
