"""Point-to-point exchanges between two layouts: the tiles each device
lacks and the rounds of sends that deliver them (``permute`` steps)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sbpjax.layout import Geometry, Layout


@dataclasses.dataclass(frozen=True)
class P2PSchedule:
    """Tiles and rounds of a point-to-point exchange between two layouts.

    The logical tensor is cut into a grid of equal tiles (per dim, the lcm of the
    split counts of both layouts). Round ``r`` is one ``ppermute``: ``pairs``
    (sender, receiver) by linear device index, every pair sending ``k`` tiles.
    """

    tiles: tuple  # tile count per dim
    tile_shape: tuple
    tile_elems: int
    rounds: tuple  # ((pairs, k), ...)
    send: tuple  # per round: array [n_devices, k] of local src tile indices
    gather: np.ndarray  # [n_devices, n_dst_tiles] indices into the pool
    src_tiles_local: tuple  # per dim tiles in one device's src block
    dst_tiles_local: tuple
    axes_used: tuple


def p2p_tiles(geom: Geometry, src: Layout, dst: Layout):
    """Tile counts per dim (lcm of both layouts' split counts), or None when a
    point-to-point exchange is not offered: different partials, a 0-d or empty
    tensor, or a dim the tiles do not divide (uneven: collectives handle it)."""
    if src.partial != dst.partial or geom.ndim == 0 or 0 in geom.shape:
        return None
    tiles = [math.lcm(geom.splits(src.dims[d]), geom.splits(dst.dims[d])) for d in range(geom.ndim)]
    if any(geom.shape[d] % t for d, t in enumerate(tiles)):
        return None
    return tiles


_SCHEDULES: dict = {}


def clear_schedules() -> None:
    """Forget the schedules computed so far (``plan.clear_caches``)."""
    _SCHEDULES.clear()


def p2p_schedule(geom: Geometry, src: Layout, dst: Layout) -> P2PSchedule | None:
    key = (geom.shape, geom.grid, src, dst)
    if key not in _SCHEDULES:
        _SCHEDULES[key] = _p2p_schedule(geom, src, dst)
    return _SCHEDULES[key]


def _p2p_schedule(geom: Geometry, src: Layout, dst: Layout) -> P2PSchedule | None:
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
    for pairs, k in _rounds(pair_tiles, D):
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


def _rounds(pair_tiles: dict, D: int) -> list:
    """Group sender->receiver pairs into ``ppermute`` rounds that waste nothing.

    Every pair in a round sends the same number of tiles ``k`` and each device
    sends to and receives from at most one peer. Pairs are placed first fit,
    by ``k`` (largest first) and ring offset ``(v - u) mod D``, so pairs at one
    offset (a permutation) tend to share a round and exchanges take few rounds."""
    order = sorted(pair_tiles, key=lambda p: (-len(pair_tiles[p]), (p[1] - p[0]) % D, p))
    rounds: list = []  # [k, pairs]
    of_k: dict = {}  # k -> the indices of the rounds of k tiles, in the order they were opened
    # (k, device) -> bit j set where the device sends (receives) in the j-th round of k tiles:
    # a pair's first fit is the lowest bit set in neither, found in C (a 256-device exchange
    # had hundreds of rounds, and scanning them pair by pair took seconds)
    sends: dict = {}
    receives: dict = {}
    for u, v in order:
        k = len(pair_tiles[(u, v)])
        opened = of_k.setdefault(k, [])
        free = ~(sends.get((k, u), 0) | receives.get((k, v), 0)) & ((1 << len(opened)) - 1)
        if free:
            j = (free & -free).bit_length() - 1
        else:
            j = len(opened)
            opened.append(len(rounds))
            rounds.append([k, []])
        rounds[opened[j]][1].append((u, v))
        sends[(k, u)] = sends.get((k, u), 0) | (1 << j)
        receives[(k, v)] = receives.get((k, v), 0) | (1 << j)
    return [(tuple(sorted(pairs)), k) for k, pairs in rounds]
