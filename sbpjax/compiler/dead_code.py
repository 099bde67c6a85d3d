"""Dead code removed from a traced program, as XLA removes it.

Every boxing left in a plan should be one XLA runs, so what nothing reads is
dropped before the layout choice sees it (:func:`dce`). Written-out loops
are the exception: a carry that only makes its own next value is dead, but
a written-out scan's last iteration keeps what the others make
(:func:`last_carries`), so that the iterations stay alike and roll back
into one loop.
"""

from __future__ import annotations

import dataclasses

from sbpjax.compiler.loop_eqns import without_dead_carries
from sbpjax.compiler.program import Var


def live_roots(nodes, outs, loops) -> tuple[list, list]:
    """``(roots, the nodes they keep)``: ``outs`` and the last carries
    (:func:`last_carries`) that the program uses: each carry some op of the loop reads (for a result, an
    effect, or another carry that is used), in some iteration. A carry whose
    values only make its own next value (a ``fori_loop`` whose ``h`` is never
    returned nor read otherwise) is dead code, as it is to XLA, which drops
    it from the loop; a loop none of whose carries is used is dropped
    whole. (Kept, their exchanges were counted in ``explain()`` and moved
    nothing.)"""
    roots, added = list(outs), set()
    while True:
        kept = dce(nodes, roots)
        live = {id(o) for n in kept for o in n.outs}
        new = []
        for loop in loops:
            if len(loop.iterations) < 2 or not any(live & it.made for it in loop.iterations):
                continue
            made = set().union(*(it.made for it in loop.iterations))
            read = {id(a) for n in kept if any(id(o) in made for o in n.outs) for a in n.ins}
            for k in range(loop.n_carry):
                # from the second iteration on: the first's is the initial value,
                # which other code may read (a fori_loop's h starting at x)
                carried = [it.ins[loop.n_consts + k] for it in loop.iterations[1:]]
                if (id(loop), k) not in added and any(id(v) in read for v in carried):
                    added.add((id(loop), k))
                    new.append((loop, k))
        if not new:
            return roots, kept
        roots += last_carries(new)


def last_carries(carries) -> list:
    """The carries ``(loop, index)`` that each written-out scan of two or
    more iterations makes in its last one, to keep as live as the others'
    though nothing reads them.

    A scan's backward pass whose first layer's input gradient is not taken
    (the layers' input is data, not a parameter) computes that gradient in
    every iteration but the last, where dead code elimination dropped it.
    The last iteration then differs from the others, so the lowering wrote it
    out after the loop (``sbpjax.compiler.loops``), its weight gradients
    reduced outside the loop into buffers of their own: 4 Megatron MLP layers
    on 2x4 held 1.21x GSPMD's temp memory (1.25x under ``jax.checkpoint``), and
    the program held the layer's code twice. Decision: compute the unread
    gradient, as GSPMD's loop does (its body is the same in every iteration),
    and let the loop run every iteration: 0.99x GSPMD's temp memory. Where the
    loop boxes the carry for the next iteration (a partial gradient reduced),
    it boxes the last one too, bytes nothing reads (``Run.dead_tail``,
    counted in ``explain().bytes``): there the step moves GSPMD's bytes, where
    it moved 0.6% fewer. Any other carry no one reads after the loop is kept
    alike (a ``fori_loop``'s counter, a scan's final state where only its
    ``ys`` are used): a result of the last iteration's ops, which the
    written-out program would have dropped."""
    roots = []
    for loop, k in carries:
        last = loop.iterations[-1]
        v = last.outs[k]
        if isinstance(v, Var) and id(v) in last.made:
            roots.append(v)
    return roots


def unread_last_carries(program, read: set, made: set) -> list:
    """``(carry, coming)`` per carry a written-out scan's last iteration makes
    (``made``: ids of the values the plan computes) that nothing reads
    (``read``: ids of the values read, the results among them): kept by
    :func:`last_carries` where loops roll, boxed by the rolled loop for a
    next iteration as that iteration boxed ``coming``, its own carry coming
    in (``Run.dead_tail``). The layout choice prices those boxings
    (``formulate``, ``pricing.dead_tail_boxings``)."""
    out = []
    for loop in program.loops:
        if len(loop.iterations) < 2:
            continue
        last = loop.iterations[-1]
        for c in range(loop.n_carry):
            carry, coming = last.outs[c], last.ins[loop.n_consts + c]
            if (
                isinstance(carry, Var)
                and isinstance(coming, Var)
                and id(carry) in made
                and id(carry) not in read
            ):
                out.append((carry, coming))
    return out


def dce(nodes, outputs):
    live = {id(o) for o in outputs if isinstance(o, Var)}
    kept = []
    for node in reversed(nodes):
        effects = getattr(node.eqn, "effects", None)
        if any(id(o) in live for o in node.outs) or effects:
            if node.name in ("while", "scan"):  # a loop kept whole: its dead carries pass through
                eqn = without_dead_carries(node.eqn, [id(o) in live for o in node.outs])
                node = (
                    node if eqn is node.eqn else dataclasses.replace(node, eqn=eqn, texts=None, op_key=None)
                )
            kept.append(node)
            live |= {id(i) for i in node.ins if isinstance(i, Var)}
    return kept[::-1]
