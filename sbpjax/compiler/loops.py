"""Rolling written-out scans back into loops when lowering.

The tracer writes a ``scan`` out as straight-line code (``trace.UNROLL_LIMIT``)
so that the layout choice sees every iteration, and records it as a
:class:`~sbpjax.compiler.program.Loop`; the solver gives the iterations the
same choices (``classes.loop_classes``). Once layouts are chosen, consecutive
iterations that run the same program (the same ops, layouts and boxings,
reading their carries and slices in the same places) form a :class:`Run`, and
the lowering runs a run as one ``lax.scan`` whose body is its first iteration
(its *template*), with the template's collectives inside. The compiled
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
taken) is still computed (``trace._last_carries``), and boxed like the others
(``Run.dead_tail``), so that iteration runs in the loop too.
"""

from __future__ import annotations

import dataclasses
import types

from sbpjax.compiler.loop_exits import (
    boxed_after,
    carry_input,
    direct_stacks,
    escapes_read_after,
    pushed_boxings,
    shift_up,
)
from sbpjax.compiler.program import Const, Loop
from sbpjax.compiler.propagation import Propagation
from sbpjax.sbp import Broadcast

OUTER = "outer"


@dataclasses.dataclass(eq=False)
class Run:
    """Iterations of one loop lowered as one ``lax.scan`` over the body of the
    first of them (the template). Per field, what it holds:

    - ``positions``: indices into ``loop.iterations``, in the order they run;
      ``bodies``: per rolled iteration, the decision indices of its body;
      ``first`` / ``last``: the first and last decision index the run covers;
      ``slices``: the decisions between the bodies (the tracer's slicing of the
      stacked operands for later iterations), run before the loop.
    - ``hoisted``: boxings of outer values, and of the carry coming in (see
      ``rotated``), run once before the loop.
    - ``xs``: (body input, layout, stacked operand or None): a slice the body
      reads in that layout, indexed out of the operand's local piece, or out of
      a stack of the per-iteration values code before the loop boxed (None).
    - ``carries``: (carry, layouts): carries the body makes, held in those
      layouts from one iteration to the next; ``rotated``: (carry, Boxing), the
      next iteration's boxings of its carry, run at the end of the body.
    - ``escapes``: (key, layouts, the Var in each rolled iteration): values the
      bodies make (or box) that code after the run reads, leaving the loop one
      slice per iteration; ``last_only``: escapes that are carries read after
      the run only in the last iteration (the loop's final state).
    - ``stacks``: (stacked Var, escape key, slice layout, [(index, slice Var) of
      iterations outside the run], decision): ``jnp.stack``s of ``ys`` the loop
      fills directly (:func:`_direct_stacks`); ``dropped``: the decisions they
      replace; ``pushed``: (escape key, layout) -> (the stack's Boxing, the
      slice's BoxingPlan, its dst): stacks boxed slice by slice in the loop
      (:func:`_pushed_boxings`).
    - ``done``: boxings after the run (the next iteration's of its carry, or the
      code after the loop's) whose result the loop's last ``rotated`` boxing made.
    - ``dead_tail``: the last iteration's ``rotated`` boxings of carries nothing
      reads; the loop runs them like every other iteration's, and they are the
      only bytes the rolled program moves that the written-out plan does not
      (``Explanation.bytes`` counts them).
    """

    loop: Loop
    positions: list
    bodies: list
    first: int
    last: int
    hoisted: list
    xs: list
    carries: list
    rotated: list
    escapes: list
    last_only: set
    stacks: list
    dropped: set
    slices: list
    pushed: dict = dataclasses.field(default_factory=dict)
    done: list = dataclasses.field(default_factory=list)
    dead_tail: list = dataclasses.field(default_factory=list)

    @property
    def template(self):
        return self.loop.iterations[self.positions[0]]

    @property
    def indices(self) -> list:
        """The loop indices of the rolled iterations, ascending."""
        return sorted(self.loop.iterations[q].index for q in self.positions)


def plan_runs(prop: Propagation) -> list[Run]:
    """The runs of the program's written-out scans (see the module docstring);
    found once per plan and its options (``Propagation.runs``)."""
    if not prop.options.roll_loops:  # every scan stays written out
        return []
    if prop.runs is not None and prop.runs[0] is prop.options:
        return prop.runs[1]
    runs = _plan_runs(prop)
    prop.runs = (prop.options, runs)
    return runs


def _plan_runs(prop: Propagation) -> list[Run]:
    prog = prop.program
    decs = prop.decisions
    index_of = {id(d.node): i for i, d in enumerate(decs)}
    producer: dict = {}  # id(Var) -> (decision index, output position)
    for i, d in enumerate(decs):
        for o, v in enumerate(d.node.outs):
            producer[id(v)] = (i, o)
    # the layouts each value is available in, and from where (decision index; -1: an input)
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

    def available(v, before: int) -> set:
        return {nd for i, nd in made_at.get(id(v), ()) if i < before}

    # the layouts each value is read in, and where: decision indices (its ops and the
    # boxings placed there), -1 for the program's outputs
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
    boxings_of: dict = {}  # id(Var) -> [(decision index, -1 for the outputs' boxings), Boxing]
    for i, d in enumerate(decs):
        for b in d.boxings:
            boxings_of.setdefault(id(b.var), []).append((i, b))
    for b in prop.out_boxings:
        boxings_of.setdefault(id(b.var), []).append((-1, b))
    ctx = types.SimpleNamespace(
        producer=producer,
        available=available,
        made_at=made_at,
        reads=reads,
        boxings_of=boxings_of,
        placement=prop.placement,
    )
    runs: list = []
    taken: set = set()  # decision indices already inside a run of an outer or earlier loop
    for loop in reversed(prog.loops):  # outer loops first: an inner loop rolls inside the outer body
        bodies = []
        for it in loop.iterations:
            body = sorted(index_of[id(n)] for n in _nodes_of(it, decs, producer))
            bodies.append(body)
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


def _roles(prop, loop, it, body):
    """How the iteration's body reads each atom: a role that is the same in
    iterations that run the same program."""
    decs = prop.decisions
    n_in = len(it.ins)
    pos: dict = {}
    for p, i in enumerate(body):
        for o, v in enumerate(decs[i].node.outs):
            pos[id(v)] = (p, o)
    first_in: dict = {}
    for k, a in enumerate(it.ins):
        first_in.setdefault(id(a), k)
    passthrough = {
        k
        for k in range(loop.n_consts, loop.n_consts + loop.n_carry)
        if it.outs[k - loop.n_consts] is it.ins[k]
    }

    def role(a):
        if isinstance(a, Const):
            v = a.value
            return (
                ("const", id(v))
                if getattr(v, "ndim", 0)
                else ("const", repr(v), str(getattr(v, "dtype", "")))
            )
        if id(a) in pos:
            return ("made", *pos[id(a)])
        if id(a) in it.made:
            return ("dead",)  # its op was dropped as dead code (a result no one reads)
        k = first_in.get(id(a))
        if k is not None and k >= loop.n_consts and k not in passthrough and k < n_in:
            return ("in", k)
        return (OUTER, id(a))

    return role, pos


def _signature(prop, loop, it, body):
    """What the iteration runs, and apart from it the boxings of the carries it
    reads (``(position, input, src, dst)``): the first iteration of a loop often
    reads its carry in a layout the code before made, where later ones box the
    previous iteration's carry (see ``Run.rotated``)."""
    decs = prop.decisions
    role, _ = _roles(prop, loop, it, body)
    sig, carried = [], []
    for p, i in enumerate(body):
        d = decs[i]
        node = d.node
        boxings = []
        for b in d.boxings:
            r = role(b.var)
            if carry_input(loop, r) is not None:
                carried.append((p, r[1], b.src, b.dst))
            elif r[0] != OUTER:
                boxings.append((r, b.src, b.dst))
        sig.append(
            (
                _op_key(node),
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


def _op_key(node):
    eqn = node.eqn
    try:
        params = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()))
    except Exception:  # noqa: BLE001 - unprintable params: compare the equation itself
        params = id(eqn)
    return (eqn.primitive.name, params)


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
        rotated = _carry_boxings(prop, loop, its[q0 + 1], bodies[q0 + 1])
        entry = [b for _, b in _carry_boxings(prop, loop, its[q0], bodies[q0])]
    next_carried = _signature(prop, loop, its[q], bodies[q])[1] if q < len(its) and bodies[q] else None
    positions = list(range(q0, q))
    while len(positions) >= 2:
        after = carried if positions[-1] + 1 < q else next_carried
        run = _check(prop, loop, bodies, positions, ctx, rotated, entry, after)
        if run is not None:
            return run
        positions = positions[:-1]  # the last iteration's results may be used otherwise: peel it
    return None


def _carry_boxings(prop, loop, it, body) -> list:
    """(carry, Boxing) of the iteration's boxings of the carries it reads."""
    role, _ = _roles(prop, loop, it, body)
    found = []
    for i in body:
        for b in prop.decisions[i].boxings:
            k = carry_input(loop, role(b.var))
            if k is not None:
                found.append((k - loop.n_consts, b))
    return found


def _check(prop, loop, bodies, positions, ctx, rotated, entry, after) -> Run | None:
    """The run of these iterations, or None where the body cannot read its
    carries and slices from a loop's state."""
    decs = prop.decisions
    its = [loop.iterations[q] for q in positions]
    t, tbody = its[0], bodies[positions[0]]
    nc = loop.n_consts
    role, pos = _roles(prop, loop, t, tbody)
    first, last = tbody[0], bodies[positions[-1]][-1]
    in_run = {i for q in positions for i in bodies[q]}
    between = sorted(set(range(first, last + 1)) - in_run)
    made, needs = _template_layouts(decs, tbody, role, entry)
    found = _carries(loop, t, role, made, needs, rotated, entry, ctx.available, first)
    if found is None:
        return None
    carries, entering = found
    ends = _done(prop, loop, bodies, positions, ctx, rotated, after, last) if rotated else ([], [])
    if ends is None:
        return None
    done, dead_tail = ends
    xs = _slices(prop, loop, its, role, needs, ctx, first, between)
    if xs is None or not _slicing_reads_before(decs, loop, ctx.producer, first, between):
        return None
    # values made in the run and read after it: what the bodies compute, and the
    # layouts their boxings give the carries and slices they read (the written-out
    # program boxes those once, and code after the loop reads them too)
    for c, layouts in carries:  # a carry comes in in each layout of the state
        made.setdefault(("in", nc + c), set()).update(layouts)
    escapes = []
    for key, layouts in made.items():
        if key[0] == "made":
            vs = [decs[bodies[q][key[1]]].node.outs[key[2]] for q in positions]
        else:
            vs = [it.ins[key[1]] for it in its]
        escapes.append((key, sorted(layouts, key=repr), vs))
    hoisted = list(entry)
    for q in positions:
        role_q, _ = _roles(prop, loop, loop.iterations[q], bodies[q])
        hoisted += [b for i in bodies[q] for b in decs[i].boxings if role_q(b.var)[0] == OUTER]
    stacks, dropped = direct_stacks(prop, loop, its, role, escapes, ctx, entering)
    pushed = pushed_boxings(ctx, stacks, escapes)
    carry_out = {("made", *pos[id(t.outs[c])]) for c, _ in carries}
    escapes, last_only = escapes_read_after(ctx, escapes, stacks, pushed, dropped, carry_out, len(its), last)
    return Run(
        loop,
        positions,
        [bodies[q] for q in positions],
        first,
        last,
        hoisted,
        xs,
        carries,
        rotated,
        escapes,
        last_only,
        stacks,
        dropped,
        between,
        pushed,
        done,
        dead_tail,
    )


def _template_layouts(decs, tbody, role, entry) -> tuple[dict, dict]:
    """What the template makes, in each layout (role -> layouts), and which
    layouts of its inputs it reads before making them (input index -> layouts)."""
    made: dict = {}
    needs: dict = {}

    def read(a, nd):
        r = role(a)
        if r[0] == "in" and nd not in made.get(r, set()):
            needs.setdefault(r[1], set()).add(nd)

    for p, i in enumerate(tbody):
        d = decs[i]
        for b in d.boxings:
            if any(b is e for e in entry):
                continue  # runs before the loop
            read(b.var, b.src)
            r = role(b.var)
            # what the run makes of its own values (a literal boxed in the body
            # is boxed again wherever it is read: it never leaves the loop)
            if r[0] in ("made", "in"):
                made.setdefault(r, set()).add(b.dst)
        for a, nd in zip(d.node.ins, d.in_sbp):
            read(a, nd)
        for o, nd in enumerate(d.out_sbp):
            made.setdefault(("made", p, o), set()).add(nd)
    return made, needs


def _carries(loop, t, role, made, needs, rotated, entry, available, first):
    """``(carries, entering)``: (carry, layouts) of the carries the body makes
    and reads from the loop's state, and per carry input the layouts the first
    iteration's carry comes in; or None where the body reads a carry in a
    layout neither it nor the code before the loop makes. Adds the rotated
    boxings' layouts to ``made``."""
    nc = loop.n_consts
    carries, entering = [], {}
    for c in range(loop.n_carry):
        out = role(t.outs[c])
        k = nc + c
        if (out[0] == OUTER and t.outs[c] is t.ins[k]) or out[0] == "dead":
            continue  # unchanged (an outer value), or never read
        if out[0] != "made":
            return None
        # the body's boxings of the carry, and those moved to the end of the body
        layouts = made[out] | {b.dst for c2, b in rotated if c2 == c}
        made[out] = layouts
        if not needs.get(k, set()) <= layouts:
            return None
        init = t.ins[k]
        if isinstance(init, Const):
            return None
        ready = set(available(init, first))
        for b in entry:
            if b.var is init:
                if b.src not in ready:
                    return None
                ready.add(b.dst)
        if not needs.get(k, set()) <= ready:
            return None
        entering[k] = ready
        carries.append((c, sorted(layouts, key=repr)))
    kept = {c for c, _ in carries}
    if any(k < nc + loop.n_carry and k - nc not in kept for k in needs):
        return None
    return carries, entering


def _done(prop, loop, bodies, positions, ctx, rotated, after, last) -> tuple[list, list] | None:
    """``(done, dead_tail)``: the boxings after the run that the loop's last
    rotated boxing made (``Run.done``), and the last rotated boxings of
    carries nothing reads (``Run.dead_tail``); or None where the last
    iteration must be peeled: it boxes its carry for a next one, so the
    iteration after the run must box it so too (it then finds it boxed), or
    the code after the loop, or nothing may read it (the carry the last
    iteration of a backward pass makes where the first layer's input
    gradient is not taken: ``trace._last_carries``)."""
    its_last = loop.iterations[positions[-1]]
    nc = loop.n_consts
    # (layouts have no order: two carries boxed alike tie on the index)
    moved = sorted(((nc + c, b.src, b.dst) for c, b in rotated), key=repr)
    if after is not None:
        if sorted((a[1:] for a in after), key=repr) != moved:
            return None
        q = positions[-1] + 1
        return [b for _, b in _carry_boxings(prop, loop, loop.iterations[q], bodies[q])], []
    read = [(c, b) for c, b in rotated if ctx.reads.get(id(its_last.outs[c]))]
    dead_tail = [b for c, b in rotated if not ctx.reads.get(id(its_last.outs[c]))]
    if not boxed_after(ctx, [(its_last.outs[c], b.dst) for c, b in read], last):
        return None
    wanted = {(id(its_last.outs[c]), b.dst) for c, b in read}
    done = [
        b
        for c, _ in read
        for i, b in ctx.boxings_of.get(id(its_last.outs[c]), ())
        if (i == -1 or i > last) and (id(b.var), b.dst) in wanted
    ]
    return done, dead_tail


def _slices(prop, loop, its, role, needs, ctx, first, between) -> list | None:
    """``Run.xs``, or None where a slice is in a layout the loop cannot index.

    x[i] in its slicing's layout is the slice of the stacked operand's local
    piece; in a layout code before the loop boxed it to, it is that value (see
    the module docstring). The code between the bodies (the later iterations'
    slicing, and its boxings) runs before the loop too."""
    decs, producer, available = prop.decisions, ctx.producer, ctx.available
    nc, ncarry = loop.n_consts, loop.n_carry
    t = its[0]

    between_bodies = set(between)

    def before_loop(v) -> set:
        return available(v, first) | {nd for i, nd in ctx.made_at.get(id(v), ()) if i in between_bodies}

    xs = []
    for j, x in enumerate(loop.xs):
        k = nc + ncarry + j
        wanted = set(needs.get(k, ()))
        if any(role(a) == ("in", k) for a in t.outs):
            where = producer.get(id(t.ins[k]))
            if where is None:
                return None
            wanted.add(tuple(decs[where[0]].out_sbp[where[1]]))
        for nd in sorted(wanted, key=repr):
            sliced = set()
            for it in its:
                where = producer.get(id(it.ins[k]))
                sliced.add(None if where is None else tuple(decs[where[0]].out_sbp[where[1]]))
            if sliced == {nd} and (
                all(isinstance(s, Broadcast) for s in nd)
                if isinstance(x, Const)
                else shift_up(nd) in available(x, first)
            ):
                xs.append((k, nd, x))
            elif all(nd in before_loop(it.ins[k]) for it in its):
                xs.append((k, nd, None))
            else:
                return None
    return xs


def _slicing_reads_before(decs, loop, producer, first, between) -> bool:
    """Whether the code between the bodies (slicing the stacked operands for
    later iterations; it may serve code after the loop: equal slices merge)
    reads nothing the run makes: it runs before the loop."""
    slice_made: set = set()
    xs_ids = {id(x) for x in loop.xs}
    for i in between:
        if not all(
            isinstance(a, Const)
            or id(a) in xs_ids
            or id(a) in slice_made
            or id(a) not in producer
            or producer[id(a)][0] < first
            for a in decs[i].node.ins
        ):
            return False
        slice_made.update(id(v) for v in decs[i].node.outs)
    return True
