"""A second elimination order, by least fill, for graphs the min-size order makes too wide.

``_plan``'s greedy order eliminates the node whose new factor is smallest. On a chain of
layers that is the right order, and it is cheap to keep up to date. On a graph with many
cycles through a few hubs (a scanned model: the stacked parameters, their gradients and
the optimizer update all meet the loop's body) it can build a factor far wider than
needed: the model zoo's scanned 4-layer decoder (637 nodes) got a largest table of
3.3e8 entries by min-size and 9.7e6 by the order here, in 24 times less work.

The order: the node whose elimination adds the least *fill* (the new pairs among its
neighbours), each new pair weighted by the log2 of its two domain sizes (the entries it
adds to later factors); ties by the factor's size, then by node index. Scores are exact
fixed-point integers, so the order is a pure function of the graph and domain sizes. An
elimination changes the fill of the eliminated node's neighbours and of theirs; those are
scored again (lazily, in a heap).

Computing it costs a pass over each rescored node's pairs of neighbours: seconds on the
IOPDDL contest's instances S and M (thousands of nodes, far too wide for any exact plan).
So a cheap bound comes first (:func:`least_widest`): when no order can keep within the
cap, none is computed.
"""

from __future__ import annotations

import heapq

import numpy as np

from sbpjax.solver._model import Model, log_cap, log_sizes


def fill_order(model: Model, leaves: tuple, cap: float) -> list | None:
    """The nodes left after the leaf rounds ``leaves`` (``_eliminate.leaf_rounds``) in
    least-fill order, or None once the next node's factor would exceed ``cap`` entries
    (the exact plan would stop there)."""
    _, alive, pair_alive = leaves
    n = model.n
    logk = log_sizes(model.k)
    logcap = log_cap(cap)
    if least_widest(model, leaves) > logcap:
        return None
    nb = _neighbours(model, pair_alive)
    done = (~alive).tolist()
    version = [0] * n

    def key(x: int) -> tuple:
        ns = sorted(nb[x])
        fill = 0
        for i, a in enumerate(ns):
            near = nb[a]
            for b in ns[i + 1 :]:
                if b not in near:
                    fill += logk[a] + logk[b]
        return (fill, logk[x] + sum(logk[y] for y in ns), x)

    heap = [(*key(x), 0) for x in range(n) if not done[x] and nb[x]]
    heapq.heapify(heap)
    order: list = []
    while heap:
        _, size, x, ver = heapq.heappop(heap)
        if done[x] or ver != version[x]:
            continue
        if size > logcap:
            return None
        order.append(x)
        ns = nb[x]
        for a in ns:
            nb[a] |= ns
            nb[a].discard(a)
            nb[a].discard(x)
        done[x] = True
        nb[x] = set()
        rescored = set(ns)
        for a in ns:
            rescored |= nb[a]
        for y in sorted(rescored):
            if not done[y] and nb[y]:
                version[y] += 1
                heapq.heappush(heap, (*key(y), version[y]))
    return order


def least_widest(model: Model, leaves: tuple) -> int:
    """A lower bound, in fixed-point log2 entries, of the largest factor any elimination
    order of the graph left after ``leaves`` builds. Whatever the order, the first node of
    a subgraph H to go still has all its H-neighbours then, so its factor is at least the
    least of H's nodes' sizes (own domain times its H-neighbours'). The bound is the
    largest of those minima over the subgraphs left by taking away, one at a time, the
    node of least size (no fill: a peel, as for a graph's degeneracy)."""
    _, alive, pair_alive = leaves
    logk = log_sizes(model.k)
    nb = _neighbours(model, pair_alive)
    size = [logk[x] + sum(logk[y] for y in nb[x]) for x in range(model.n)]
    heap = [(size[x], x) for x in range(model.n) if alive[x]]
    heapq.heapify(heap)
    gone = (~alive).tolist()
    best = 0
    while heap:
        sc, x = heapq.heappop(heap)
        if gone[x] or sc != size[x]:
            continue
        best = max(best, sc)
        gone[x] = True
        for y in nb[x]:
            if not gone[y]:
                size[y] -= logk[x]
                heapq.heappush(heap, (size[y], y))
    return best


def _neighbours(model: Model, pair_alive: np.ndarray) -> list:
    nb: list = [set() for _ in range(model.n)]
    for i in np.flatnonzero(pair_alive).tolist():
        u, v = int(model.pu[i]), int(model.pv[i])
        nb[u].add(v)
        nb[v].add(u)
    return nb
