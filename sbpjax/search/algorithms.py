"""Search algorithms over tied choices (AutoDDL 4.6): exhaustive, coordinate descent
with restarts, Metropolis-Hastings. All are seeded and deterministic.

The cost of an assignment (one choice per tie group) is a sum of per-group terms
and per-pair-of-groups terms (edges between consecutive ops, summed over every
repetition of a tied layer), so changing one group's choice only touches that
group's terms: coordinate descent and Metropolis-Hastings re-price one group at
a time. Memory is summed the same way and an assignment over the limit costs inf.
"""

from __future__ import annotations

import math

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.search.cost import Tables


class Progress:
    """A progress bar (tqdm) on stderr; silent when disabled, and when enabled but
    stderr is not a terminal (tqdm's ``disable=None``), so logs stay clean."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = max(int(total), 1), label, enabled
        self.done = 0
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=label, disable=None, leave=True, mininterval=0.1)

    def update(self, n: int = 1, best: float | None = None):
        self.done += n
        if self._bar is None:
            return
        if best is not None:
            self._bar.set_postfix_str(f"best {best:.4g}", refresh=False)
        self._bar.update(n)

    def close(self):
        if self._bar is not None:
            self._bar.close()


class Problem:
    """The tables folded per tie group: ``unary[g]``, ``edges[(g, h)]`` (summed over
    every op edge from group g to group h), ``memory[g]``."""

    def __init__(self, tables: Tables):
        self.tables = tables
        n_groups = len(tables.groups)
        self.sizes = [len(o) for o in tables.options]
        self.unary = [np.zeros(s) for s in self.sizes]
        self.memory = [np.zeros(s) for s in self.sizes]
        edges: dict = {}
        og = tables.op_group
        for i in range(len(tables.ops)):
            self.unary[og[i]] = self.unary[og[i]] + tables.unary[i]
            self.memory[og[i]] = self.memory[og[i]] + tables.memory[i]
        for i, p in enumerate(tables.pair):
            key = (int(og[i]), int(og[i + 1]))
            edges[key] = edges.get(key, 0) + p
        self.edges = edges
        self.limit = tables.memory_limit
        # the edges touching each group, as (other group, matrix oriented [mine, other]);
        # self edges (consecutive repetitions of one tied op) act on the diagonal
        self.touch: list = [[] for _ in range(n_groups)]
        self.diag = [np.zeros(s) for s in self.sizes]
        for (g, h), m in edges.items():
            if g == h:
                self.diag[g] = self.diag[g] + np.diag(m)
            else:
                self.touch[g].append((h, m))
                self.touch[h].append((g, m.T))

    def cost(self, assign) -> float:
        mem = sum(self.memory[g][a] for g, a in enumerate(assign))
        if self.limit is not None and mem > self.limit:
            return math.inf
        total = sum(self.unary[g][a] + self.diag[g][a] for g, a in enumerate(assign))
        total += sum(m[assign[g], assign[h]] for (g, h), m in self.edges.items() if g != h)
        return float(total)

    def local(self, assign, g) -> np.ndarray:
        """The cost over group g's options with every other group fixed (inf where
        the memory limit breaks), up to a constant."""
        v = self.unary[g] + self.diag[g]
        for h, m in self.touch[g]:
            v = v + m[:, assign[h]]
        if self.limit is not None:
            rest = sum(self.memory[h][a] for h, a in enumerate(assign) if h != g)
            v = np.where(rest + self.memory[g] > self.limit, np.inf, v)
        return v

    def min_memory(self) -> list:
        return [int(np.argmin(m)) for m in self.memory]


def exhaustive(problem: Problem, progress: bool = False) -> tuple[list, float]:
    """Every assignment: a depth-first walk over all groups but the last, each leaf
    pricing all of the last group's options at once."""
    n = len(problem.sizes)
    total = math.prod(problem.sizes[:-1])
    bar = Progress(total, "exhaustive", progress)
    last = n - 1
    best: list = [math.inf, None]  # [cost, assignment]
    limit = problem.limit if problem.limit is not None else math.inf
    base_vec = problem.unary[last] + problem.diag[last]
    # edges among the first n-1 groups, by their later group; edges to the last group
    earlier: list = [[] for _ in range(n)]
    to_last: list = []
    for (g, h), m in problem.edges.items():
        if g == h:
            continue
        if last in (g, h):
            other = h if g == last else g
            to_last.append((other, m.T if g == last else m))  # oriented [other, last]
        else:
            earlier[max(g, h)].append((min(g, h), m if g < h else m.T))  # [lower, higher]
    assign = [0] * n

    def walk(g, acc, mem):
        if g == last:
            vec = base_vec + acc
            for o, m in to_last:
                vec = vec + m[assign[o]]
            vec = np.where(mem + problem.memory[last] > limit, np.inf, vec)
            a = int(np.argmin(vec))
            if vec[a] < best[0]:
                best[0] = float(vec[a])
                best[1] = assign[:last] + [a]
            bar.update(1, best[0])
            return
        u = problem.unary[g] + problem.diag[g]
        for a in range(problem.sizes[g]):
            assign[g] = a
            step = u[a] + sum(m[assign[lo], a] for lo, m in earlier[g])
            walk(g + 1, acc + step, mem + problem.memory[g][a])

    walk(0, 0.0, 0.0)
    bar.close()
    if best[1] is None:
        raise SBPError(_NO_FIT.format(limit=problem.limit, least=problem.cost(problem.min_memory())))
    return best[1], best[0]


_NO_FIT = (
    "search: no strategy fits the memory limit of {limit:.4g} bytes per device. Raise "
    "MemoryModel.limit, use more devices, or shrink the layers (gradient accumulation)."
)


def _descend(problem: Problem, assign: list) -> list:
    """Set each group in turn to its best option with the others fixed, until no
    group changes (every move lowers the cost, so this ends)."""
    changed = True
    while changed:
        changed = False
        for g in range(len(assign)):
            v = problem.local(assign, g)
            a, cur = int(np.argmin(v)), v[assign[g]]
            if np.isfinite(v[a]) and (not np.isfinite(cur) or v[a] < cur - 1e-12 * max(1.0, abs(v[a]))):
                assign[g] = a
                changed = True
    return assign


def _fit(problem: Problem, assign: list) -> list:
    """A random start over the memory limit: move groups, in order, to their
    least-memory option until it fits."""
    for g in range(len(assign)):
        if np.isfinite(problem.cost(assign)):
            break
        assign[g] = int(np.argmin(problem.memory[g]))
    return assign


def coordinate_descent(
    problem: Problem, restarts: int = 8, seed: int = 0, progress: bool = False
) -> tuple[list, float]:
    """AutoDDL's coordinate descent: from a random start, set each group in turn to
    its best option with the others fixed, until nothing changes; restart from new
    random starts (the first from the least-memory assignment) and keep the best."""
    rng = np.random.default_rng(seed)
    bar = Progress(restarts, "coordinate descent", progress)
    best, best_cost = None, math.inf
    for r in range(restarts):
        start = problem.min_memory() if r == 0 else [int(rng.integers(s)) for s in problem.sizes]
        assign = _descend(problem, _fit(problem, start))
        c = problem.cost(assign)
        if c < best_cost:
            best, best_cost = list(assign), c
        bar.update(1, best_cost)
    bar.close()
    if best is None:
        raise SBPError(_NO_FIT.format(limit=problem.limit, least=problem.cost(problem.min_memory())))
    return best, best_cost


def metropolis_hastings(
    problem: Problem, steps: int = 2000, temperature: float = 0.05, seed: int = 0, progress: bool = False
) -> tuple[list, float]:
    """AutoDDL's Metropolis-Hastings: P(S) ~ exp(-cost(S) / (temperature * cost(S0))).
    Each step re-draws one random group's choice; a cheaper proposal is always
    accepted, a dearer one with probability exp(-increase / (temperature * cost(S0)))."""
    rng = np.random.default_rng(seed)
    assign = problem.min_memory()
    cur = problem.cost(assign)
    if not np.isfinite(cur):
        raise SBPError(_NO_FIT.format(limit=problem.limit, least=cur))
    scale = temperature * max(cur, 1e-30)
    best, best_cost = list(assign), cur
    bar = Progress(steps, "metropolis-hastings", progress)
    n = len(problem.sizes)
    for _ in range(steps):
        g = int(rng.integers(n))
        v = problem.local(assign, g)
        a = int(rng.integers(problem.sizes[g]))
        delta = v[a] - v[assign[g]]
        if np.isfinite(v[a]) and (delta <= 0 or rng.random() < math.exp(-delta / scale)):
            assign[g] = a
            cur += delta
            if cur < best_cost - 1e-12 * max(1.0, abs(cur)):
                best, best_cost = list(assign), cur
        bar.update(1, best_cost)
    bar.close()
    return best, problem.cost(best)
