"""The problem form: strategies per node, pairwise edge costs, memory over time.

It is the form of the IOPDDL contest (ASPLOS 2025 / EuroSys 2025, ``google/iopddl``):

- node ``i`` has ``len(costs[i])`` strategies; ``costs[i][s]`` is its cost under
  strategy ``s`` (``inf``, or ``1e18`` and more in JSON, marks a strategy not allowed);
- an edge ``(u, v, matrix)`` adds ``matrix[s_u, s_v]``; several edges may join the
  same pair of nodes, and each counts;
- optionally, node ``i`` holds ``usages[i][s]`` of memory at the time points
  ``intervals[i][0] <= t < intervals[i][1]`` (half-open; ``[0, 0]`` holds none), and the
  usages of the nodes live at any time point must sum to at most ``usage_limit``.

A solution is one strategy per node. :meth:`Problem.evaluate` prices it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from sbpjax._errors import SBPError

# The contest marks a strategy (or a pair of strategies) that is not allowed with a cost
# of 1e18; its real costs stay below 1e13. Reading JSON, a cost at or above this is inf.
FORBIDDEN_COST = 1e18


class Edge(NamedTuple):
    """An edge between nodes ``u`` and ``v``: ``costs[s_u, s_v]`` (float64, k_u x k_v)."""

    u: int
    v: int
    costs: np.ndarray


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _ragged(seqs, what: Callable[[int], str]) -> list[np.ndarray]:
    """Each sequence of costs as a float64 array (a view into one checked flat array): NaN is
    an error, a cost at or above FORBIDDEN_COST becomes inf. ``what(i)`` names entry i."""
    arrays = []
    for i, c in enumerate(seqs):
        try:
            arrays.append(np.array(c, dtype=np.float64))
        except (TypeError, ValueError) as err:
            raise SBPError(f"{what(i)}: costs must be numbers, got {c!r:.80}; {err}") from None
    if not arrays:
        return []
    flat = np.concatenate([a.reshape(-1) for a in arrays])
    nan = np.isnan(flat)
    if nan.any():
        offsets = np.cumsum([a.size for a in arrays])
        i = int(np.searchsorted(offsets, np.flatnonzero(nan)[0], side="right"))
        raise SBPError(f"{what(i)}: a cost is NaN; give a number, or inf for a strategy that is not allowed.")
    flat[flat >= FORBIDDEN_COST] = np.inf
    flat.flags.writeable = False
    out, start = [], 0
    for a in arrays:
        out.append(flat[start : start + a.size].reshape(a.shape))
        start += a.size
    return out


@dataclass(frozen=True, eq=False)
class Problem:
    """One choice problem: see the module docstring. Arrays are read-only after construction.

    :param costs: one sequence of strategy costs per node (float; ``inf`` or >= 1e18: not allowed).
    :param edges: ``(u, v, matrix)`` triples; ``matrix`` is ``len(costs[u]) x len(costs[v])``,
        or the same flattened by rows.
    :param usages: one sequence of memory usages per node, one per strategy (optional).
    :param intervals: ``(lo, hi)`` per node: live at ``lo <= t < hi`` (needed with ``usages``).
    :param usage_limit: the most memory in use at any time point (``None``: no limit).
    :param name: a label (the contest files carry one).
    """

    costs: Sequence
    edges: Sequence = ()
    usages: Sequence | None = None
    intervals: np.ndarray | None = None
    usage_limit: float | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        costs = tuple(_ragged(self.costs, lambda i: f"node {i}"))
        for i, c in enumerate(costs):
            if c.ndim != 1 or c.size == 0:
                raise SBPError(
                    f"node {i}: costs has shape {c.shape}; give a non-empty list with one cost per strategy."
                )
        object.__setattr__(self, "costs", costs)
        object.__setattr__(self, "edges", self._check_edges(self.edges, costs))
        self._check_memory(costs)

    @staticmethod
    def _check_edges(edges, costs: tuple) -> tuple:
        n, ends = len(costs), []
        for j, edge in enumerate(edges):
            try:
                u, v, _ = edge
                ends.append((int(u), int(v)))
            except (TypeError, ValueError):
                raise SBPError(f"edge {j}: {edge!r:.80} is not a (u, v, cost matrix) triple.") from None
            if not (0 <= ends[-1][0] < n and 0 <= ends[-1][1] < n):
                raise SBPError(f"edge {j}: joins nodes {u} and {v}, but the nodes are 0 .. {n - 1}.")
            if ends[-1][0] == ends[-1][1]:
                raise SBPError(
                    f"edge {j}: joins node {u} to itself; put such a cost in the node's own costs."
                )
        matrices = _ragged([e[2] for e in edges], lambda j: f"edge {j} {ends[j]}")
        out = []
        for j, ((u, v), m) in enumerate(zip(ends, matrices)):
            ku, kv = costs[u].size, costs[v].size
            if m.size != ku * kv or (m.ndim == 2 and m.shape != (ku, kv)) or m.ndim > 2:
                raise SBPError(
                    f"edge {j} ({u}, {v}): its cost matrix has shape {m.shape}; it needs len(costs[{u}]) x "
                    f"len(costs[{v}]) = {ku} x {kv} entries (row s_u, column s_v), or as many flattened by rows."
                )
            out.append(Edge(u, v, m.reshape(ku, kv)))
        return tuple(out)

    def _check_memory(self, costs: tuple) -> None:
        n = len(costs)
        if self.usages is None:
            if self.intervals is not None or self.usage_limit is not None:
                raise SBPError(
                    "intervals or usage_limit given without usages; give usages (one per strategy)."
                )
            return
        if self.intervals is None:
            raise SBPError("usages given without intervals; give each node's [lo, hi) live interval.")
        if len(self.usages) != n:
            raise SBPError(f"usages has {len(self.usages)} entries for {n} nodes; give one list per node.")
        usages = tuple(_frozen(np.array(u, dtype=np.float64).reshape(-1)) for u in self.usages)
        for i, (u, c) in enumerate(zip(usages, costs)):
            if u.size != c.size:
                raise SBPError(
                    f"node {i}: {c.size} strategies but {u.size} usages; give one usage per strategy."
                )
            if not np.isfinite(u).all():
                raise SBPError(f"node {i}: usages {u.tolist()} are not all finite numbers.")
        iv = np.array(self.intervals, dtype=np.float64)
        if iv.shape != (n, 2) or not np.isfinite(iv).all() or (iv != np.round(iv)).any():
            raise SBPError(
                f"intervals has shape {iv.shape}; give one [lo, hi] pair of integers per node ({n})."
            )
        bad = np.flatnonzero(iv[:, 0] > iv[:, 1])
        if bad.size:
            i = int(bad[0])
            raise SBPError(
                f"node {i}: interval [{iv[i, 0]:.0f}, {iv[i, 1]:.0f}] has lo > hi; intervals are half-open "
                "[lo, hi) with lo <= hi ([t, t] holds no memory)."
            )
        if self.usage_limit is not None and not np.isfinite(float(self.usage_limit)):
            raise SBPError(
                f"usage_limit {self.usage_limit!r} is not a finite number; give None for no limit."
            )
        object.__setattr__(self, "usages", usages)
        object.__setattr__(self, "intervals", _frozen(iv.astype(np.int64)))
        if self.usage_limit is not None:
            object.__setattr__(self, "usage_limit", float(self.usage_limit))

    @classmethod
    def _prechecked(cls, costs: Sequence, edges: Sequence) -> Problem:
        """A problem without a usage limit from arrays its caller made and checked: one
        non-empty 1-D float64 array per node (no NaN; a forbidden strategy costs inf) and
        ``(u, v, matrix)`` edges, ``matrix`` a ``k_u x k_v`` float64 array, ``u != v``.
        The constructor's checks are skipped: ``sj.jit``'s settling rounds build a problem
        a round from tables they keep, and checking them again was an eighth of the demo's
        layout choice (``sbpjax.compiler.backend.form_problem``)."""
        p = object.__new__(cls)
        object.__setattr__(p, "costs", tuple(costs))
        object.__setattr__(p, "edges", tuple(Edge(int(u), int(v), m) for u, v, m in edges))
        for name in ("usages", "intervals", "usage_limit", "name"):
            object.__setattr__(p, name, None)
        return p

    # ---- sizes and flat views -------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.costs)

    @cached_property
    def num_strategies(self) -> np.ndarray:
        """The number of strategies of each node (int64)."""
        return _frozen(np.array([c.size for c in self.costs], dtype=np.int64))

    @cached_property
    def _flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Node costs and edge matrices flattened, with their offsets, and the edge ends."""
        k = self.num_strategies
        node_off = np.concatenate([[0], np.cumsum(k)])
        node_flat = np.concatenate(self.costs) if self.costs else np.zeros(0)
        ends = np.array([(e.u, e.v) for e in self.edges], dtype=np.int64).reshape(-1, 2)
        sizes = k[ends[:, 0]] * k[ends[:, 1]]
        edge_off = np.concatenate([[0], np.cumsum(sizes)])
        edge_flat = np.concatenate([e.costs.reshape(-1) for e in self.edges]) if self.edges else np.zeros(0)
        return node_off, node_flat, ends, edge_off, edge_flat

    # ---- pricing ------------------------------------------------------------------------

    def check_strategies(self, strategies) -> np.ndarray:
        """``strategies`` as an int64 array, or an SBPError saying which entry is out of range."""
        s = np.asarray(strategies)
        if s.shape != (self.num_nodes,):
            raise SBPError(
                f"strategies has shape {s.shape}; give one strategy index per node ({self.num_nodes})."
            )
        if s.size and not np.issubdtype(s.dtype, np.integer):
            if not np.issubdtype(s.dtype, np.floating) or (s != np.round(s)).any():
                raise SBPError(f"strategies must be integers, got dtype {s.dtype}.")
        s = s.astype(np.int64)
        bad = np.flatnonzero((s < 0) | (s >= self.num_strategies))
        if bad.size:
            i = int(bad[0])
            raise SBPError(
                f"strategies[{i}] = {s[i]}, but node {i} has strategies 0 .. {self.num_strategies[i] - 1}."
            )
        return s

    def usage_profile(self, strategies) -> np.ndarray:
        """Memory in use at each time point 0 .. max(hi) - 1 (empty without usages)."""
        if self.usages is None:
            return np.zeros(0)
        s = self.check_strategies(strategies)
        iv = self.intervals
        assert iv is not None
        lo = iv[:, 0] - iv[:, 0].min() if len(iv) else iv[:, 0]
        hi = iv[:, 1] - (iv[:, 0].min() if len(iv) else 0)
        u = np.array([self.usages[i][s[i]] for i in range(len(s))]) if len(s) else np.zeros(0)
        live = lo < hi
        diff = np.zeros(int(hi.max()) + 1 if len(hi) else 1)
        np.add.at(diff, lo[live], u[live])
        np.add.at(diff, hi[live], -u[live])
        return np.cumsum(diff)[:-1]

    def evaluate(self, strategies) -> tuple[float, bool, float]:
        """``(cost, feasible, peak usage)`` of one strategy per node.

        ``cost`` is inf when a strategy or a pair of strategies is not allowed; ``feasible``
        says the cost is finite and the peak usage is at most ``usage_limit``.
        """
        s = self.check_strategies(strategies)
        node_off, node_flat, ends, edge_off, edge_flat = self._flat
        cost = float(node_flat[node_off[:-1] + s].sum())
        if len(ends):
            kv = self.num_strategies[ends[:, 1]]
            cost += float(edge_flat[edge_off[:-1] + s[ends[:, 0]] * kv + s[ends[:, 1]]].sum())
        profile = self.usage_profile(s)
        peak = float(profile.max()) if profile.size else 0.0
        feasible = bool(np.isfinite(cost)) and (self.usage_limit is None or peak <= self.usage_limit)
        return cost, feasible, peak

    # ---- JSON ---------------------------------------------------------------------------

    @classmethod
    def from_json(cls, obj: Any) -> Problem:
        """From the contest's JSON object (``{"problem": {...}}``, or the inner object)."""
        if not isinstance(obj, dict):
            raise SBPError(f"a problem is a JSON object, got {type(obj).__name__}.")
        p = obj.get("problem", obj)
        if not isinstance(p, dict) or not isinstance(p.get("nodes"), dict):
            raise SBPError(
                'the problem has no "nodes" object; see the IOPDDL form (nodes.costs, edges.nodes, ...).'
            )
        nodes, edges = p["nodes"], p.get("edges") or {}
        costs = _list(nodes, "costs", "nodes")
        ends, ecosts = _list(edges, "nodes", "edges", []), _list(edges, "costs", "edges", [])
        if len(ends) != len(ecosts):
            raise SBPError(
                f"edges.nodes has {len(ends)} entries but edges.costs {len(ecosts)}; give one each."
            )
        triples = []
        for j, (pair, m) in enumerate(zip(ends, ecosts)):
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise SBPError(f"edges.nodes[{j}] = {pair!r:.60}; give a [u, v] pair of node indices.")
            triples.append((pair[0], pair[1], m))
        usages, intervals = nodes.get("usages"), nodes.get("intervals")
        limit = p.get("usage_limit")
        if usages is None and intervals is not None:
            usages = [[0] * len(c) for c in costs]  # live intervals with no usage: nothing to limit
        if usages is not None and intervals is None:
            raise SBPError("nodes.usages given without nodes.intervals; give each node's [lo, hi] interval.")
        name = p.get("name")
        return cls(costs, tuple(triples), usages, intervals, limit, None if name is None else str(name))

    def to_json(self) -> dict:
        """The contest's JSON object; inf becomes 1e18 and whole numbers are written as integers."""
        nodes: dict[str, Any] = {"costs": [_json_numbers(c) for c in self.costs]}
        if self.usages is not None:
            assert self.intervals is not None
            nodes["intervals"] = self.intervals.tolist()
            nodes["usages"] = [_json_numbers(u) for u in self.usages]
        out: dict[str, Any] = {
            "nodes": nodes,
            "edges": {
                "nodes": [[e.u, e.v] for e in self.edges],
                "costs": [_json_numbers(e.costs.reshape(-1)) for e in self.edges],
            },
        }
        if self.usage_limit is not None:
            out["usage_limit"] = _json_numbers(np.array([self.usage_limit]))[0]
        if self.name is not None:
            out["name"] = self.name
        return {"problem": out}


def _list(obj: dict, key: str, where: str, default=None) -> list:
    value = obj.get(key, default)
    if value is None:
        raise SBPError(f'{where} has no "{key}" list; see the IOPDDL form.')
    if not isinstance(value, list):
        raise SBPError(f"{where}.{key} must be a list, got {type(value).__name__}.")
    return value


def _json_numbers(a: np.ndarray) -> list:
    a = np.where(np.isinf(a), FORBIDDEN_COST, a)
    if (a == np.round(a)).all() and np.abs(a).max(initial=0) < 2**63:
        return [int(x) for x in a]
    return a.tolist()


def load_problem(path: str | os.PathLike) -> Problem:
    """A problem from a contest JSON file, plain or gzip-compressed (told apart by content)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise SBPError(f"cannot read problem file {os.fspath(path)!r}: {err.strerror}.") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:
            raise SBPError(f"{os.fspath(path)!r}: a broken gzip file ({err}).") from None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SBPError(f"{os.fspath(path)!r} is not JSON: {err}.") from None
    return Problem.from_json(obj)
