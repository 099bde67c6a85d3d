"""Signature choice: give every value of the program an nd-SBP.

Walking the flat program in order, each primitive takes, among the nd
signatures its rule allows (one 1-D signature per placement axis), the one
whose input boxings cost least given the layouts its inputs already have
(:class:`~sbpjax.compiler.propagator.Propagator` says how it ranks them). A
value boxed once to a layout is reused by every consumer that wants that
layout. Partials are therefore kept while they stay valid, and a boxing
appears exactly where a producer's layout is not one its consumer can take.
``sj.constrain`` and ``out_sbp`` force layouts. What it returns is a
:class:`~sbpjax.compiler.propagation.Propagation`.
"""

from __future__ import annotations

from sbpjax.compiler.program import Program, Var
from sbpjax.compiler.propagation import Boxing, Propagation, idle_axes
from sbpjax.compiler.propagator import Propagator
from sbpjax.placement import Placement
from sbpjax.sbp import Partial


def propagate(
    program: Program,
    placement: Placement,
    in_sbp: list,
    out_sbp: list | None,
    cost_model=None,
    passes: int = 3,
    caches=None,
    idle=None,
    launch_priced: bool = True,
) -> Propagation:
    """Choose layouts for every value; ``out_sbp[k]`` None keeps the chosen one.
    ``idle``: the program's ``idle_axes`` (default: those of ``in_sbp``).

    The greedy pass is repeated: each later pass also prefers, for every value
    that had to be boxed, the layout its consumer asked for in the previous
    pass (so producers learn what consumers want). The pass moving the fewest
    bytes wins, so extra passes never make a program worse."""
    best: tuple | None = None
    learned: dict = {}
    uses: dict = {}  # id(var) -> how many ops and outputs use it
    for atom in [a for node in program.nodes for a in node.ins] + list(program.outputs):
        if isinstance(atom, Var):
            uses[id(atom)] = uses.get(id(atom), 0) + 1
    # plans, bounds, signatures, choices, evenness: shared by the passes (and
    # by the whole-program solver when it passes its own)
    caches = caches if caches is not None else ({}, {}, {}, {}, {})
    idle = idle_axes(in_sbp, placement.shape) if idle is None else idle

    def learn(prop) -> dict:
        out: dict = {}
        for b in prop.boxings:
            if (
                isinstance(b.var, Var)
                and b.node_index is not None
                and not any(isinstance(q, Partial) for q in b.dst)
            ):
                out.setdefault(id(b.var), b.dst)
        return out

    ranked_apart = False

    def run(learned, rank_with_prefs):
        nonlocal best, ranked_apart
        prop, apart = _one_pass(
            program,
            placement,
            in_sbp,
            out_sbp,
            cost_model,
            learned,
            quiet=best is not None,
            caches=caches,
            uses=uses,
            rank_with_prefs=rank_with_prefs,
            idle=idle,
            launch_priced=launch_priced,
        )
        ranked_apart |= apart
        total = prop.bytes
        if best is None or total < best[0]:
            best = (total, prop)
        return prop

    for _ in range(passes):
        new = learn(run(learned, False))
        if not new or new == learned:
            break
        learned = new
    # One more pass whose candidate ranking also counts the learned layouts
    # (see Propagator.rank_with_prefs), when that ranking would have kept a
    # candidate the passes did not consider; kept only when it moves fewer bytes.
    assert best is not None  # the first pass always sets it
    learned = learn(best[1])
    if learned and ranked_apart:
        run(learned, True)
    return best[1]


def _one_pass(
    program,
    placement,
    in_sbp,
    out_sbp,
    cost_model,
    learned,
    quiet,
    caches,
    uses,
    rank_with_prefs=False,
    idle=frozenset(),
    launch_priced=True,
) -> tuple[Propagation, bool]:
    pr = Propagator(program, placement, cost_model, launch_priced=launch_priced)
    pr.idle = idle
    pr.quiet = quiet
    pr.rank_with_prefs = rank_with_prefs
    pr._plans, pr._bounds, pr._sigs, pr._choices, pr._evens = caches[:5]
    for v, nd in zip(program.inputs, in_sbp):
        pr.layout[id(v)] = nd
    pr.prefer(out_sbp)
    pr.uses = uses
    for key, nd in learned.items():
        pr.pref.setdefault(key, nd)
    decisions = [pr.choose(node, i) for i, node in enumerate(program.nodes)]
    out_boxings, final = [], []
    for k, atom in enumerate(program.outputs):
        want = out_sbp[k] if out_sbp is not None else None
        have = pr.nd_of(atom)
        if want is None or want == have:
            final.append(have)
            continue
        plan = pr.plan(atom, have, want)
        out_boxings.append(Boxing(atom, have, want, plan, f"output {k}", None))
        final.append(want)
    return Propagation(
        program, placement, list(in_sbp), decisions, out_boxings, final, pr.warnings
    ), pr.ranked_apart
