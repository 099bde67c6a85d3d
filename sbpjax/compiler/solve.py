"""Whole-program layout choice: an integer program over every op's signature.

The greedy pass (:mod:`sbpjax.compiler.propagate`) picks each op's signature
from its inputs' layouts as it walks the program; what is cheap at one op can
be expensive later (a kernel gathered at a forward matmul, an Adam moment
reduce-scattered twice). Here the choice is made for the program as a whole,
as in Alpa's intra-operator ILP:

* one binary ``s[n, k]`` per op ``n`` and candidate nd-signature ``k``
  (exactly one per op); a value's layout is the one its producer's chosen
  signature gives it (program inputs: ``in_sbp``, fixed);
* one binary ``w[v, L]`` per value ``v`` and layout ``L`` some consumer may
  need ("``v`` exists in layout ``L``"): ``w[v, L] >= sum of s[c, k]`` over
  the signatures ``k`` of consumer ``c`` that take ``v`` as ``L``. A value is
  boxed once per layout and every consumer wanting that layout shares it, so
  a partial with several consumers is reduced once (exactly what the lowering
  runs: each version is boxed from the producer's layout);
* the version's cost is ``plan_boxing(S -> L).bytes`` (the planner the
  lowering runs) for the producer layout ``S``: columns ``u[v, L, S]`` with
  ``sum_S u = w[v, L]`` and ``u[v, L, S] <= x[v, S]`` (``x[v, S]``: the sum
  of the producer's signatures giving ``S``) carry it. This is the edge
  linearization of Alpa's ILP with one marginal relaxed to an inequality;
  the textbook ``y >= x + w - 1`` has an LP relaxation that is free at every
  fractional point (HiGHS proved a bound of 8 B on a 19 MB program with it).
  Where either side is fixed the product is linear and no column is made.

Minimize the bytes moved. Partial semantics need no special case: an op that
cannot take a partial has no candidate that takes one, so the reduction's
bytes appear on that edge; a partial kept through linear ops costs nothing
until some consumer needs it reduced, where it costs its reduction once.

Shrinking: ops with one candidate (constraints, unknown primitives) and
values with one possible layout make no variables; candidates that cannot
run on the pieces (uneven splits that move, see ``sbpjax.compiler.uneven``)
are dropped; elementwise ops take their same-shape
operands in their output's layout (halves the program on a GPT step and
removes near-ties: gpt_hybrid at d_model 128 on 2x4 solves to a 0.02% gap in
7 s instead of a 13% gap in 30 s); producer layouts that box to a needed layout
for the same bytes share one column; and each value's layouts are limited to
those flowing forward from the annotations (see ``_Domains``), which always
include the greedy choice.

Solved with ``scipy.optimize.milp`` (HiGHS). The caller compares the result
with the greedy choice and keeps the cheaper one, so a time-out never makes
a program worse.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.propagate import CONSTRAIN, Boxing, Decision, Propagation, Propagator, op_comm
from sbpjax.compiler.trace import Const, Var
from sbpjax.rules import RULES
from sbpjax.rules.elementwise import ELEMENTWISE
from sbpjax.sbp import Broadcast, Partial, Split

# Beyond this many binaries the solve would not finish in interactive time on
# a laptop; the greedy choice is kept (and explain() says why).
MAX_VARIABLES = 400_000


@dataclasses.dataclass
class Choice:
    """How the layouts were chosen, for ``explain()``.

    ``method``: "ilp" or "greedy"; ``reason``: why greedy was kept when the
    ILP was asked for; ``objective``: the solution's bytes (the ILP's own
    count); ``bound``: HiGHS's proven lower bound; ``gap``: (objective - bound)
    / objective; ``solve_s``: seconds in the solver (building included);
    ``greedy_bytes`` / ``ilp_bytes``: what each choice moves."""

    method: str
    reason: str = ""
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    solve_s: float = 0.0
    build_s: float = 0.0
    greedy_bytes: int | None = None
    ilp_bytes: int | None = None
    variables: int = 0
    constraints: int = 0
    status: str = ""

    def describe(self) -> str:
        if self.method == "greedy" and self.ilp_bytes is None and not self.reason:
            return "layouts: greedy pass (solver='greedy')"
        if self.method == "ilp":
            gap = "n/a" if self.gap is None else f"{100 * self.gap:.2f}%"
            return (
                f"layouts: whole-program ILP (HiGHS, {self.variables} variables, {self.constraints} "
                f"constraints): objective {self.objective:.0f} B, proven gap {gap}, solve "
                f"{self.solve_s:.2f} s (+{self.build_s:.2f} s building); greedy would move "
                f"{self.greedy_bytes} B"
            )
        return f"layouts: greedy pass kept ({self.reason}); greedy {self.greedy_bytes} B"


def _cost(plan) -> float:
    """A boxing's cost in the objective: its bytes, plus one per step that
    moves data, so that of two boxings moving the same bytes the one with
    fewer collectives wins (an all-reduce rather than a reduce-scatter and
    an all-gather): the alpha term of the time model, in byte units small
    enough never to outweigh a byte."""
    moving = sum(1 for st in plan.steps if st.bytes > 0)
    # integral (in 1/64 bytes) so that HiGHS can round its bounds up
    return 64 * plan.bytes + moving if plan.bytes else 0.0


class _Lin:
    """A linear expression over the ILP's columns: {column: coefficient} + constant."""

    __slots__ = ("terms", "const")

    def __init__(self, terms=None, const=0.0):
        self.terms = terms or {}
        self.const = const


def _candidates(pr: Propagator, node, grid):
    """The op's nd-signatures as (ins, outs) lists; one fixed candidate for
    constraints and ops without a rule (run whole, as the greedy pass does)."""
    rep = (Broadcast(),) * len(grid)
    if node.name == CONSTRAIN:
        want = node.eqn.params["sbp"]
        return [([want], [want])]
    rule = RULES.get(node.name)
    sigs = pr.candidates(node) if rule is not None else []
    if not sigs:
        return [([rep] * len(node.ins), [rep] * len(node.outs))]
    per_axis = []
    for p in grid:
        if p == 1:
            per_axis.append([None])
        else:
            per_axis.append(sigs)
    out, seen = [], set()
    for combo in itertools.product(*per_axis):
        ins = [tuple(Broadcast() if s is None else s.ins[j] for s in combo) for j in range(len(node.ins))]
        outs = [tuple(Broadcast() if s is None else s.outs[j] for s in combo) for j in range(len(node.outs))]
        if not pr._fits(node, ins, outs):
            continue
        if not all(pr._partial_ok(nd) for nd in ins + outs):
            continue
        if op_comm(node, ins, outs, grid, pr._comms) is None:
            continue
        key = (tuple(ins), tuple(outs))
        if key in seen:
            continue
        seen.add(key)
        out.append((ins, outs))
    if not out:
        return [([rep] * len(node.ins), [rep] * len(node.outs))]
    return out


_HEAVY = ("dot_general", "conv_general_dilated")


class _Domains:
    """Which layouts each value may take, to keep the integer program small.

    A value's producer layouts are those its producer's kept candidates give;
    a consumer's candidates are kept when each input is used in a layout the
    value can be in without an invented conversion: a producer layout, one of
    its partials reduced (to B or to a split of any dim, the layouts a
    reduction makes), or the layout the greedy pass used. The greedy choice is
    kept (except a contraction computed whole on an axis, below), so the
    program's optimum is at most greedy's bytes; layouts
    flow forward from the annotations as they do in GSPMD's propagation, so a
    choice that keeps a parameter's split through its matmuls is in the space
    even where greedy gathered it. Contractions computed whole on an axis are
    left out where another candidate exists (see ``restrict``)."""

    def __init__(self, program, placement, in_sbp, greedy):
        self.grid = placement.shape
        self.dom: dict = {id(v): {nd} for v, nd in zip(program.inputs, in_sbp)}
        self.greedy = greedy.decisions

    def _uses(self, atom) -> set:
        # An S or P over an axis of size 1 is B (a user's (B, S(1)) on an 8x1
        # placement): the normalized form too. Gathering a split value to B is
        # not offered (only greedy's own gathers are): bytes alone would then
        # gather a small batch and run the whole step replicated on every
        # device (Alpa likewise enumerates only strategies that use every
        # device).
        base = self.dom.get(id(atom), set())
        base = base | {tuple(Broadcast() if p == 1 else q for p, q in zip(self.grid, nd)) for nd in base}
        out = set(base)
        for nd in base:
            for a, q in enumerate(nd):
                if isinstance(q, Partial):
                    out.add(nd[:a] + (Broadcast(),) + nd[a + 1 :])
                    out.update(nd[:a] + (Split(d),) + nd[a + 1 :] for d in range(len(atom.shape)))
        return out

    def restrict(self, index, node, cs):
        dec = self.greedy[index]
        keep_g = (list(dec.in_sbp), list(dec.out_sbp))
        if len(cs) > 1:
            uses = [self._uses(a) if isinstance(a, Var) else None for a in node.ins]
            if node.name in _HEAVY or node.name == "add_any":
                # A contraction or a sum of gradients may also take an operand in
                # a layout another operand of the same shape has (an activation
                # and its gradient meeting at a kernel gradient, or two gradients
                # of one value, one split along height, the other along the
                # batch): one is boxed to the other's layout, where the producer
                # layouts alone would leave a gather, or zero-filling both into a
                # partial that is reduced later at full size. (All elementwise
                # ops would triple the integer program for little more.)
                for i, a in enumerate(node.ins):
                    for j, b in enumerate(node.ins):
                        if i != j and uses[i] is not None and uses[j] is not None and a.shape == b.shape:
                            uses[i] = uses[i] | self._uses(b)
            kept = [
                c
                for c in cs
                if c == keep_g
                or all(u is None or nd in u or nd == g for u, nd, g in zip(uses, c[0], dec.in_sbp))
            ]
            if node.name in ELEMENTWISE:
                # Elementwise ops take their same-shape operands in the output's
                # layout (no operand zero-filled into a partial the others do not
                # have): the same bytes, since any reduction of the result
                # reduces a tensor of the same size, and far fewer near-equal
                # alternatives for the solver to tell apart.
                shape = node.outs[0].shape
                kept = [
                    c
                    for c in kept
                    if c == keep_g
                    or all(
                        nd == c[1][0]
                        for a, nd in zip(node.ins, c[0])
                        if isinstance(a, Var) and a.shape == shape
                    )
                ]
            if node.name in _HEAVY:
                # Alpa's rule: a contraction uses every device. Computing it whole
                # on every device of an axis moves the fewest bytes when weights
                # are smaller than activations (gather the weights, never reduce)
                # but multiplies its time by the axis size (8x a tensor-parallel
                # step); such candidates stay out unless nothing else is left.
                # The greedy choice may be one (it is then not kept), so the
                # guarantee against greedy is the comparison in choose().
                spread = [
                    c
                    for c in kept
                    if not any(
                        p > 1 and all(isinstance(nd[a], Broadcast) for nd in c[0] + c[1])
                        for a, p in enumerate(self.grid)
                    )
                ]
                kept = spread or kept
            elif keep_g not in kept:
                kept.append(keep_g)
            cs = kept
        for j, o in enumerate(node.outs):
            self.dom[id(o)] = {c[1][j] for c in cs}
        return cs


def solve(
    program,
    placement,
    in_sbp,
    out_sbp,
    greedy: Propagation,
    cost_model=None,
    time_limit: float = 10.0,
    caches=None,
):
    """The byte-minimal layouts of ``program``: (Propagation, Choice), or
    (None, Choice) when no solution was found (the Choice says why)."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_array

    t0 = time.perf_counter()
    grid = placement.shape
    pr = Propagator(program, placement, cost_model)
    pr.quiet = True
    if caches is not None:
        pr._plans, pr._bounds, pr._sigs, pr._choices, pr._evens = caches

    ncols = 0
    cost: list = []

    def new_col(c=0.0) -> int:
        nonlocal ncols
        cost.append(float(c))
        ncols += 1
        return ncols - 1

    rows, cols, vals, lo, hi = [], [], [], [], []
    nrows = 0

    def add_row(terms: dict, low, high):
        nonlocal nrows
        for c, v in terms.items():
            rows.append(nrows)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        nrows += 1

    const_cost = 0.0

    def add_cost(expr: _Lin, c: float):
        nonlocal const_cost
        const_cost += c * expr.const
        for col, v in expr.terms.items():
            cost[col] += c * v

    # -- ops: one binary per candidate ------------------------------------------
    cands: list = []
    sel: list[list[int] | None] = []  # per node: candidates; their columns (None when fixed)
    produced: dict = {}  # id(var) -> {layout: _Lin}
    for v, nd in zip(program.inputs, in_sbp):
        produced[id(v)] = {nd: _Lin(const=1.0)}
    allowed = _Domains(program, placement, in_sbp, greedy)
    for index, node in enumerate(program.nodes):
        cs = allowed.restrict(index, node, _candidates(pr, node, grid))
        cands.append(cs)
        # the op's own communication (a halo exchange) is paid by the candidate
        own = [64 * sum(c.bytes for c in op_comm(node, ins, outs, grid, pr._comms) or ()) for ins, outs in cs]
        if len(cs) == 1:
            sel.append(None)
            const_cost += own[0]
            for o, nd in zip(node.outs, cs[0][1]):
                produced[id(o)] = {nd: _Lin(const=1.0)}
            continue
        columns = [new_col(c) for c in own]
        sel.append(columns)
        add_row({c: 1.0 for c in columns}, 1.0, 1.0)
        for j, o in enumerate(node.outs):
            lay: dict = {}
            for col, (_, outs) in zip(columns, cs):
                lay.setdefault(outs[j], _Lin()).terms[col] = 1.0
            produced[id(o)] = lay

    # -- uses: which layout each consumer needs ----------------------------------
    needs: dict = {}  # id(var) -> (var, {layout: [(columns or None)]})
    for node, cs, node_cols in zip(program.nodes, cands, sel):
        for i, atom in enumerate(node.ins):
            if not isinstance(atom, Var):
                continue
            by_layout: dict = {}
            for k, (ins, _) in enumerate(cs):
                by_layout.setdefault(ins[i], []).append(None if node_cols is None else node_cols[k])
            ent = needs.setdefault(id(atom), (atom, {}))[1]
            for nd, cl in by_layout.items():
                ent.setdefault(nd, []).append(cl)
    for k, atom in enumerate(program.outputs):
        want = out_sbp[k] if out_sbp is not None else None
        if want is not None and isinstance(atom, Var):
            needs.setdefault(id(atom), (atom, {}))[1].setdefault(want, []).append([None])

    # -- versions and boxing costs -----------------------------------------------
    for key, (atom, layouts) in needs.items():
        src = produced[key]
        for nd, uses in layouts.items():
            pay = [(s, _cost(pr.plan(atom, s, nd))) for s in src if s != nd]
            pay = [(s, b) for s, b in pay if b > 0]
            if not pay:
                continue
            # w: the version exists. Fixed to 1 when some consumer needs it whatever it chooses.
            if any(None in cl for cl in uses):
                w = _Lin(const=1.0)
            else:
                wc = new_col()
                w = _Lin({wc: 1.0})
                for cl in uses:
                    # w >= sum of the consumer's columns wanting nd
                    t = {c: -1.0 for c in cl}
                    t[wc] = 1.0
                    add_row(t, 0.0, np.inf)
            if not w.terms:
                # every consumer choice needs it: the producer pays
                for s, b in pay:
                    add_cost(src[s], b)
                continue
            # u[S]: the version is made from producer layout S; sum_S u = w and
            # u[S] <= x[S]. Tighter than y >= x + w - 1 (whose LP relaxation
            # is free at any fractional point): fractional needs must be met by
            # producer mass of matching layouts. Producer layouts costing the
            # same (free ones included) share one column.
            costs = dict(pay)
            groups: dict = {}
            for s in src:
                groups.setdefault(costs.get(s, 0), []).append(s)
            wc = next(iter(w.terms))
            row = {wc: -1.0}
            for b, layouts_ in groups.items():
                u = new_col(b)
                row[u] = 1.0
                xs = [src[q] for q in layouts_]
                t = {u: 1.0}
                fixed = 0.0
                for x in xs:
                    fixed += x.const
                    for c, v in x.terms.items():
                        t[c] = t.get(c, 0.0) - v
                add_row(t, -np.inf, fixed)  # u - x[S] <= const part of x[S]
            add_row(row, 0.0, 0.0)
    build_s = time.perf_counter() - t0
    choice = Choice("ilp", variables=ncols, constraints=nrows, build_s=build_s)
    if ncols > MAX_VARIABLES:
        choice.method, choice.reason = "greedy", f"{ncols} variables > {MAX_VARIABLES}"
        return None, choice

    x_sol = np.zeros(ncols)
    if ncols:
        c = np.asarray(cost)
        integrality = np.ones(ncols)
        A = coo_array((vals, (rows, cols)), shape=(nrows, ncols)).tocsr()
        t1 = time.perf_counter()
        res = milp(
            c,
            integrality=integrality,
            bounds=(0, 1),
            constraints=LinearConstraint(A, np.asarray(lo), np.asarray(hi)),
            options={"time_limit": float(time_limit), "disp": False, "mip_rel_gap": 1e-3},
        )
        choice.solve_s = time.perf_counter() - t1
        choice.status = res.message
        if res.x is None:
            choice.method, choice.reason = "greedy", f"HiGHS found no solution: {res.message}"
            return None, choice
        x_sol = res.x
        choice.objective = (float(res.fun) + const_cost) / 64
        bound = getattr(res, "mip_dual_bound", None)
        if bound is not None and np.isfinite(bound):
            choice.bound = (float(bound) + const_cost) / 64
            choice.gap = (
                max(0.0, (choice.objective - choice.bound) / choice.objective) if choice.objective else 0.0
            )
    else:
        choice.objective = const_cost / 64
        choice.bound, choice.gap = choice.objective, 0.0
    prop = _propagation(program, placement, in_sbp, out_sbp, pr, cands, sel, x_sol)
    return prop, choice


def _propagation(program, placement, in_sbp, out_sbp, pr, cands, sel, x_sol) -> Propagation:
    """The chosen signatures as the Propagation the lowering and explain() read:
    each version of a value boxed once (from its producer's layout or an
    earlier version, whichever is cheaper), at its first consumer."""
    layout: dict = {id(v): nd for v, nd in zip(program.inputs, in_sbp)}
    boxed: dict = {}  # id(atom) -> the layouts boxings made of it, in order
    rep = (Broadcast(),) * len(placement.shape)

    def box(atom, nd, where, index, out):
        src = rep if isinstance(atom, Const) else layout[id(atom)]
        made = boxed.setdefault(id(atom), [])
        if src == nd or nd in made:
            return
        src, plan = pr.cheapest_source(atom, src, nd, made)
        made.append(nd)
        out.append(Boxing(atom, src, nd, plan, where, index))

    decisions = []
    for index, (node, cs, columns) in enumerate(zip(program.nodes, cands, sel)):
        k = 0 if columns is None else int(np.argmax([x_sol[c] for c in columns]))
        ins, outs = cs[k]
        boxings: list = []
        for atom, nd in zip(node.ins, ins):
            box(atom, nd, f"{node.name} at {node.source}", index, boxings)
        for v, nd in zip(node.outs, outs):
            layout[id(v)] = nd
        comm = op_comm(node, ins, outs, placement.shape, pr._comms) or []
        decisions.append(Decision(node, list(ins), list(outs), boxings, comm))
    out_boxings: list = []
    final: list = []
    for k, atom in enumerate(program.outputs):
        want = out_sbp[k] if out_sbp is not None else None
        have = rep if isinstance(atom, Const) else layout[id(atom)]
        if want is None or want == have:
            final.append(have)
            continue
        box(atom, want, f"output {k}", None, out_boxings)
        final.append(want)
    return Propagation(program, placement, list(in_sbp), decisions, out_boxings, final, [])


def total_bytes(prop: Propagation) -> int:
    return prop.bytes


SOLVERS = ("ilp", "greedy")


def choose(
    program,
    placement,
    in_sbp,
    out_sbp,
    cost_model=None,
    solver: str = "ilp",
    time_limit: float = 10.0,
) -> Propagation:
    """The layouts of every value: the greedy pass, then (``solver="ilp"``) the
    integer program, keeping whichever moves fewer bytes (the ILP is never
    worse than greedy: a time-out or a failed solve keeps greedy, and the
    Choice attached to the result says so)."""
    from sbpjax.compiler.propagate import propagate

    if solver not in SOLVERS:
        raise SBPError(
            f"sj.jit: solver={solver!r} is not one of {SOLVERS}; use 'ilp' (whole-program "
            "choice, the default) or 'greedy' (a fast op-by-op pass for prototyping)."
        )
    caches: tuple[dict, ...] = ({}, {}, {}, {}, {})
    greedy = propagate(program, placement, in_sbp, out_sbp, cost_model, caches=caches)
    g_bytes = total_bytes(greedy)
    if solver == "greedy":
        greedy.choice = Choice("greedy", greedy_bytes=g_bytes)
        return greedy
    try:
        ilp, choice = solve(
            program, placement, in_sbp, out_sbp, greedy, cost_model, time_limit, caches=caches
        )
    except ImportError as e:  # scipy is a dependency; a broken install still compiles
        greedy.choice = Choice(
            "greedy", reason=f"scipy.optimize.milp unavailable ({e})", greedy_bytes=g_bytes
        )
        return greedy
    choice.greedy_bytes = g_bytes
    if ilp is None:
        greedy.choice = choice
        return greedy
    choice.ilp_bytes = total_bytes(ilp)
    if choice.ilp_bytes >= g_bytes:
        # On equal bytes greedy's choice is kept: its tie-breaks (alpha-beta
        # time, fewer boxings, no splits made from nothing) are finer than the
        # ILP's objective, which counts bytes only.
        choice.method = "greedy"
        choice.reason = f"the ILP's solution moves {choice.ilp_bytes} B, greedy's {g_bytes} B" + (
            " (greedy is optimal)"
            if choice.ilp_bytes == g_bytes and choice.gap == 0
            else f"; {choice.status}"
        )
        greedy.choice = choice
        return greedy
    ilp.warnings = greedy.warnings
    ilp.choice = choice
    return ilp


__all__ = ["solve", "choose", "Choice", "total_bytes", "SOLVERS"]
