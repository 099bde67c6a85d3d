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
    D = geom.n_devices
    src_ids = _tile_ids(geom, src, tiles, tile_shape, src_local)  # [D, tiles a device holds]
    dst_ids = _tile_ids(geom, dst, tiles, tile_shape, dst_local)  # [D, tiles a device needs]
    held = _Held(src_ids, math.prod(tiles))
    own, own_pos = held.find(np.arange(D)[:, None], dst_ids)
    coords = np.asarray(geom.coords, np.int64).reshape(D, len(geom.grid))
    need_v, need_j = np.nonzero(~own)  # receiver-major, its tiles in order
    need_t = dst_ids[need_v, need_j]
    need_u = _senders(held, coords, [a for a, _ in src.partial], need_v, need_t)
    # the (sender, receiver) pairs, each tile's place among its pair's, and the rounds
    pair = need_u * D + need_v
    pair_ids, inverse, counts = np.unique(pair, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    rank = np.empty(len(pair), np.int64)
    rank[np.argsort(inverse, kind="stable")] = np.arange(len(pair)) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    pair_round, rounds = _place(pair_ids // D, pair_ids % D, counts, D)
    # a device's pool: its own tiles, then each round's k received tiles
    round_k = np.asarray([k for _, k in rounds], np.int64)
    slot = held.per_device + (np.cumsum(round_k) - round_k)[pair_round[inverse]] + rank
    columns = np.zeros((D, int(round_k.sum())), np.int32)  # what each sends, round after round
    columns[need_u, slot - held.per_device] = held.find(need_u, need_t)[1]
    sends = np.split(columns, np.cumsum(round_k)[:-1], axis=1) if len(rounds) else []
    gather = np.where(own, own_pos, 0).astype(np.int32)
    gather[need_v, need_j] = slot
    # the placement axes some pair's devices differ on
    used = np.flatnonzero((coords[pair_ids // D] != coords[pair_ids % D]).any(axis=0)).tolist()
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


class _Held:
    """The tiles each device holds (``ids``: [devices, tiles per device]), looked up
    by (device, tile) in one sorted key."""

    def __init__(self, ids: np.ndarray, n_tiles: int):
        self.ids, self.n_tiles, self.per_device = ids, n_tiles, ids.shape[1]
        key = (np.arange(len(ids), dtype=np.int64)[:, None] * n_tiles + ids).ravel()
        self.order = np.argsort(key, kind="stable")
        self.sorted = key[self.order]

    def find(self, devices, tiles) -> tuple[np.ndarray, np.ndarray]:
        """Whether each device holds each tile (broadcast together), and where in
        its block (meaningful where it does)."""
        want = np.asarray(devices, np.int64) * self.n_tiles + tiles
        at = np.minimum(np.searchsorted(self.sorted, want), len(self.sorted) - 1)
        return self.sorted[at] == want, self.order[at] % self.per_device


def _senders(
    held: _Held, coords: np.ndarray, pax: list, need_v: np.ndarray, need_t: np.ndarray
) -> np.ndarray:
    """Per tile a device lacks (receiver-major), the holder that sends it: one
    of the receiver's partial group (the same coordinates on the partial axes,
    so that the sum stays over the same devices), the least loaded so far, then
    the nearest before the receiver on the ring. Sequential (each choice loads
    a sender), so in plain Python over ints, the candidates found with arrays."""
    D = len(coords)
    group = (
        np.unique(coords[:, pax], axis=0, return_inverse=True)[1].ravel() if pax else np.zeros(D, np.int64)
    )
    holder_key = (group[:, None] * held.n_tiles + held.ids).ravel()
    by_key = np.argsort(holder_key, kind="stable")  # lowest device first within a key
    keys_sorted, holders = holder_key[by_key], (by_key // held.per_device).tolist()
    need_key = group[need_v] * held.n_tiles + need_t
    lo = np.searchsorted(keys_sorted, need_key, side="left").tolist()
    hi = np.searchsorted(keys_sorted, need_key, side="right").tolist()
    load = [0] * D
    out = []
    for v, a, b in zip(need_v.tolist(), lo, hi):
        if b - a == 1:
            u = holders[a]
        else:
            u = min(holders[a:b], key=lambda u: (load[u], (v - u) % D))
        load[u] += 1
        out.append(u)
    return np.asarray(out, np.int64)


def _tile_ids(geom: Geometry, layout: Layout, tiles, tile_shape, local) -> np.ndarray:
    """[devices, tiles of a block]: the (row-major) ids of the tiles each
    device's block of ``layout`` covers, in the block's row-major order."""
    starts = geom.box_arrays(layout)[0] // np.asarray(tile_shape, np.int64).reshape(1, geom.ndim)
    grid = np.indices(local).reshape(geom.ndim, -1)
    ids = np.zeros((geom.n_devices, grid.shape[1]), np.int64)
    for d in range(geom.ndim):
        ids = ids * tiles[d] + (starts[:, d : d + 1] + grid[d][None, :])
    return ids


def _rounds(pair_tiles: dict, D: int) -> list:
    """Group sender->receiver pairs (``pair_tiles``: {(sender, receiver): the
    number of tiles it sends}) into ``ppermute`` rounds that waste nothing:
    ``[(pairs, k), ...]`` (see :func:`_place`)."""
    u = np.asarray([p[0] for p in pair_tiles], np.int64)
    v = np.asarray([p[1] for p in pair_tiles], np.int64)
    return _place(u, v, np.asarray(list(pair_tiles.values()), np.int64), D)[1]


def _place(u: np.ndarray, v: np.ndarray, k: np.ndarray, D: int) -> tuple[np.ndarray, list]:
    """Each pair's round and the rounds ``[(pairs, k), ...]``, in the order
    they were opened, each round's (sender, receiver) pairs sorted.

    Every pair in a round sends the same number of tiles ``k`` and each device
    sends to and receives from at most one peer. Pairs are placed first fit,
    by ``k`` (largest first) and ring offset ``(v - u) mod D``, so pairs at one
    offset (a permutation) tend to share a round and exchanges take few rounds.

    Pairs of one ``k`` and offset never share a sender or a receiver, so each
    one's first fit does not depend on the others of its group: a group is
    placed at once, as arrays (a 256-device exchange has thousands of pairs,
    and placing them one by one took most of a 16x16 plan)."""
    if not len(u):  # nothing to send (every device holds what it needs)
        return np.zeros(0, np.int64), []
    off = (v - u) % D
    order = np.lexsort((v, u, off, -k))
    su, sv, sk = u[order], v[order], k[order]
    bounds = np.flatnonzero(np.diff(sk * D + off[order])) + 1
    starts, ends = np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [len(sk)]]).tolist()
    slot = np.empty(len(sk), np.int64)  # the round of each pair, in sorted order
    n_groups: dict = {}
    for lo in starts:
        n_groups[int(sk[lo])] = n_groups.get(int(sk[lo]), 0) + 1
    # per k: which devices send (receive) in each of its rounds; a group opens one at most
    busy: dict = {kk: (np.zeros((n, D), bool), np.zeros((n, D), bool), []) for kk, n in n_groups.items()}
    round_k: list = []
    for lo, hi in zip(starts, ends):
        kk = int(sk[lo])
        gu, gv = su[lo:hi], sv[lo:hi]
        sends, receives, ids = busy[kk]
        free = ~(sends[: len(ids), gu] | receives[: len(ids), gv])  # [rounds of k so far, pairs]
        fits = free.any(axis=0)
        j = np.where(fits, free.argmax(axis=0), len(ids)) if ids else np.zeros(len(gu), np.int64)
        if not fits.all():
            ids.append(len(round_k))
            round_k.append(kk)
        sends[j, gu] = True
        receives[j, gv] = True
        slot[lo:hi] = np.asarray(ids, np.int64)[j]
    pair_round = np.empty(len(sk), np.int64)
    pair_round[order] = slot
    by_round = np.lexsort((v, u, pair_round))
    cuts = np.searchsorted(pair_round[by_round], np.arange(1, len(round_k)))
    rounds = [
        (tuple(zip(ru.tolist(), rv.tolist())), kk)
        for ru, rv, kk in zip(np.split(u[by_round], cuts), np.split(v[by_round], cuts), round_k)
    ]
    return pair_round, rounds
