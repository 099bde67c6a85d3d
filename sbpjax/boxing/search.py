"""The planner's searches: the cheapest path of steps between two layouts.

A plan is a shortest path over layouts (:class:`~sbpjax.layout.Layout`), with
cost ``(bytes, time, steps)`` compared in that order (see
:mod:`sbpjax.boxing.plan`). The moves from a layout are its collectives over
one axis or a group, its free local steps and a point-to-point exchange
(``_local_moves``). A search is shared by the plans of one shape, itemsize,
placement and cost model (``_shared_search``): a layer's values and their alike
in every other layer.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import CostModel
from sbpjax.boxing.steps import Step, _Ctx, ring_latency_bytes, step_launch_bytes
from sbpjax.layout import Layout
from sbpjax.placement import Placement

_STRUCTURES: dict = {}
_SHARED_CTX: dict = {}
_FEWER: dict = {}  # (search key, src, dst, k) -> fewest-bytes paths of 1..k collectives (None: none)
_TREES: dict = {}  # (search key, src) -> _Tree: every target's search from src


def clear_search_caches() -> None:
    """Forget every search made so far."""
    for cache in (_STRUCTURES, _SHARED_CTX, _FEWER, _TREES):
        cache.clear()


def _with_dims(layout: Layout, changes: dict) -> tuple:
    return tuple(changes.get(d, axes) for d, axes in enumerate(layout.dims))


def _reducible(layout: Layout, axis: int) -> bool:
    """A partial over ``axis`` may be reduced now: later partial axes share its op."""
    ops = dict(layout.partial)
    return all(op == ops[axis] for b, op in layout.partial if b > axis)


def _free_moves(ctx: _Ctx, L: Layout) -> list[Step]:
    """The moves from ``L`` that do not depend on the target, cached on the
    context (a shared context serves many searches, which meet the same
    layouts)."""
    local = ctx._move_cache.get(L)
    if local is None:
        local = ctx._move_cache[L] = list(_local_moves(ctx, L))
    return local


def _edges(ctx: _Ctx, L: Layout, target: Layout) -> list:
    """Every move from ``L`` as ``_free_edges`` tuples: the target-free ones
    and, last, the point-to-point exchange straight to ``target`` (where one
    is offered)."""
    local = _free_edges(ctx, L)
    if L.partial == target.partial and L is not target:
        s = ctx.permute(L, target)
        if s is not None:
            return local + [(s.dst, s.bytes, s.tie_time, s)]
    return local


def _local_moves(ctx: _Ctx, L: Layout):
    grid = ctx.geom.grid
    ndim = ctx.geom.ndim
    partial = dict(L.partial)
    split_axes = L.split_axes()
    # Gathers, all-to-alls and fills of the innermost splits of each dim.
    for d, axes in enumerate(L.dims):
        for k in range(1, len(axes) + 1):
            group, rest = axes[-k:], axes[:-k]
            yield ctx.step("all_gather", L, Layout(_with_dims(L, {d: rest}), L.partial), group, dim=d)
            for e in range(ndim):
                if e == d:
                    continue
                new = Layout(_with_dims(L, {d: rest, e: L.dims[e] + group}), L.partial)
                yield ctx.step("all_to_all", L, new, group, dim=d, dim2=e)
        if axes:
            a = axes[-1]
            for op in ctx.fill_ops:
                others = {o for _, o in L.partial}
                if op != "sum" and others - {op}:
                    continue  # the identity fill of max/min does not commute with a sum
                new = Layout(_with_dims(L, {d: axes[:-1]}), tuple(sorted(L.partial + ((a, op),))))
                yield ctx.step("zero_fill", L, new, (a,), reduce=op, dim=d)
    # Reductions of partials, over one axis or several with the same op.
    reducible = [a for a, _ in L.partial if _reducible(L, a)]
    by_op: dict = {}
    for a in reducible:
        by_op.setdefault(partial[a], []).append(a)
    for op, cand in by_op.items():
        for r in range(1, len(cand) + 1):
            for group in itertools.combinations(cand, r):
                rest = tuple((a, o) for a, o in L.partial if a not in group)
                yield ctx.step("all_reduce", L, Layout(L.dims, rest), group, reduce=op)
                for d in range(ndim):
                    new = Layout(_with_dims(L, {d: L.dims[d] + group}), rest)
                    yield ctx.step("reduce_scatter", L, new, group, reduce=op, dim=d)
    # Free local steps from B.
    for a in range(len(grid)):
        if a in split_axes or a in partial or grid[a] == 1:
            continue
        for d in range(ndim):
            yield ctx.step(
                "local_slice", L, Layout(_with_dims(L, {d: L.dims[d] + (a,)}), L.partial), (a,), dim=d
            )
        for op in ctx.fill_ops:
            yield ctx.step(
                "zero_fill", L, Layout(L.dims, tuple(sorted(L.partial + ((a, op),)))), (a,), reduce=op
            )
    # Point-to-point exchange to the nd-SBP order (the one straight to the
    # target is added by _edges).
    if not L.canonical:
        s = ctx.permute(L, L.canonicalized())
        if s is not None:
            yield s


def _search(ctx: _Ctx, src: Layout, dst: Layout, collectives: int | None = None):
    """The cheapest path of steps from ``src`` to ``dst``: fewest bytes, then
    the least ``tie_time``, then the fewest steps. ``collectives``: among the
    paths of at most that many collectives only (None where there is none)."""
    if src == dst:
        return []
    # A direct exchange (same partials, even tiles) bounds every useful path:
    # costs only grow, so states above its bytes are never pushed.
    direct = ctx.permute(src, dst) if src.partial == dst.partial else None
    bound = direct.bytes if direct is not None else None
    counter = itertools.count()
    # a state: a layout and, under a cap on collectives, how many it took (else 0)
    start: tuple = (src, 0)
    best = {start: (0, 0.0, 0)}
    prev: dict = {start: None}
    heap = [((0, 0.0, 0), next(counter), start)]
    end = None
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        L, used = state
        if L == dst:
            end = state
            break
        nbytes, ntime, nsteps = cost
        nsteps += 1
        # written out as in _tree: most relaxations lose on bytes alone
        for nxt_layout, sbytes, stime, step in _edges(ctx, L, dst):
            n = used
            if collectives is not None:
                n += sbytes > 0
                if n > collectives:
                    continue
            nb = nbytes + sbytes
            if bound is not None and nb > bound:
                continue
            nxt = (nxt_layout, n)
            old = best.get(nxt)
            if old is not None and (
                nb > old[0] or (nb == old[0] and not _less((nb, ntime + stime, nsteps), old))
            ):
                continue
            nc = (nb, ntime + stime, nsteps)
            best[nxt] = nc
            prev[nxt] = (state, step)
            heapq.heappush(heap, (nc, next(counter), nxt))
    if end is None:
        if collectives is not None:
            return None
        raise SBPError(f"no boxing path from {src} to {dst} (please report this as a bug).")
    return _path(ctx, prev, end)


def _path(ctx: _Ctx, prev: dict, end) -> list:
    """The exact steps a search's ``prev`` links lead back from ``end``."""
    steps = []
    node = end
    while prev[node] is not None:
        node, step = prev[node]
        steps.append(ctx.exact(step))
    return steps[::-1]


@dataclasses.dataclass
class _Tree:
    """Every layout's cheapest path from one source by the target-free moves
    (``_free_moves``): ``best`` its cost, ``prev`` (layout, step) it was
    reached by, ``order`` the layouts in the order the search expanded them."""

    best: dict
    prev: dict
    order: dict


def _tree(ctx: _Ctx, src: Layout) -> _Tree:
    """``_search`` from ``src`` run to the end, without a target
    (``_search_from``).

    The inner loop is written out: the trees are most of the planning time
    of a 2-D program on a 3-D placement (1,684 trees of a few hundred layouts
    for a 3-layer GPT on 2x2x2), and most relaxations lose on bytes alone,
    which one comparison settles before ``_less`` is called."""
    counter = itertools.count()
    best = {src: (0, 0.0, 0)}
    prev: dict = {src: None}
    order: dict = {}
    heap = [((0, 0.0, 0), next(counter), src)]
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        cost, _, L = pop(heap)
        if cost > best[L]:
            continue
        if L not in order:
            order[L] = len(order)
        nbytes, ntime, nsteps = cost
        nsteps += 1
        for nxt, sbytes, stime, step in _free_edges(ctx, L):
            old = best.get(nxt)
            nb = nbytes + sbytes
            if old is not None and (
                nb > old[0] or (nb == old[0] and not _less((nb, ntime + stime, nsteps), old))
            ):
                continue
            nc = (nb, ntime + stime, nsteps)
            best[nxt] = nc
            prev[nxt] = (L, step)
            push(heap, (nc, next(counter), nxt))
    return _Tree(best, prev, order)


def _free_edges(ctx: _Ctx, L: Layout) -> list:
    """``_free_moves`` as ``(target layout, bytes, tie time, step)`` tuples,
    cached beside them (a tree reads each layout's moves once per source)."""
    edges = ctx._edge_cache.get(L)
    if edges is None:
        edges = ctx._edge_cache[L] = [(st.dst, st.bytes, st.tie_time, st) for st in _free_moves(ctx, L)]
    return edges


def _search_from(ctx: _Ctx, tree: _Tree, src: Layout, dst: Layout) -> list:
    """``_search(ctx, src, dst)``'s path, read from ``src``'s ``tree``.

    The targeted search's moves are the target-free ones plus, last from
    each layout, an exchange straight to the target, which ends a path. Its
    states are expanded in the tree's order (the extra pushes of the target
    do not reorder the others), so its path is the cheaper of the tree's own
    path to ``dst`` and each expanded layout's path followed by the
    exchange, on equal cost (``_less``) the one found first: by the
    expansion of the layout it leaves from, the exchange after that
    layout's other moves. Every pair of layouts of a shape is asked for
    (thousands for a 2-D GPT on 2x2x2), and one tree per source answers
    them all."""
    if src == dst:
        return []
    # (time, cost, (layout, step)): the time of a relaxation is the expansion
    # index of the layout it leaves from, and 1 for the exchange (moved last)
    events = []
    if dst in tree.best:
        came = tree.prev[dst]
        events.append(((tree.order[came[0]], 0), tree.best[dst], came))
    # no path of more bytes than the direct exchange or the tree's own path can
    # win, and the tree expanded its layouts in order of cost
    direct = ctx.permute(src, dst) if src.partial == dst.partial else None
    bound = min(
        [e[1][0] for e in events] + ([direct.bytes] if direct is not None else []),
        default=math.inf,
    )
    best, permutes, missing = tree.best, ctx._p2p_cache, object()
    for L, index in tree.order.items():
        c = best[L]
        # an exchange moves bytes (``_Ctx.permute``: one that moves none is no step), so
        # from a layout reached with ``bound`` bytes or more, the fewest of a path found
        # so far, it loses on bytes (``_less``); the tree's order is by bytes first, and
        # many layouts tie on them (slices are free). Halves the exchanges costed for a
        # 2-D GPT on 2x2x2.
        if c[0] >= bound:
            break
        if L.partial != dst.partial or L is dst:
            continue
        # ctx.permute's cache read here: ~40 layouts for each of thousands of pairs
        s = permutes.get((L, dst), missing)
        if s is missing:
            s = ctx.permute(L, dst)
        if s is not None:
            total = c[0] + s.bytes
            events.append(((index, 1), (total, c[1] + s.tie_time, c[2] + 1), (L, s)))
            bound = min(bound, total)
    events.sort(key=lambda e: e[0])
    won = None
    for _, cost, came in events:
        if won is None or _less(cost, won[0]):
            won = (cost, came)
    if won is None:
        raise SBPError(f"no boxing path from {src} to {dst} (please report this as a bug).")
    left, last = won[1]
    return _path(ctx, tree.prev, left) + [ctx.exact(last)]


def _less(a, b) -> bool:
    # Times are float sums: compare with a relative tolerance so equal-cost paths
    # fall back to the step count deterministically.
    if a[0] != b[0]:
        return a[0] < b[0]
    if not math.isclose(a[1], b[1], rel_tol=1e-9, abs_tol=1e-15):
        return a[1] < b[1]
    return a[2] < b[2]


def shape_unit(shape: tuple, devices: int) -> tuple[tuple, int]:
    """``shape``'s class representative for bytes (``plan.bytes_lower_bound``,
    the layout choice's bounds): each dim that divides by the device count set
    to that count (it splits evenly under every layout, so a step's bytes are
    its size times a factor of the layouts alone), and how many times that
    shape's size ``shape``'s is."""
    unit = tuple(devices if d and d % devices == 0 else d for d in shape)
    return unit, math.prod(d // devices for d in shape if d and d % devices == 0)


def _search_key(ctx: _Ctx, placement: Placement, cm: CostModel):
    """What a search is shared by (``_shared_search``): the shape, itemsize,
    placement, fill ops and cost model; None for a scalar or an empty tensor
    (searched on their own).

    Decision: only equal shapes share, not every shape of a bytes class
    (``shape_unit``). Bytes scale alike across a class, but paths of equal
    bytes are ranked by time, and the time of one can grow with the size
    unlike the other's, so the cheapest path of one shape of a class is not
    another's. On links of two bandwidths a sum over two nodes of 4 is one
    all-reduce for a small tensor and, for a large one, a reduce-scatter
    inside the nodes, an all-reduce between them and an all-gather; with one
    bandwidth, a permute's time counts its busiest device, whose share
    differs between schedules, so ``(P, S(0)) -> (B, S(1))`` on 2x4 takes a
    reduce-scatter over dim 0 for a large tensor and over dim 1 for a small
    one. Shared by the class, every shape got the plan of the first one the
    process planned (``tests/boxing/test_plan.py``)."""
    shape = ctx.geom.shape
    if not shape or 0 in shape:
        return None
    return (placement, shape, ctx.itemsize, ctx.fill_ops, repr(cm))


def _shared_search(ctx: _Ctx, src: Layout, dst: Layout, placement: Placement, cm: CostModel) -> list:
    """The search, shared by the plans of one key (``_search_key``). Every
    search of a key runs in one context (that of the first plan asked for:
    its steps are the others' too, the key fixing what they cost), so the
    moves of the layouts they share are generated once, and one tree per
    source serves every target."""
    shared = _search_key(ctx, placement, cm)
    if shared is None:
        return _search(ctx, src, dst)
    key = (shared, src, dst)
    if key not in _STRUCTURES:
        shared_ctx = _SHARED_CTX.setdefault(shared, ctx)
        tree = _TREES.get((shared, src))
        if tree is None:
            tree = _TREES[shared, src] = _tree(shared_ctx, src)
        _STRUCTURES[key] = _search_from(shared_ctx, tree, src, dst)
    return _STRUCTURES[key]


def _priced_search(
    ctx: _Ctx, src: Layout, dst: Layout, placement: Placement, cm: CostModel, steps, ring: bool = False
):
    """A path cheaper than ``steps`` (the fewest-bytes path) by bytes plus
    launches (``plan_boxing``'s ``launch_priced``; ``ring``: plus each
    collective's ring latency, ``ring_latency_bytes``), or None. Only a path of
    fewer collectives can be: for each count below ``steps``' the path of
    the fewest bytes is found once per search key (``_search_key``) and pair
    of layouts, and the cheapest of them by bytes plus launches is taken."""
    fewer = sum(1 for st in steps if st.bytes > 0) - 1
    shared = _search_key(ctx, placement, cm)
    search_ctx = ctx if shared is None else _SHARED_CTX.setdefault(shared, ctx)

    def search() -> list:
        return [_search(search_ctx, src, dst, collectives=k) for k in range(1, fewer + 1)]

    if shared is None:
        found = search()
    else:
        key = (shared, src, dst, fewer)
        if key not in _FEWER:
            _FEWER[key] = search()
        found = _FEWER[key]
    paths = [p for p in found if p is not None]

    def latency(st) -> float:
        if not ring:
            return step_launch_bytes(st, cm)
        return ring_latency_bytes(cm, placement, st.op, st.axes, st.rounds) if st.bytes > 0 else 0.0

    def price(path) -> float:  # the shared context's steps: the same shape and itemsize
        return sum(st.bytes + latency(st) for st in path)

    best = min(paths, key=price, default=None)
    if best is None or price(best) >= price(steps):
        return None
    return best
