"""Elimination plans kept across solves of one graph, keyed by its shape.

A plan (:mod:`sbpjax.solver._plan`) depends only on the graph: the domain sizes, the pairs,
the table cap and, for a move, its seed. ``sj.jit``'s settling rounds solve one graph a
dozen or more times with new costs (``sbpjax.compiler.backend.solve_settled``), so the
plans of one round serve the next:

- a move's plans (``_search``): building them was half of each round's time on a small
  decoder (970 plans, 27 of 57 s);
- the exact elimination's plan (``solve``): a fifth of the layout choice of the demo's
  2-layer GPT step, whose 18 rounds solve two graphs (16 of the 18 plans were rebuilt).

A kept plan is charged to the budget as if it were built, so a solve's result never depends
on what the process solved before. The caches are bounded (oldest dropped first) and hold
plans only, never costs.
"""

from __future__ import annotations

import collections
import hashlib
import threading

import numpy as np

from sbpjax.solver import _eliminate, _plan
from sbpjax.solver._model import Model

# (graph key, seed) -> a move's plan: a solve's phases move through many seeds (each phase
# cycles through a pool of its own): 256 plans keep the seeds of a dozen rounds of one graph
# (a plan of a 700-node random graph pickles to about 216 kB, so at most some tens of MB).
GRAPH_PLANS: collections.OrderedDict = collections.OrderedDict()
PLANS_KEPT = 256
# graph key -> leaf rounds (shared by the exact plan and the moves)
GRAPH_LEAVES: collections.OrderedDict = collections.OrderedDict()
LEAVES_KEPT = 16
# (graph key, mode) -> the exact or mini-bucket elimination plan (None: too wide for the
# cap). The settling rounds of one choice alternate between a few graphs (the reductions
# differ as tables settle): 16 covers the two solves of a choice many times over.
ELIMINATION_PLANS: collections.OrderedDict = collections.OrderedDict()
ELIMINATIONS_KEPT = 16
_LOCK = threading.Lock()  # sj.jit may plan in several threads


def graph_key(model: Model, cap: float) -> bytes:
    """What a plan of ``model`` depends on: the domain sizes, the pairs and the cap."""
    h = hashlib.sha256()
    for a in (model.k, model.pu, model.pv):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(repr(float(cap)).encode())
    return h.digest()


def kept(cache: collections.OrderedDict, key, make, most: int):
    """``cache[key]``, made by ``make()`` when missing; the oldest dropped past ``most``."""
    with _LOCK:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    made = make()  # outside the lock: a plan may take seconds; two threads may both build it
    with _LOCK:
        cache[key] = made
        if len(cache) > most:
            cache.popitem(last=False)
    return made


def leaves(model: Model) -> tuple:
    """``_eliminate.leaf_rounds(model, 16)``, kept by the graph's shape (the cap plays no
    part in them)."""
    return kept(GRAPH_LEAVES, graph_key(model, 0), lambda: _eliminate.leaf_rounds(model, 16), LEAVES_KEPT)


def elimination_plan(model: Model, cap: float, mode: str) -> _eliminate.Plan | None:
    """``_plan.plan(model, cap, mode)`` for ``mode`` "exact", "fill" or "minibucket" (None:
    too wide for ``cap``), kept by the graph's shape."""
    return kept(
        ELIMINATION_PLANS,
        (graph_key(model, cap), mode),
        lambda: _plan.plan(model, cap, mode, leaves=leaves(model)),
        ELIMINATIONS_KEPT,
    )


def clear() -> None:
    """Forget every kept plan (tests that compare a fresh solve with a kept one)."""
    with _LOCK:
        GRAPH_PLANS.clear()
        GRAPH_LEAVES.clear()
        ELIMINATION_PLANS.clear()
