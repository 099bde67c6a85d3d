"""Plans solved on the way to a budgeted plan, kept for the process.

Under ``memory_budget`` the choice (:mod:`sbpjax.compiler.choose`) solves
plans that do not depend on the budget: the plan without it (optimizer state
in its parameter's layout), and the plan of each hand-written layout it is
held to (:mod:`sbpjax.compiler.hand_layouts`). Each is a whole solve. A user
who tries several budgets on one step (as a notebook does, and as the
compiler benchmark's budget section does) would solve them again for every
budget.

They are kept here as plan cache entries (:class:`plan_cache.Entry`: data,
re-derived into a plan by ``plan_records.restore`` as an entry read from disk is),
under the key the plan cache gives a plan (``plan_cache.plan_key``). The
solve is a pure function of that key (deterministic effort, no clock), so a
kept entry is the plan a solve would make, and a plan does not depend on
which budgets were tried before it.

Decision: in the process only, the newest ``KEPT`` entries. The on-disk plan
cache keeps the budgeted plan a call asks for; these are its parts, and the
choice sits below the layer that knows the cache's directory
(:mod:`sbpjax.compiler.planning`). ``KEPT``: a budget's choice solves three
of them (the plan without the budget, ZeRO-1/2's, ZeRO-3/FSDP's), so 16 hold
the parts of five programs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from sbpjax.compiler import plan_cache
from sbpjax.compiler.propagation import Propagation

KEPT = 16
_ENTRIES: OrderedDict[str, plan_cache.Entry] = OrderedDict()


def recall(
    key: str,
    solve: Callable[[], Propagation],
    restore: Callable[[plan_cache.Entry], Propagation | None],
    entry_of: Callable[[Propagation], plan_cache.Entry],
) -> Propagation:
    """The plan kept under ``key`` (``restore``d: a new Propagation each
    time, which callers may change), else ``solve()``'s, kept."""
    entry = _ENTRIES.get(key)
    if entry is not None:
        _ENTRIES.move_to_end(key)
        prop = restore(entry)
        if prop is not None:
            if prop.choice is not None:
                prop.choice.source = "solved"  # in this process, for another budget
            return prop
    prop = solve()
    if prop.choice is not None:  # a solved plan (greedy's plans carry a Choice too)
        _ENTRIES[key] = entry_of(prop)
        while len(_ENTRIES) > KEPT:
            _ENTRIES.popitem(last=False)
    return prop


def clear() -> None:
    """Forget every kept plan (benchmarks timing a cold choice)."""
    _ENTRIES.clear()


__all__ = ["KEPT", "clear", "recall"]
