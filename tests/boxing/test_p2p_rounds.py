"""``p2p._rounds``: exchanges grouped into ppermute rounds, first fit, against a direct
first-fit oracle (every round scanned for every pair) on random exchanges."""

from __future__ import annotations

import numpy as np
import pytest

from sbpjax.boxing.p2p import _rounds


def _first_fit(pair_tiles: dict, D: int) -> list:
    order = sorted(pair_tiles, key=lambda p: (-len(pair_tiles[p]), (p[1] - p[0]) % D, p))
    rounds: list = []
    for u, v in order:
        k = len(pair_tiles[(u, v)])
        for r in rounds:
            if r[0] == k and all(u != a and v != b for a, b in r[1]):
                r[1].append((u, v))
                break
        else:
            rounds.append([k, [(u, v)]])
    return [(tuple(sorted(pairs)), k) for k, pairs in rounds]


@pytest.mark.parametrize("seed", range(40))
def test_rounds_are_the_first_fit(seed):
    rng = np.random.default_rng(seed)
    D = int(rng.integers(2, 48))
    pair_tiles = {}
    for _ in range(int(rng.integers(1, D * D))):
        u, v = (int(x) for x in rng.integers(0, D, 2))
        if u != v:
            pair_tiles[(u, v)] = list(range(int(rng.integers(1, 4))))
    got = _rounds({p: len(t) for p, t in pair_tiles.items()}, D)
    assert got == _first_fit(pair_tiles, D)
    for pairs, k in got:  # each device sends and receives at most once a round
        assert len({u for u, _ in pairs}) == len(pairs) == len({v for _, v in pairs})
        assert all(len(pair_tiles[p]) == k for p in pairs)
