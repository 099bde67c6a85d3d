"""A rolled run's loop state (:mod:`sbpjax.compiler.loops`): how the body
reads its carries, slices and outer values, what it leaves behind, and the
:class:`Run` that holds them.

:func:`roles` names each value an iteration reads by what it is to the body
(made by its ``p``-th op, its ``k``-th input, an outer value, a constant), so
that iterations running the same program read alike. :func:`check_run` takes
iterations the search found alike and works out the loop state they read
from one iteration to the next (see the ``loops`` docstring), or refuses them.
"""

from __future__ import annotations

import dataclasses

from sbpjax.compiler.loop_exits import (
    boxed_after,
    carry_input,
    direct_stacks,
    escapes_read_after,
    pushed_boxings,
    shift_up,
)
from sbpjax.compiler.program import Const, Loop
from sbpjax.dtypes import constant_bits
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
      fills directly (:func:`~sbpjax.compiler.loop_exits.direct_stacks`); ``dropped``: the decisions they
      replace; ``pushed``: (escape key, layout) -> (the stack's Boxing, the
      slice's BoxingPlan, its dst): stacks boxed slice by slice in the loop
      (:func:`~sbpjax.compiler.loop_exits.pushed_boxings`).
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


def plan_key(plan) -> tuple:
    """A boxing's steps as iterations are compared by: two boxings between the
    same layouts may run different steps (zeros made afresh for a carry known
    to be zeros, a gather for the same carry later)."""
    return tuple((st.op, st.axes, st.dim, st.dim2, st.reduce) for st in plan.steps)


def roles(prop, loop, it, body):
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
            if getattr(v, "ndim", 0):
                return ("const", id(v))
            # by its bits, not repr: a scalar jax.Array's repr formats it on the host (~1 ms)
            return ("const", constant_bits(v).tobytes(), str(getattr(v, "dtype", type(v).__name__)))
        if id(a) in pos:
            return ("made", *pos[id(a)])
        if id(a) in it.made:
            return ("dead",)  # its op was dropped as dead code (a result no one reads)
        k = first_in.get(id(a))
        if k is not None and k >= loop.n_consts and k not in passthrough and k < n_in:
            return ("in", k)
        return (OUTER, id(a))

    return role, pos


def carry_boxings(prop, loop, it, body) -> list:
    """(carry, Boxing) of the iteration's boxings of the carries it reads."""
    role, _ = roles(prop, loop, it, body)
    found = []
    for i in body:
        for b in prop.decisions[i].boxings:
            k = carry_input(loop, role(b.var))
            if k is not None:
                found.append((k - loop.n_consts, b))
    return found


def check_run(prop, loop, bodies, positions, ctx, rotated, entry, after) -> Run | None:
    """The run of these iterations, or None where the body cannot read its
    carries and slices from a loop's state."""
    decs = prop.decisions
    its = [loop.iterations[q] for q in positions]
    t, tbody = its[0], bodies[positions[0]]
    nc = loop.n_consts
    role, pos = roles(prop, loop, t, tbody)
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
        role_q, _ = roles(prop, loop, loop.iterations[q], bodies[q])
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
    gradient is not taken: ``dead_code.last_carries``)."""
    its_last = loop.iterations[positions[-1]]
    nc = loop.n_consts
    # (layouts have no order: two carries boxed alike tie on the index)
    moved = sorted(((nc + c, b.src, b.dst, plan_key(b.plan)) for c, b in rotated), key=repr)
    if after is not None:
        if sorted((a[1:] for a in after), key=repr) != moved:
            return None
        q = positions[-1] + 1
        return [b for _, b in carry_boxings(prop, loop, loop.iterations[q], bodies[q])], []
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


__all__ = ["OUTER", "Run", "roles", "carry_boxings", "check_run"]
