"""Synthetic problems shaped like ``sj.jit``'s layout choice of a training step.

:func:`train_step` builds the graph of a layered model's forward pass, its mirrored
backward pass and the optimizer, with the costs of a sharding choice:

- each layer is a chain of ops with a residual skip around each half (series-parallel);
- every op's output is read again by its mirror in the backward pass, and the backward
  chain runs the other way;
- each matmul has a weight, read by the forward op, the two backward ops and an optimizer
  chain hanging off it; with ``shared`` > 1, that many consecutive layers share one weight
  node (one decision read by every one of them: a hub);
- strategies are layouts: 1 to 30 per op (drawn from 1, 2, 3, 4, 4, 6, 8, 8, 9, 12, 16, 24,
  30: mostly a handful), one of them "replicated"; moving between layouts
  costs bytes (zero when equal), a few op pairs cannot change layout between them (inf
  off the diagonal), and each strategy uses memory over the op's live interval (forward
  time to its backward read), less when split.

Everything comes from one seeded generator: the same arguments give the same problem.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver.problem import Problem

_LAYOUTS = (1, 2, 3, 4, 4, 6, 8, 8, 9, 12, 16, 24, 30)
_OPS = ("norm", "matmul", "act", "matmul", "add", "norm", "matmul", "act", "matmul", "add")


def train_step(
    layers: int = 4,
    *,
    strategies: int = 8,
    shared: int = 1,
    memory: float | None = None,
    seed: int = 0,
) -> Problem:
    """A training step's layout choice (see the module docstring).

    :param layers: model layers (each adds about 46 nodes).
    :param strategies: the most layouts an op may have (draws above it are cut to it).
    :param shared: consecutive layers that share each weight (1: none).
    :param memory: the usage limit as a multiple of the least possible peak (None: no limit).
    :param seed: the random generator's seed.
    """
    g = _Builder(np.random.default_rng(seed), strategies)
    prev = g.node(0)
    forward: list = []
    weights: dict = {}
    for layer in range(layers):
        skip = prev
        for j, op in enumerate(_OPS):
            x = g.node(len(forward) + 1)
            g.edge(prev, x, follow=op in ("act", "norm"))
            if op == "add":
                g.edge(skip, x)
                skip = x
            if op == "matmul":
                key = (layer // shared, j)
                if key not in weights:
                    weights[key] = g.node(0, weight=True)
                g.edge(weights[key], x)
            forward.append((x, op, weights.get((layer // shared, j))))
            prev = x
    loss = g.node(len(forward) + 1)
    g.edge(prev, loss)
    grad = loss
    t_end = 2 * len(forward) + 2
    for t, (x, op, w) in enumerate(reversed(forward)):
        gx = g.node(len(forward) + 2 + t)
        g.edge(grad, gx, follow=op in ("act", "norm"))
        g.edge(x, gx)  # the saved activation, read again
        g.live[x] = (g.live[x][0], len(forward) + 3 + t)
        if op == "matmul":
            gw = g.node(len(forward) + 2 + t)
            g.edge(x, gw)
            g.edge(gx, gw)
            g.edge(w, gw)
            g.edge(w, gx)
            state = w
            for step in range(3):  # optimizer: moments and the update
                o = g.node(t_end + step)
                g.edge(state, o, follow=step > 0)
                state = o
        grad = gx
    return g.problem(memory)


class _Builder:
    def __init__(self, rng: np.random.Generator, strategies: int):
        self.rng = rng
        self.kmax = max(1, strategies)
        self.k: list = []
        self.size: list = []
        self.live: list = []
        self.edges: list = []

    def node(self, t: int, weight: bool = False) -> int:
        # layouts of a 2-4 dimensional tensor on a 2-D mesh: mostly a handful, a few up to kmax
        k = min(self.kmax, int(self.rng.choice(_LAYOUTS)))
        self.k.append(k)
        self.size.append(float(self.rng.integers(1, 64)) * (4.0 if weight else 1.0))
        self.live.append((t, t + 1))
        return len(self.k) - 1

    def _split(self, i: int) -> np.ndarray:
        """Each strategy's share of the tensor on one device: 1 replicated, else 1/2 .. 1/8."""
        r = np.random.default_rng(i * 7919 + self.k[i])
        return np.concatenate([[1.0], 1.0 / r.choice([2, 4, 8], self.k[i] - 1)])

    def edge(self, u: int, v: int, follow: bool = False) -> None:
        ku, kv = self.k[u], self.k[v]
        su, sv = self._split(u), self._split(v)
        # bytes to move from layout a to layout b: zero on the diagonal, more the more replicated
        m = self.size[u] * np.abs(su[:, None] - sv[None, :]) * self.rng.integers(1, 4, (ku, kv))
        n = min(ku, kv)
        m[np.arange(n), np.arange(n)] = 0.0
        if follow and ku == kv and ku > 1:
            m = np.where(np.eye(ku, dtype=bool), 0.0, np.inf)
        self.edges.append((u, v, np.round(m)))

    def problem(self, memory: float | None) -> Problem:
        n = len(self.k)
        costs = [np.round(self.size[i] * self._split(i) * self.rng.integers(1, 3)) for i in range(n)]
        if memory is None:
            return Problem(costs, self.edges)
        usages = [np.round(self.size[i] * self._split(i) * 8) for i in range(n)]
        intervals = np.array(self.live)
        least = Problem([np.zeros(len(u)) for u in usages], (), usages, intervals, None)
        peak = least.evaluate(np.array([int(np.argmin(u)) for u in usages]))[2]
        return Problem(costs, self.edges, usages, intervals, float(np.floor(memory * peak)))
