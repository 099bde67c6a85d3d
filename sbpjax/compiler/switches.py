"""Running written-out conds as ``lax.switch`` when lowering.

The tracer writes a ``cond`` / ``switch`` out as its branches followed by one
``select_n(index, *cases)`` per result (:class:`~sbpjax.compiler.program.Cond`),
so the layout choice sees every branch. Run that way, every branch would
compute on every step, collectives included. The lowering instead runs the
cond as a :class:`Switch`: one ``lax.switch`` on the index, each branch
running its own ops and the boxings that belong to it, and returning its
cases in the layout the selects read them in (a select's result has the
layout of its cases: an elementwise op). Values are unchanged (the selects
pick case ``index``, the branch the switch runs); the plan's bytes are the
compiled program's, both counting every branch once (:mod:`sbpjax.comm`
counts the collectives of each branch computation once), so for a step they
are an upper bound: only the branch taken moves its bytes.

Where each boxing runs. A boxing belongs to the innermost branch that all
reads of its result lie in (its *place*, a path of ``(cond, branch)``
pairs). The propagation records a boxing at the first op that reads it; a
boxing of a value from before the cond whose result is also read after the
cond, or in another branch, runs before the switch instead (*hoisted*), where
every reader sees it. A boxing of a branch's own values is read in that
branch only.

A cond runs as a switch when its index is read in the same layout, not
partial, on every device (every device then takes the same branch, so the
collectives inside a branch match up), each select's result has the layout
of its cases, the cond's ops are contiguous in program order, and no boxing
owned by a rolled loop (:mod:`sbpjax.compiler.loops`) would have to move
across its edge. Otherwise it runs as written out, every branch computed and
the selects picking (correct, and as costly as before). ``CompileOptions.switches=False``
runs every cond that way (the benchmarks' written-out baseline).
"""

from __future__ import annotations

import dataclasses

from sbpjax.compiler.program import Cond, Var, common_path
from sbpjax.compiler.propagation import Propagation
from sbpjax.sbp import Partial


@dataclasses.dataclass
class Switch:
    """A cond the lowering runs as ``lax.switch``."""

    cond: Cond
    members: set  # decision indices of the cond (its branches' ops at any depth, its selects)
    branches: list  # per branch, decision indices of the ops in it (program order)
    selects: list  # decision index per select (program order)
    before: list  # boxings run before the switch: hoisted, and the index's own
    cases: list  # per branch, the selects' boxings of that branch's cases
    span: tuple  # (first, last) decision index
    depth: int  # how many switches' branches it lies in


def plan_switches(prop: Propagation, runs: list) -> tuple[dict, dict]:
    """The conds of ``prop`` that run as switches, and where boxings run.

    ``runs``: the rolled loops (:func:`sbpjax.compiler.loops.plan_runs`); the
    boxings they run themselves cannot move. Returns ``(switches, places)``:
    ``switches`` maps ``Cond.id`` to its :class:`Switch`; ``places`` maps
    ``id`` of each boxing inside a switch's branch to its place (see the
    module docstring)."""
    if not prop.options.switches:  # every cond stays written out
        return {}, {}
    # boxings a rolled loop runs itself, outside its body or at its end: id -> the run
    fixed = {id(b): r for r in runs for b in [*r.hoisted, *r.done, *(p[0] for p in r.pushed.values())]}
    fixed.update({id(b): r for r in runs for _, b in r.rotated})
    decs = prop.decisions
    grid = prop.placement.shape
    index_of = {id(d.node): i for i, d in enumerate(decs)}
    members_of: dict = {}
    for i, d in enumerate(decs):
        for c, _ in getattr(d.node, "branch", ()):
            members_of.setdefault(c, []).append(i)
    candidates: dict = {}
    for cond in prop.program.conds:
        sel = [index_of[id(n)] for n in cond.selects if id(n) in index_of]
        if not sel:
            continue
        members = sorted(set(members_of.get(cond.id, [])) | set(sel))
        if members != list(range(members[0], members[-1] + 1)):
            continue
        index_layouts = {decs[i].in_sbp[0] for i in sel}
        if len(index_layouts) != 1:
            continue
        (index_nd,) = index_layouts
        if any(isinstance(s, Partial) and grid[a] > 1 for a, s in enumerate(index_nd)):
            continue
        if any(decs[i].in_sbp[1 + k] != decs[i].out_sbp[0] for i in sel for k in range(cond.n_branches)):
            continue
        candidates[cond.id] = (cond, members, sel)

    if not candidates:  # no cond can run as a switch: every boxing runs where its op is
        return {}, {}
    real = set(candidates)
    while True:
        places, hoist, broken = _places(prop, real, candidates, fixed)
        if not broken:
            break
        real -= broken

    switches: dict = {}
    for c in real:
        cond, members, sel = candidates[c]
        depth = len(_path(decs[sel[0]].node, real))
        branches = [
            [i for i in members if len(p := _path(decs[i].node, real)) > depth and p[depth] == (c, k)]
            for k in range(cond.n_branches)
        ]
        before = [b for _, b in sorted(hoist.get(c, []), key=lambda t: t[0])]
        cases: list = [[] for _ in range(cond.n_branches)]
        for i in sel:
            for b in decs[i].boxings:
                place = places.get(id(b), ())
                if len(place) > depth and place[depth][0] == c:
                    cases[place[depth][1]].append(b)
                elif id(b) not in {id(h) for h in before}:
                    before.append(b)  # the index's, and those of a value several branches return
        switches[c] = Switch(
            cond, set(members), branches, sel, before, cases, (members[0], members[-1]), depth
        )
    return switches, places


def _path(node, real) -> tuple:
    """The branches of switches ``node`` lies in, outermost first."""
    return tuple(e for e in getattr(node, "branch", ()) if e[0] in real)


def _places(prop, real, candidates, fixed):
    """Each boxing's place, with the conds ``real`` run as switches: returns
    ``(places, hoisted, broken)``: ``hoisted`` maps a cond to the
    ``(decision index, boxing)`` pairs run before its switch, ``broken`` the
    conds that cannot run as switches (a loop inside one of their branches
    runs a boxing that readers outside it need, or a boxing reads a value
    not yet made where it would run)."""
    decs = prop.decisions
    reads, where = _reads_and_boxings(prop, real, candidates)
    boxings = [(i, b) for i, d in enumerate(decs) for b in d.boxings]
    place_of = _settled_places(boxings, reads, where)
    places: dict = {}
    hoisted: dict = {}
    broken: set = set()
    made: dict = {(id(v), nd): () for v, nd in zip(prop.program.inputs, prop.in_sbp)}
    for d in decs:
        for v, nd in zip(d.node.outs, d.out_sbp):
            made[(id(v), nd)] = _path(d.node, real)
    for i, b in boxings:
        _, at = where[id(b)]
        place = place_of[id(b)]
        run = fixed.get(id(b))
        if run is not None:
            # it runs where the loop is: fine at or outside its place, not inside
            loop_at = common_path([_path(decs[j].node, real) for j in range(run.first, run.last + 1)])
            if place[: len(loop_at)] != loop_at:
                broken.add(loop_at[len(common_path([place, loop_at]))][0])
            made[(id(b.var), b.dst)] = loop_at
            continue
        if len(place) < len(at):
            crossed = at[len(place)][0]
            hoisted.setdefault(crossed, []).append((i, b))
        if place:
            places[id(b)] = place
        made[(id(b.var), b.dst)] = place
    # a boxing runs where its source is made, or deeper
    for _, b in boxings:
        place = places.get(id(b), ())
        src = made.get((id(b.var), b.src))
        if src is not None and place[: len(src)] != src:
            common = len(common_path([place, src]))
            broken |= {c for c, _ in place[common:]} | {c for c, _ in src[common:]}
    return places, hoisted, broken & real


def _reads_and_boxings(prop, real, candidates) -> tuple[dict, dict]:
    """``(reads, where)``: the path of each read of each (value, layout) (a
    select reads case ``k`` in branch ``k``; the program's outputs read at
    the top), and each boxing's (decision index, path where its op reads it)."""
    select_of = {id(n): c for c in real for n in candidates[c][0].selects}
    reads: dict = {}
    where: dict = {}
    for i, d in enumerate(prop.decisions):
        path = _path(d.node, real)
        c = select_of.get(id(d.node))
        operand_paths = [
            path + ((c, j - 1),) if c is not None and j >= 1 else path for j in range(len(d.node.ins))
        ]
        for a, nd, p in zip(d.node.ins, d.in_sbp, operand_paths):
            if isinstance(a, Var):
                reads.setdefault((id(a), nd), []).append(p)
        for b in d.boxings:
            at = [p for a, nd, p in zip(d.node.ins, d.in_sbp, operand_paths) if a is b.var and nd == b.dst]
            where[id(b)] = (i, common_path(at) if at else path)
    for b in prop.out_boxings:
        reads.setdefault((id(b.var), b.src), []).append(())
    for a, nd in zip(prop.program.outputs, prop.out_sbp):
        if isinstance(a, Var):
            reads.setdefault((id(a), nd), []).append(())
    return reads, where


def _settled_places(boxings: list, reads: dict, where: dict) -> dict:
    """id(boxing) -> its place: the innermost path all reads of its result
    lie in. A boxing may read another's result (its source layout made by an
    earlier boxing): that read is where the reading boxing runs, which may
    move out in turn. Places only move outwards, so this settles."""
    place_of = {id(b): where[id(b)][1] for _, b in boxings}
    while True:
        all_reads = {k: list(v) for k, v in reads.items()}
        for _, b in boxings:
            all_reads.setdefault((id(b.var), b.src), []).append(place_of[id(b)])
        moved = False
        for _, b in boxings:
            place = common_path([place_of[id(b)], *all_reads.get((id(b.var), b.dst), [])])
            if place != place_of[id(b)]:
                place_of[id(b)], moved = place, True
        if not moved:
            return place_of
