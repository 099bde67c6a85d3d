"""A formulation's links folded into the solver's node costs, edge tables and constant.

Each link of a :class:`~sbpjax.compiler.formulate.Formulation` is a cost
table between two nodes, a node and a fixed end, or two fixed ends, with a
weight (the chance its boxing runs). Folded, the links of one node become
its cost vector, those of one pair of nodes its edge table, the rest a
constant: the form :mod:`sbpjax.solver` takes.

The settling rounds (:func:`sbpjax.compiler.backend.solve_settled`) make a
few tables exact at a time and solve again; folding every link anew each
round was 0.40 s of the 32-layer scanned GPT's layout choice
(``benchmarks/compiler.py``, 12 rounds). :meth:`Folded.refold` folds again
only what the changed tables reach, each sum in the links' order as the
whole fold makes it, so the floats are the same and so is the plan.
"""

from __future__ import annotations

import copy

import numpy as np


class Folded:
    """The fold of ``links`` ((table, u or None, v or None, weight)) onto the
    nodes' own costs ``own`` and the constant ``own_const``: ``costs`` (per
    node), ``edges`` (``{(u, v): table}``, ``u < v``) and ``const``."""

    def __init__(self, own: list, own_const: float, links: list):
        self.own, self.own_const, self.links = own, own_const, links
        nodes: dict = {}  # node -> its links, in order
        edges: dict = {}  # (u, v) -> its links, in order
        consts: list = []
        reach: dict = {}  # id(table) -> (nodes, edges, whether the constant) its links fold into
        for k, (table, u, v, _) in enumerate(links):
            ns, es, c = reach.setdefault(id(table), (set(), set(), [False]))
            if u is None and v is None:
                consts.append(k)
                c[0] = True
            elif u is None or v is None or u == v:
                n = v if u is None else u
                nodes.setdefault(n, []).append(k)
                ns.add(n)
            else:
                e = (u, v) if u < v else (v, u)
                edges.setdefault(e, []).append(k)
                es.add(e)
        self._nodes, self._edges, self._consts = nodes, edges, consts
        self._reach = {t: (ns, es, c[0]) for t, (ns, es, c) in reach.items()}
        self.costs = [self._node_cost(n) for n in range(len(own))]
        self.edges = {e: self._edge_table(e) for e in edges}
        self.const = self._const()

    def refold(self, tables: set) -> Folded:
        """The fold after the tables ``tables`` (``id``s) changed: a new
        object sharing the arrays nothing changed (arrays are replaced, never
        changed in place: the last round's problem keeps its own)."""
        out = copy.copy(self)  # the index shared, the folded containers copied
        out.costs, out.edges = list(self.costs), dict(self.edges)
        nodes, edges, const = set(), set(), False
        for t in tables:
            ns, es, c = self._reach.get(t, ((), (), False))
            nodes.update(ns)
            edges.update(es)
            const |= c
        for n in nodes:
            out.costs[n] = out._node_cost(n)
        for e in edges:
            out.edges[e] = out._edge_table(e)
        if const:
            out.const = out._const()
        return out

    def _node_cost(self, n: int) -> np.ndarray:
        cost = self.own[n].copy()
        for k in self._nodes.get(n, ()):
            table, u, v, weight = self.links[k]
            t = weight * table.values
            if u is None:
                cost += t[0]
            elif v is None:
                cost += t[:, 0]
            else:  # both ends decide alike (one group): only the diagonal happens
                cost += np.diag(t)
        return cost

    def _edge_table(self, e: tuple) -> np.ndarray:
        out = None
        for k in self._edges[e]:  # an edge has at least one link
            table, u, _, weight = self.links[k]
            t = weight * table.values
            t = t if u == e[0] else t.T
            out = t if out is None else out + t
        assert out is not None
        return out

    def _const(self) -> float:
        const = self.own_const
        for k in self._consts:
            table, _, _, weight = self.links[k]
            const += (weight * table.values)[0, 0]
        return const


__all__ = ["Folded"]
