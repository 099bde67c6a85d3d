"""Whole-program layout choice: the greedy pass, then the exact solve of the pairwise form.

The greedy pass (:mod:`sbpjax.compiler.propagate`) picks each op's
signature from its inputs' layouts as it walks the program; what is cheap at
one op can be expensive later (a kernel gathered at a forward matmul, an Adam
moment reduce-scattered twice). Here the choice is made for the program as a
whole, as in Alpa's intra-operator ILP: :mod:`sbpjax.compiler.formulate`
writes it as a pairwise problem (ops, arguments and shared values as nodes,
boxing costs on the edges) and the solver minimizes it within a work limit
(``CompileOptions.effort``), never a wall clock: the same program, placement,
layouts, cost model and options give the same plan on every machine. The
plan is compared with greedy's by ``pricing.price`` and the cheaper kept.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import CostModel
from sbpjax.compiler import hand_layouts, plan_cache, second_looks, sub_plans
from sbpjax.compiler.auto import AUTO, auto_layouts
from sbpjax.compiler.backend import solve_settled
from sbpjax.compiler.classes import layer_classes, loop_classes
from sbpjax.compiler.decode import propagation_of, value_keys
from sbpjax.compiler.formulate import formulate, least_usage
from sbpjax.compiler.liveness import held_bytes, live_bytes
from sbpjax.compiler.options import DEFAULT_OPTIONS, CompileOptions
from sbpjax.compiler.pricing import boxing_cost, price
from sbpjax.compiler.propagate import propagate
from sbpjax.compiler.propagation import Propagation, idle_axes, op_key
from sbpjax.compiler.propagator import Propagator
from sbpjax.compiler.signatures import allowed
from sbpjax.sbp import Broadcast

SOLVERS = ("ilp", "greedy")


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


def total_bytes(prop: Propagation) -> int:
    return prop.bytes


def restore(program, placement, in_sbp, out_sbp, ties, entry, cost_model=None, options=DEFAULT_OPTIONS):
    """The plan of a plan cache entry (``plan_cache.Entry``), or None where
    it is not a plan of this call: its layouts must be the ones asked for
    (an ``AUTO`` argument's one it may take) and each op's signature one its
    rule allows (``signatures.allowed``). The boxings are derived again, as for
    a solved plan (:mod:`sbpjax.compiler.decode`)."""
    grid = placement.shape
    pr = Propagator(program, placement, cost_model, launch_priced=options.launch_priced)
    if len(entry.in_sbp) != len(in_sbp) or len(entry.out_sbp) != len(program.outputs):
        return None
    pr.idle = idle_axes(entry.in_sbp if entry.choice.get("as_given") is True else in_sbp, grid)
    pr.ring = entry.ring
    pr.quiet = True
    for v, want, got in zip(program.inputs, in_sbp, entry.in_sbp):
        if got not in (auto_layouts(v.shape, grid) if want is AUTO else [want]):
            return None
    final = list(out_sbp) if out_sbp is not None else [None] * len(program.outputs)
    for k, i in (ties or {}).items():
        final[k] = entry.in_sbp[i]
    for k, want in enumerate(final):
        if want is not None and entry.out_sbp[k] != want:
            return None
    # alike ops (a written-out scan's layers) with alike signatures are checked once
    checked: dict = {}
    for node, (ins, outs) in zip(program.nodes, entry.signatures):
        key = (op_key(node), tuple(ins), tuple(outs))
        ok = checked.get(key)
        if ok is None:
            ok = checked[key] = allowed(pr, node, ins, outs)
        if not ok:
            return None
    keys = set(value_keys(program).values())
    for key, nd in entry.first.items():
        if key not in keys or len(nd) != len(grid):
            return None
    cm = cost_model if cost_model is not None else CostModel()

    def cost(plan):
        return boxing_cost(plan, cm, options, ring=entry.ring)

    prop = propagation_of(
        program, placement, pr, list(entry.in_sbp), final, entry.signatures, entry.first, cost
    )
    prop.ring = entry.ring
    if any(want is None and got != have for want, got, have in zip(final, entry.out_sbp, prop.out_sbp)):
        return None
    prop.choice = choice_of_record(entry.choice)
    if prop.choice is None:
        return None
    prop.choice.source = "plan cache"
    prop.options = options
    return prop


def entry_of(prop: Propagation):
    """The plan cache entry of a plan (``plan_cache.Entry``)."""
    choice = {} if prop.choice is None else dataclasses.asdict(prop.choice)
    choice["source"] = "solved"
    return plan_cache.Entry(
        list(prop.in_sbp),
        [(list(d.in_sbp), list(d.out_sbp)) for d in prop.decisions],
        list(prop.out_sbp),
        choice,
        dict(prop.first_versions),
        prop.ring,
    )


def choose(
    program,
    placement,
    in_sbp,
    out_sbp,
    cost_model=None,
    solver: str = "ilp",
    ties=None,
    memory_budget=None,
    same_layout=None,
    arg_names=None,
    options: CompileOptions = DEFAULT_OPTIONS,
    aliases=None,
) -> Propagation:
    """The layouts of every value: the greedy pass, then (``solver="ilp"``)
    the whole-program solve, keeping whichever is cheaper by ``price`` (the
    Choice attached to the result says which, and why).

    ``in_sbp`` entries may be ``AUTO``: the argument's layout is chosen too.
    ``ties`` maps an output index to the index of an ``AUTO`` argument whose
    layout it must have (a donated train-step state: the step is a fixed
    point). ``memory_budget``: per-device bytes that arguments and results
    together may hold (a tied pair counted once). ``same_layout`` maps an
    ``AUTO`` argument's index to an earlier ``AUTO`` argument's whose layout
    it takes (optimizer state mirroring a parameter). ``arg_names``: the
    arguments' paths, by which alike layers are found
    (``CompileOptions.tie_layers``). ``aliases`` maps an output index to the
    index of a donated argument not tied to it: the budget counts the pair
    once where the two take one layout (nothing ties them)."""
    call = _Call(
        program,
        placement,
        in_sbp,
        out_sbp,
        cost_model,
        solver,
        dict(ties or {}),
        memory_budget,
        dict(same_layout or {}),
        arg_names,
        options,
        dict(aliases or {}),
    )
    prop = _choose(call)
    if memory_budget is None:  # the call's own plan only: a budget's sub-plans never hold data parallelism
        prop = second_looks.by_hand_as_given(
            prop, program, call.in_sbp, call.same_layout, placement.shape, call.by_hand, call.price
        )
    prop.options = options
    return prop


@dataclasses.dataclass(frozen=True)
class _Call:
    """One layout choice's arguments (``choose``'s), ``ties`` and
    ``same_layout`` as dicts."""

    program: Any  # a Program
    placement: Any  # a Placement
    in_sbp: Sequence
    out_sbp: Sequence | None
    cost_model: CostModel | None
    solver: str
    ties: dict
    memory_budget: int | None
    same_layout: dict
    arg_names: Sequence | None
    options: CompileOptions
    aliases: dict

    @property
    def pairs(self) -> dict:
        """{result: donated argument} whose buffer the result may share (``held_bytes``)."""
        return {**self.ties, **self.aliases}

    def by_hand(self, ins) -> Propagation:
        """The plan of layouts ``ins`` written by hand, as sj.jit given them makes it."""
        return _unbudgeted(self, ins, {})

    def price(self, plan: Propagation) -> float:
        return price(plan, self.cost_model, self.options)


def _choose(call: _Call) -> Propagation:
    _check_solver(call)
    program, grid = call.program, call.placement.shape
    # under a budget the mirror pairs only say which arguments are optimizer
    # state (for the hand-written candidates): the state is chosen on its own,
    # so that it can be split where the parameters stay whole
    mirrors = call.same_layout
    if call.memory_budget is not None:
        call = dataclasses.replace(call, same_layout={})
    caches: tuple[dict, ...] = ({}, {}, {}, {}, {}, {})
    rep = (Broadcast(),) * len(grid)
    greedy = _greedy(call, [rep if nd is AUTO else nd for nd in call.in_sbp], caches)
    g_bytes = total_bytes(greedy)
    if call.solver == "greedy":
        greedy.choice = Choice("greedy", greedy_bytes=g_bytes, ops=len(program.nodes))
        return greedy

    def held_to_hand(plan, fits):  # under a budget: no worse than the hand-written layouts
        return hand_layouts.no_worse_than_by_hand(
            program, plan, fits, call.in_sbp, mirrors, call.pairs, call.memory_budget, call.by_hand
        )

    if call.memory_budget is not None and mirrors:
        # a budget the plan chosen without it meets changes nothing: that plan
        # (optimizer state in its parameter's layout, a third of the choices)
        # is solved first, and the budget's larger problem only where it does
        # not fit. Decision: on the compiler benchmark's budget GPT (d_model
        # 128, 2 layers, 2x4, AdamW) the budget's own problem took 115 s to
        # plan, the smaller one 63 s, for the same plan.
        free = hand_layouts.own(_unbudgeted(call, call.in_sbp, mirrors))
        held = held_bytes(program, free, call.pairs, grid)
        if held <= call.memory_budget:
            free.choice.memory_budget, free.choice.memory_bytes = call.memory_budget, held
            return held_to_hand(free, True)
    g_memory = held_bytes(program, greedy, call.pairs, grid)
    g_fits = call.memory_budget is None or g_memory <= call.memory_budget
    form, solved, choice = _solve(call, greedy, caches, g_bytes)
    if solved.strategies is None:
        choice.method, choice.reason = "greedy", f"the solver found no plan ({solved.status})"
        choice.memory_bytes = g_memory
        greedy.choice = choice
        if call.memory_budget is None:
            return greedy
        kept = held_to_hand(greedy, g_fits)
        if kept is None:
            raise _over_budget(call.memory_budget, least_usage(form), solved.status)
        return kept
    kept = _cheaper(call, greedy, form.plan(solved.strategies), solved, choice, g_fits, g_memory)
    left = call.options.effort - solved.work
    kept, work = second_looks.bytes_alone(
        program,
        kept,
        form,
        in_sbp=call.in_sbp,
        cost_model=call.cost_model,
        options=call.options,
        caches=caches,
        pairs=call.pairs,
        memory_budget=call.memory_budget,
        greedy_bytes=g_bytes,
        greedy_fits=g_fits,
        effort=left,
    )
    left -= work
    kept = second_looks.fewer_collectives(
        program,
        kept,
        form,
        call.in_sbp,
        call.cost_model,
        call.options,
        caches,
        call.pairs,
        call.memory_budget,
        left,
    )
    if g_fits:
        kept = second_looks.held_to_greedys_peak(kept, greedy, g_memory)
    if call.memory_budget is None:
        return second_looks.as_given(kept, call.in_sbp, grid, call.by_hand, call.price)
    return held_to_hand(kept, True)


def _check_solver(call: _Call) -> None:
    if call.solver not in SOLVERS:
        raise SBPError(
            f"sj.jit: solver={call.solver!r} is not one of {SOLVERS}; use 'ilp' (whole-program "
            "choice, the default) or 'greedy' (a fast op-by-op pass for prototyping)."
        )
    auto = any(nd is AUTO for nd in call.in_sbp)
    if call.solver == "greedy" and (auto or call.memory_budget is not None):
        raise SBPError(
            "sj.jit: AUTO layouts and memory_budget are chosen by the whole-program solver, not "
            "the greedy pass; use solver='ilp' (the default), or annotate every argument."
        )


def _greedy(call: _Call, ins, caches) -> Propagation:
    """The greedy pass's plan from input layouts ``ins``."""
    outs = list(call.out_sbp) if call.out_sbp is not None else [None] * len(call.program.outputs)
    for k, i in call.ties.items():
        outs[k] = ins[i]
    return propagate(
        call.program,
        call.placement,
        ins,
        outs if (call.out_sbp is not None or call.ties) else None,
        call.cost_model,
        caches=caches,
        # the caller's arguments' (AUTO ones laid out here would idle axes)
        idle=idle_axes(call.in_sbp, call.placement.shape),
        launch_priced=call.options.launch_priced,
    )


def _unbudgeted(call: _Call, ins, same) -> Propagation:
    """The plan without a budget from input layouts ``ins`` (kept across
    budgets: ``sub_plans``)."""
    sub = dataclasses.replace(call, in_sbp=ins, memory_budget=None, same_layout=same)
    key = plan_cache.plan_key(
        sub.program,
        sub.placement,
        sub.in_sbp,
        sub.out_sbp,
        solver=sub.solver,
        cost_model=sub.cost_model,
        options=sub.options,
        ties=sub.ties,
        same_layout=same,
        memory_budget=None,
        arg_names=sub.arg_names,
        aliases=sub.aliases,
    )
    return sub_plans.recall(
        key,
        lambda: _choose(sub),
        lambda entry: restore(
            sub.program, sub.placement, sub.in_sbp, sub.out_sbp, sub.ties, entry, sub.cost_model, sub.options
        ),
        entry_of,
    )


def _solve(call: _Call, greedy: Propagation, caches, g_bytes: int):
    """The whole-program problem, its solution, and the Choice that records both."""
    program = call.program
    classes = _classes(program, call.arg_names, call.options)
    t0 = time.perf_counter()
    form = formulate(
        program,
        call.placement,
        call.in_sbp,
        call.out_sbp,
        greedy,
        call.cost_model,
        call.options,
        caches=caches,
        ties=call.ties,
        same_layout=call.same_layout,
        classes=classes,
        aliases=call.aliases,
    )
    t1 = time.perf_counter()
    solved = solve_settled(
        form, call.options.effort, start=form.start(greedy), usage_limit=call.memory_budget
    )
    choice = Choice(
        "ilp",
        build_s=t1 - t0,
        solve_s=time.perf_counter() - t1,
        status=solved.status,
        ops=len(program.nodes),
        groups=form.groups,
        variables=len(form.costs),
        constraints=len(form.edges),
        shared=call.options.tie_layers,
        greedy_bytes=g_bytes,
        greedy_peak=int(live_bytes(greedy).max()),
        auto=any(nd is AUTO for nd in call.in_sbp),
        memory_budget=call.memory_budget,
        rounds=solved.rounds,
        planned=form.tables.planned,
        entries=form.tables.entries,
    )
    return form, solved, choice


def _cheaper(call: _Call, greedy, chosen, solved, choice: Choice, g_fits: bool, g_memory: int) -> Propagation:
    """The solved plan, or greedy's where it is no cheaper by ``price``."""
    choice.objective = solved.cost / 64
    if solved.bound is not None:
        choice.bound = solved.bound / 64
        choice.gap = max(0.0, (solved.cost - solved.bound) / solved.cost) if solved.cost else 0.0
    choice.ilp_bytes = total_bytes(chosen)
    g_price = price(greedy, call.cost_model, call.options)
    chosen_price = price(chosen, call.cost_model, call.options)
    # On an equal price greedy's choice is kept: its tie-breaks (alpha-beta
    # time, fewer boxings, no splits made from nothing) are finer than the
    # solver's objective. Except where scans were written out: the solve gives
    # their iterations the same layouts (loop_classes), so the lowering can
    # keep the loop (sbpjax.compiler.loops); greedy's iterations may each differ.
    if g_fits and (chosen_price > g_price or (chosen_price == g_price and not call.program.loops)):
        choice.method = "greedy"
        choice.reason = (
            f"the whole-program plan moves {choice.ilp_bytes} B (objective {chosen_price:.0f} B), "
            f"greedy's {greedy.bytes} B (objective {g_price:.0f} B)"
        )
        choice.memory_bytes = g_memory
        greedy.choice = choice
        return greedy
    choice.memory_bytes = held_bytes(call.program, chosen, call.pairs, call.placement.shape)
    chosen.warnings = greedy.warnings
    chosen.choice = choice
    return chosen


def _classes(program, arg_names, options: CompileOptions) -> list | None:
    """Per op the key of the ops it decides alike with, or None: the
    iterations of a written-out scan always (``loop_classes``), alike layers
    where ``options.tie_layers`` asks."""
    in_loops = loop_classes(program)
    layers = layer_classes(program, arg_names) if options.tie_layers and arg_names is not None else None
    if layers is None and all(c is None for c in in_loops):
        return None
    return [
        lc if lc is not None else (None if layers is None else ("layer", layers[i]))
        for i, lc in enumerate(in_loops)
    ]


def _over_budget(budget, least: int, status: str) -> SBPError:
    return SBPError(
        f"sj.jit: no layout fits memory_budget={budget} B per device: the least any layout holds is "
        f"{least} B per device (arguments and results, a donated argument and its result in one layout once; the "
        f"solver: {status}). Raise the budget to at least {least} B, or use a placement with more devices."
    )


__all__ = ["choose", "restore", "entry_of", "Choice", "SOLVERS", "total_bytes", "held_bytes"]
