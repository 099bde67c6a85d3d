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
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.backend import solve_settled
from sbpjax.compiler.choice import Choice
from sbpjax.compiler.classes import layer_classes, loop_classes
from sbpjax.compiler.formulate import formulate, least_usage
from sbpjax.compiler.liveness import held_bytes, live_bytes
from sbpjax.compiler.options import DEFAULT_OPTIONS, CompileOptions
from sbpjax.compiler.plan_records import entry_of, restore
from sbpjax.compiler.pricing import price
from sbpjax.compiler.propagate import propagate
from sbpjax.compiler.propagation import Propagation, idle_axes
from sbpjax.sbp import Broadcast

SOLVERS = ("ilp", "greedy")


def total_bytes(prop: Propagation) -> int:
    return prop.bytes


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
            auto = any(nd is AUTO for nd in call.in_sbp)
            raise _over_budget(call.memory_budget, least_usage(form), solved.status, auto)
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
        kept = second_looks.greedy_dominates(kept, greedy, g_memory)
    if call.memory_budget is None:
        return second_looks.as_given(kept, call.in_sbp, call.by_hand, call.price)
    budget = call.memory_budget

    def fits(plan):
        return held_bytes(program, plan, call.pairs, grid) <= budget

    given = second_looks.as_given(kept, call.in_sbp, call.by_hand, call.price, fits)
    if given is not kept and given.choice is not None:
        given.choice.memory_budget = budget
        given.choice.memory_bytes = held_bytes(program, given, call.pairs, grid)
    return held_to_hand(given, True)


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


def _over_budget(budget, least: int, status: str, auto: bool) -> SBPError:
    """The error for a budget no layout meets; ``auto``: some argument's
    layout is ``AUTO`` (without one, only the results' layouts are free, and
    the fix is in the written ``in_sbp``)."""
    fix = "or use a placement with more devices"
    if not auto:
        fix = (
            "split the arguments further in in_sbp, or give the ones the solver may lay out as sj.AUTO "
            "(every argument's layout is written here: the budget can only choose the results')"
        )
    return SBPError(
        f"sj.jit: no layout fits memory_budget={budget} B per device: the least any layout holds is "
        f"{least} B per device (arguments and results, a donated argument and its result in one layout once; the "
        f"solver: {status}). Raise the budget to at least {least} B, {fix}."
    )


__all__ = ["choose", "Choice", "SOLVERS", "total_bytes", "held_bytes"]
