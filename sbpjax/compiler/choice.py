"""How a plan's layouts were chosen (``Choice``), as ``explain()`` reports it and a plan cache entry records it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Choice:
    """How the layouts were chosen, for ``explain()``.

    ``method``: "ilp" (the whole-program solve) or "greedy"; ``reason``: why
    greedy was kept; ``objective``: the kept plan's cost in the solver's own
    count, in bytes (bytes moved, plus collectives' latency and the price of
    zero-filled splits: ``pricing.price``); ``bound``: the solver's proven
    lower bound; ``gap``: (objective - bound) / objective; ``ops``,
    ``groups`` (decisions the ops make), ``variables`` (nodes of the
    problem: groups, AUTO arguments, values with several readers) and
    ``constraints`` (its edges); ``solve_s`` / ``build_s``: seconds in the
    solver and building the problem; ``greedy_bytes`` / ``ilp_bytes``: what
    each choice moves; ``source``: where this process got the plan ("solved"
    here, "plan cache" (``sbpjax.compiler.plan_cache``) or "process 0", which
    planned it for every process)."""

    method: str
    reason: str = ""
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    solve_s: float = 0.0
    build_s: float = 0.0
    greedy_bytes: int | None = None
    ilp_bytes: int | None = None
    # the greedy plan's estimated per-device peak (liveness.live_bytes): the
    # memory regather="auto" holds the chosen plan to (sbpjax.compiler.regather)
    greedy_peak: int | None = None
    ops: int = 0
    groups: int = 0
    variables: int = 0
    constraints: int = 0
    status: str = ""
    shared: bool = False  # alike layers shared their decisions (CompileOptions.tie_layers)
    # per-device bytes of arguments and results (a donated pair once), and the budget
    memory_bytes: int | None = None
    memory_budget: int | None = None
    auto: bool = False
    # solved with layouts given for the AUTO arguments (the chosen ones or ones
    # written by hand: second_looks.as_given, by_hand_as_given): its boxings
    # are derived with the axes those layouts leave idle
    as_given: bool = False
    # the plan solved with ring latency replaced the bytes-first one (fewer_collectives), or ""
    latency_note: str = ""
    source: str = "solved"
    # solves until every boxing cost the plan uses was planned exactly, and
    # the costs planned out of all the tables' entries (sbpjax.compiler.tables)
    rounds: int = 0
    planned: int = 0
    entries: int = 0
    # under a memory budget: [name, bytes moved, bytes held per device] of each
    # hand-written layout the plan was held to (sbpjax.compiler.hand_layouts)
    candidates: list = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if self.method == "greedy" and self.ilp_bytes is None and not self.reason:
            return "layouts: greedy pass (solver='greedy')"
        gap = "n/a" if self.gap is None else f"{100 * self.gap:.2f}%"
        size = (
            f"{self.ops} ops in {self.groups} decisions; {self.variables} nodes, {self.constraints} edges"
            + (", alike layers sharing decisions" if self.shared else "")
        )
        if self.method == "ilp":
            text = (
                f"layouts: whole-program choice ({size}): objective {self.objective:.0f} B, proven gap {gap}, "
                f"solve {self.solve_s:.2f} s in {self.rounds} rounds (+{self.build_s:.2f} s building, "
                f"{self.planned} of {self.entries} boxing costs planned); greedy would move {self.greedy_bytes} B"
            )
            if self.as_given:
                text += f"; {self.reason}"
        elif self.method == "hand":
            text = f"layouts: {self.reason} ({size}; proven gap {gap})"
        else:
            text = f"layouts: greedy pass kept ({self.reason}); greedy {self.greedy_bytes} B"
        if self.latency_note:
            text += f"; {self.latency_note}"
        if self.auto:
            text += "; AUTO arguments chosen too (greedy starts them B)"
        if self.memory_bytes is not None and (self.auto or self.memory_budget is not None):
            budget = "" if self.memory_budget is None else f" of a {self.memory_budget} B budget"
            text += f"; arguments + results hold {self.memory_bytes} B per device{budget}"
        if self.candidates:
            text += "; by hand: " + ", ".join(
                f"{name} would move {moved} B holding {held} B"
                + ("" if self.memory_budget is None or held <= self.memory_budget else " (over the budget)")
                for name, moved, held in self.candidates
            )
        if self.source != "solved":
            text += f"; from {'the plan cache' if self.source == 'plan cache' else 'process 0'}"
        return text


_JSON_KINDS = {"str": (str,), "float": (int, float), "int": (int,), "bool": (bool,), "None": (type(None),)}


def choice_of_record(record: dict) -> Choice | None:
    """The Choice a plan cache entry records, or None where a field has
    another type than Choice's (an edited or foreign file: ``explain()``
    formats these fields). Fields it does not know are dropped."""
    if not isinstance(record.get("method"), str):
        return None
    kept: dict = {}
    for f in dataclasses.fields(Choice):
        if f.name not in record:
            continue
        v = record[f.name]
        if f.name == "candidates":
            ok = isinstance(v, list) and all(
                isinstance(c, list)
                and len(c) == 3
                and isinstance(c[0], str)
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in c[1:])
                for c in v
            )
        else:
            kinds = tuple(t for name in str(f.type).split("|") for t in _JSON_KINDS[name.strip()])
            ok = isinstance(v, kinds) and (bool in kinds or not isinstance(v, bool))
        if not ok:
            return None
        kept[f.name] = v
    return Choice(**kept)
