"""The nd-signatures an op may take: every product of its rule's 1-D
signatures over the placement's axes that runs on the pieces
(:func:`candidates`), and the same test for one signature that comes from
outside the solver (:func:`allowed`: a plan cache entry). Which of them the
layout choice keeps is :mod:`sbpjax.compiler.domains`' narrowing."""

from __future__ import annotations

import itertools

from sbpjax.compiler.propagation import CONSTRAIN, NESTED, op_comm
from sbpjax.compiler.propagator import Propagator
from sbpjax.rules import RULES
from sbpjax.sbp import Broadcast, Split


def candidates(pr: Propagator, node, grid):
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
        if not pr.fits(node, ins, outs):
            continue
        if not all(pr.partial_ok(nd) for nd in ins + outs):
            continue
        if op_comm(node, ins, outs, pr.pl, pr.comms) is None:
            continue
        key = (tuple(ins), tuple(outs))
        if key in seen:
            continue
        seen.add(key)
        out.append((ins, outs))
    if not out:
        return [([rep] * len(node.ins), [rep] * len(node.outs))]
    return out


def allowed(pr: Propagator, node, ins, outs) -> bool:
    """Whether ``node`` may run with the nd-signature (ins, outs): what its
    rule allows on every axis (or, for an op without one, B throughout), on
    pieces it can run on, as ``candidates`` would list it. Checks a
    signature that comes from outside the solver (the plan cache)."""
    grid = pr.grid
    if len(ins) != len(node.ins) or len(outs) != len(node.outs):
        return False
    nds = list(ins) + list(outs)
    values = list(node.ins) + list(node.outs)
    if not all(isinstance(nd, tuple) and len(nd) == len(grid) for nd in nds):
        return False
    if any(isinstance(q, Split) and q.dim >= len(v.shape) for nd, v in zip(nds, values) for q in nd):
        return False
    if node.name == CONSTRAIN:
        want = tuple(node.eqn.params["sbp"])
        return all(nd == want for nd in nds)
    rep = (Broadcast(),) * len(grid)
    if node.name in NESTED:
        sig = NESTED[node.name].signature(node, list(ins), pr.pl)
        whole = all(nd == rep for nd in nds)
        return (
            whole
            if sig is None
            else (list(map(tuple, sig[0])), list(map(tuple, sig[1]))) == (list(ins), list(outs))
        )
    sigs = pr.candidates(node) if node.name in RULES else []
    if not sigs:
        return all(nd == rep for nd in nds)
    for a, p in enumerate(grid):
        on_axis = (tuple(nd[a] for nd in ins), tuple(nd[a] for nd in outs))
        if p == 1:
            if not all(isinstance(q, Broadcast) for nd in nds for q in (nd[a],)):
                return False
        elif not any((tuple(s.ins), tuple(s.outs)) == on_axis for s in sigs):
            return False
    if not pr.fits(node, list(ins), list(outs)) or not all(pr.partial_ok(nd) for nd in nds):
        return False
    return op_comm(node, list(ins), list(outs), pr.pl, pr.comms) is not None
