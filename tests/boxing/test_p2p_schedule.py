"""``p2p._p2p_schedule`` (built with arrays) against a direct oracle that assigns each
missing tile and slot one at a time, on random layouts of random placements: the same
tiles, rounds, sends and gathers; and every device ends with exactly its target block."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import sbpjax as sj
from sbpjax.boxing.p2p import P2PSchedule, _p2p_schedule, _rounds, p2p_tiles
from sbpjax.boxing.plan import normalized_layout
from sbpjax.layout import Geometry


def _schedule_one_by_one(geom, src, dst):
    tiles = p2p_tiles(geom, src, dst)
    if tiles is None:
        return None
    tile_shape = [geom.shape[d] // t for d, t in enumerate(tiles)]
    src_local = tuple(tiles[d] // geom.splits(src.dims[d]) for d in range(geom.ndim))
    dst_local = tuple(tiles[d] // geom.splits(dst.dims[d]) for d in range(geom.ndim))
    pax = [a for a, _ in src.partial]

    def tile_ids(layout, coord, local):
        starts = [geom.dim_range(layout.dims[d], d, coord)[0] // tile_shape[d] for d in range(geom.ndim)]
        grid = np.indices(local).reshape(geom.ndim, -1) + np.asarray(starts)[:, None]
        return np.ravel_multi_index(tuple(grid), tiles).tolist()

    src_ids = [tile_ids(src, c, src_local) for c in geom.coords]
    dst_ids = [tile_ids(dst, c, dst_local) for c in geom.coords]
    src_pos = [{t: i for i, t in enumerate(ids)} for ids in src_ids]
    holders: dict = {}
    for v, c in enumerate(geom.coords):
        key = tuple(c[a] for a in pax)
        for t in src_ids[v]:
            holders.setdefault((key, t), []).append(v)
    D = geom.n_devices
    load = [0] * D
    pair_tiles: dict = {}
    for v, c in enumerate(geom.coords):
        key = tuple(c[a] for a in pax)
        for t in dst_ids[v]:
            if t in src_pos[v]:
                continue
            u = min(holders[(key, t)], key=lambda u: (load[u], (v - u) % D))
            load[u] += 1
            pair_tiles.setdefault((u, v), []).append(t)
    rounds, sends, recv_slot = [], [], {}
    offset = math.prod(src_local)  # received tiles follow the own tiles in the pool
    for pairs, k in _rounds({p: len(t) for p, t in pair_tiles.items()}, D):
        send = np.zeros((D, k), np.int32)
        for u, v in pairs:
            for j, t in enumerate(pair_tiles[(u, v)]):
                send[u, j] = src_pos[u][t]
                recv_slot[(v, t)] = offset + j
        rounds.append((pairs, k))
        sends.append(send)
        offset += k
    gather = np.zeros((D, math.prod(dst_local)), np.int32)
    for v in range(D):
        for j, t in enumerate(dst_ids[v]):
            gather[v, j] = src_pos[v][t] if t in src_pos[v] else recv_slot[(v, t)]
    # the placement axes some pair's devices differ on
    coords = np.asarray(geom.coords, np.int64).reshape(D, len(geom.grid))
    ends = np.asarray([p for pairs, _ in rounds for p in pairs], np.int64).reshape(-1, 2)
    used = np.flatnonzero((coords[ends[:, 0]] != coords[ends[:, 1]]).any(axis=0)).tolist()
    return P2PSchedule(
        tuple(tiles),
        tuple(tile_shape),
        int(math.prod(tile_shape)),
        tuple(rounds),
        tuple(sends),
        gather,
        src_local,
        dst_local,
        tuple(sorted(used)),
    )


def _layouts(rng, ndim, grid, partial_ok):
    per_axis = [[sj.B] + [sj.S(d) for d in range(ndim)] + ([sj.P] if partial_ok else []) for _ in grid]
    return [normalized_layout(nd, ndim, grid) for nd in itertools.product(*per_axis)]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    head = ("tiles", "tile_shape", "tile_elems", "rounds", "src_tiles_local", "dst_tiles_local", "axes_used")
    return (
        all(getattr(a, f) == getattr(b, f) for f in head)
        and len(a.send) == len(b.send)
        and all(np.array_equal(x, y) for x, y in zip(a.send, b.send))
        and np.array_equal(a.gather, b.gather)
    )


@pytest.mark.parametrize("seed", range(30))
def test_schedules_are_the_one_by_one_schedules_and_deliver_every_block(seed):
    rng = np.random.default_rng(seed)
    grid = tuple(int(g) for g in rng.choice([1, 2, 3, 4], size=int(rng.integers(1, 4))))
    ndim = int(rng.integers(1, 4))
    shape = tuple(int(math.prod(grid)) * int(rng.integers(1, 4)) for _ in range(ndim))
    geom = Geometry(shape, grid)
    layouts = _layouts(rng, ndim, grid, partial_ok=seed % 3 == 0)
    for k in rng.choice(len(layouts) ** 2, size=min(12, len(layouts) ** 2), replace=False):
        src, dst = layouts[k // len(layouts)], layouts[k % len(layouts)]
        got, want = _p2p_schedule(geom, src, dst), _schedule_one_by_one(geom, src, dst)
        assert _same(got, want), (shape, grid, src, dst)
        if got is not None:
            _check_delivery(geom, src, dst, got)


def _check_delivery(geom, src, dst, s: P2PSchedule) -> None:
    """Play the schedule on tile ids: each device's pool is its own tiles, then each
    round's received tiles; gathering from it must give its target block's tiles."""
    tiles = p2p_tiles(geom, src, dst)

    def ids(layout, coord, local):
        starts = [geom.dim_range(layout.dims[d], d, coord)[0] // s.tile_shape[d] for d in range(geom.ndim)]
        grid = np.indices(local).reshape(geom.ndim, -1) + np.asarray(starts)[:, None]
        return np.ravel_multi_index(tuple(grid), tiles)

    pools = [list(ids(src, c, s.src_tiles_local)) for c in geom.coords]
    for (pairs, k), send in zip(s.rounds, s.send):
        received = {v: [pools[u][i] for i in send[u, :k]] for u, v in pairs}
        for v in range(geom.n_devices):
            pools[v] += received.get(v, [-1] * k)
    for v, c in enumerate(geom.coords):
        assert [pools[v][i] for i in s.gather[v]] == list(ids(dst, c, s.dst_tiles_local))
