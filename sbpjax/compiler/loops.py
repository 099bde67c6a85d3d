"""Rolling written-out scans back into loops when lowering.

The tracer writes a ``scan`` out as straight-line code (``trace.UNROLL_LIMIT``)
so that the layout choice sees every iteration, and records it as a
:class:`~sbpjax.compiler.program.Loop`; the solver gives the iterations the
same choices (``classes.loop_classes``). Once layouts are chosen, consecutive
iterations that run the same program (the same ops, layouts and boxings,
reading their carries and slices in the same places) form a
:class:`~sbpjax.compiler.loop_state.Run`, and the lowering runs a run as one
``lax.scan`` whose body is its first iteration (its *template*), with the
template's collectives inside. The compiled
program then keeps the loop: one body to compile, and the memory of a loop.
Written out, XLA schedules the layers as one program with more values live
at once: 2.0x GSPMD's temp memory on a scanned 4-layer MLP step at d 256, 1.6x
its peak on the model zoo's scanned decoder; kept as loops, 1.00x and 0.79x
(each loop slicing its layers' weights itself: ``trace.LOOP_SLICES``).

Values are unchanged: a run executes the same boxings and ops as the
written-out iterations, on the same local pieces; the plan's bytes are the
compiled program's (XLA's trip count multiplies the body's collectives, see
:mod:`sbpjax.comm`). What a run's body reads:

- *slices*: ``x[i]`` of a stacked operand, indexed out of the operand's local
  piece (its layout leaves the stacked dim whole), or out of a stack of the
  slices as code before the loop boxed them: one by one, where the stack's
  layout cannot be sliced into the one the body reads (a residual the forward
  loop stacked as a partial), or, where loops share their slices
  (``trace.LOOP_SLICES = False``), the forward pass's gathered weights read
  again by the backward pass;
- *carries*: what the previous iteration made, in each layout the body reads
  it in (the loop's state). The first iteration's carry often arrives in a
  layout the others box to at their start; those boxings then run at the end
  of the previous iteration instead (*rotated*), the first iteration's own
  ones before the loop, and the first iteration runs in the loop too;
- *outer* values (the scan's consts, unchanged carries, anything else from
  before the loop): closed over; their boxings run once, before the loop
  (*hoisted*), as the written-out program runs them once, at first use.

Values made in the run and used after it (``ys``, the last carry, residuals
for the backward pass; :mod:`sbpjax.compiler.loop_exits`) leave the loop one
slice per iteration, written straight into the stack the program builds of
them, or as the final state. A stack of slices boxed as a whole after the loop
(per-layer gradients summed over the data axis) is boxed slice by slice inside
it, as GSPMD does, with the same bytes. Iterations that differ stay written out around the run
(*peeled*): the last, when the code after the loop reads its carry in another
layout than the loop boxes it to. A carry the last iteration makes that
nothing reads (a backward loop whose first layer's input gradient is not
taken) is still computed (``dead_code.last_carries``), and boxed like the others
(``Run.dead_tail``), so that iteration runs in the loop too.
"""

from __future__ import annotations

import dataclasses

from sbpjax.compiler.loop_exits import carry_input
from sbpjax.compiler.loop_state import OUTER, Run, carry_boxings, check_run, plan_key, roles
from sbpjax.compiler.propagation import Propagation


def plan_runs(prop: Propagation) -> list[Run]:
    """The runs of the program's written-out scans (see the module docstring);
    found once per plan and its options (``Propagation.runs``)."""
    if not prop.options.roll_loops:  # every scan stays written out
        return []
    if prop.runs is not None and prop.runs[0] is prop.options:
        return prop.runs[1]
    runs = _plan_runs(prop) if prop.program.loops else []  # (the value index alone costs 10-30 ms)
    prop.runs = (prop.options, runs)
    return runs


@dataclasses.dataclass(frozen=True)
class ValueIndex:
    """Where each value of a plan is made, read and boxed: what the checks of
    a run (:mod:`sbpjax.compiler.loop_state`, :mod:`sbpjax.compiler.loop_exits`)
    look up as ``ctx``. Decision indices throughout; -1 is an input (for
    ``made_at``) or the program's outputs (for ``reads`` and ``boxings_of``)."""

    producer: dict  # id(Var) -> (decision index, output position)
    made_at: dict  # id(Var) -> [(decision index, layout)]: the layouts it is available in, from where
    reads: dict  # id(Var) -> [(decision index, layout)]: where its ops and boxings read it, in what layout
    boxings_of: dict  # id(Var) -> [(decision index, Boxing)]
    placement: object

    def available(self, v, before: int) -> set:
        """The layouts ``v`` is in before decision ``before``."""
        return {nd for i, nd in self.made_at.get(id(v), ()) if i < before}


def value_index(prop: Propagation) -> ValueIndex:
    prog, decs = prop.program, prop.decisions
    producer: dict = {}
    for i, d in enumerate(decs):
        for o, v in enumerate(d.node.outs):
            producer[id(v)] = (i, o)
    made_at: dict = {}
    for v, nd in zip(prog.inputs, prop.in_sbp):
        made_at.setdefault(id(v), []).append((-1, nd))
    for i, d in enumerate(decs):
        for b in d.boxings:
            made_at.setdefault(id(b.var), []).append((i, b.dst))
        for v, nd in zip(d.node.outs, d.out_sbp):
            made_at.setdefault(id(v), []).append((i, nd))
    for b in prop.out_boxings:  # after every op
        made_at.setdefault(id(b.var), []).append((len(decs), b.dst))
    reads: dict = {}
    for i, d in enumerate(decs):
        for a, nd in zip(d.node.ins, d.in_sbp):
            reads.setdefault(id(a), []).append((i, tuple(nd)))
        for b in d.boxings:
            reads.setdefault(id(b.var), []).append((i, tuple(b.src)))
    for a, nd in zip(prog.outputs, prop.out_sbp):
        reads.setdefault(id(a), []).append((-1, tuple(nd)))
    for b in prop.out_boxings:
        reads.setdefault(id(b.var), []).append((-1, tuple(b.src)))
    boxings_of: dict = {}
    for i, d in enumerate(decs):
        for b in d.boxings:
            boxings_of.setdefault(id(b.var), []).append((i, b))
    for b in prop.out_boxings:
        boxings_of.setdefault(id(b.var), []).append((-1, b))
    return ValueIndex(producer, made_at, reads, boxings_of, prop.placement)


def _plan_runs(prop: Propagation) -> list[Run]:
    decs = prop.decisions
    index_of = {id(d.node): i for i, d in enumerate(decs)}
    ctx = value_index(prop)
    runs: list = []
    taken: set = set()  # decision indices already inside a run of an outer or earlier loop
    for loop in reversed(prop.program.loops):  # outer loops first: an inner loop rolls inside the outer body
        bodies = [
            sorted(index_of[id(n)] for n in _nodes_of(it, decs, ctx.producer)) for it in loop.iterations
        ]
        q = 0
        n = len(loop.iterations)
        while q < n - 1:
            run = _grow(prop, loop, bodies, q, ctx)
            if run is None or any(i in taken for i in range(run.first, run.last + 1)):
                q += 1
                continue
            runs.append(run)
            # an inner loop inside the template still rolls inside the body; one in another iteration never runs
            taken.update(i for body in run.bodies[1:] for i in body)
            q = run.positions[-1] + 1
    return runs


def _nodes_of(it, decs, producer):
    seen, out = set(), []
    for vid in it.made:
        where = producer.get(vid)
        if where is not None and where[0] not in seen:
            seen.add(where[0])
            out.append(decs[where[0]].node)
    return out


def _signature(prop, loop, it, body):
    """What the iteration runs, and apart from it the boxings of the carries it
    reads (``(position, input, src, dst, steps)``): the first iteration of a loop often
    reads its carry in a layout the code before made, where later ones box the
    previous iteration's carry (see ``Run.rotated``). A boxing is compared by
    its steps too, not only its layouts: the first iteration's carry may be
    known to be zeros (``jnp.zeros`` before an RNN) and boxed by making zeros
    afresh, which later iterations must not repeat."""
    decs = prop.decisions
    role, _ = roles(prop, loop, it, body)
    sig, carried = [], []
    for p, i in enumerate(body):
        d = decs[i]
        node = d.node
        boxings = []
        for b in d.boxings:
            r = role(b.var)
            if carry_input(loop, r) is not None:
                carried.append((p, r[1], b.src, b.dst, plan_key(b.plan)))
            elif r[0] != OUTER:
                boxings.append((r, b.src, b.dst, plan_key(b.plan)))
        sig.append(
            (
                (node.name, node.params_text),
                node.region > 0,
                tuple(d.in_sbp),
                tuple(d.out_sbp),
                tuple(role(a) for a in node.ins),
                tuple(boxings),
                len(d.comm),
            )
        )
    sig.append(tuple(role(a) for a in it.outs))
    return sig, tuple(carried)


def _grow(prop, loop, bodies, q0, ctx) -> Run | None:
    """The longest run of iterations from ``q0`` on that repeat iteration ``q0``."""
    its = loop.iterations
    if not bodies[q0]:
        return None
    sig0, carried0 = _signature(prop, loop, its[q0], bodies[q0])
    q, carried = q0 + 1, None
    while q < len(its) and bodies[q]:
        sig, c = _signature(prop, loop, its[q], bodies[q])
        if sig != sig0 or (carried is not None and c != carried):
            break
        carried, q = c, q + 1
    if carried is None:
        return None
    rotated, entry = [], []
    if carried0 != carried:
        # The first iteration reads its carry as the code before left it, the
        # others as the previous iteration left it, and each boxes it to the
        # layouts the body reads: the first iteration's boxings then run before
        # the loop (on the carry coming in), the others' at the end of the body
        # (on the carry going out), and every iteration starts with the carry in
        # all the layouts the body reads.
        rotated = carry_boxings(prop, loop, its[q0 + 1], bodies[q0 + 1])
        entry = [b for _, b in carry_boxings(prop, loop, its[q0], bodies[q0])]
    next_carried = _signature(prop, loop, its[q], bodies[q])[1] if q < len(its) and bodies[q] else None
    positions = list(range(q0, q))
    while len(positions) >= 2:
        after = carried if positions[-1] + 1 < q else next_carried
        run = check_run(prop, loop, bodies, positions, ctx, rotated, entry, after)
        if run is not None:
            return run
        positions = positions[:-1]  # the last iteration's results may be used otherwise: peel it
    return None


__all__ = ["Run", "plan_runs"]
