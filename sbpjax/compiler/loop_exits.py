"""What leaves a rolled loop (:mod:`sbpjax.compiler.loops`): the layouts of
a stack and of its slices, the stacks of ``ys`` the loop fills in place, the
whole-stack boxings it runs slice by slice, and the values code after the
run reads.

A ``jnp.stack`` of a loop's slices reads them in a layout whose stacked dim
(dim 0) is whole: :func:`shift_up` and :func:`shift_down` move an nd-SBP
between a slice and its stack.
"""

from __future__ import annotations

from sbpjax.boxing.plan import plan_boxing
from sbpjax.sbp import Split


def shift_up(nd) -> tuple:
    """The layout of a stack of values laid out ``nd``: a new, unsplit dim 0."""
    return tuple(Split(s.dim + 1) if isinstance(s, Split) else s for s in nd)


def shift_down(nd) -> tuple:
    """The layout of one value of a stack laid out ``nd`` (dim 0 unsplit)."""
    return tuple(Split(s.dim - 1) if isinstance(s, Split) else s for s in nd)


def carry_input(loop, r) -> int | None:
    """The iteration's input index of the carry whose role (``loop_state.roles``) is
    ``r``: the carry as it came into the iteration; None for any other value."""
    if r[0] == "in" and loop.n_consts <= r[1] < loop.n_consts + loop.n_carry:
        return r[1]
    return None


def pushed_boxings(ctx, stacks, escapes) -> dict:
    """The boxings of whole stacks that run slice by slice inside the loop.

    A stack of the loop's slices boxed as a whole after it (the gradients of
    stacked layers, summed over the data axis once the backward loop is done)
    holds every slice in the source layout until then; boxed in the loop, each
    slice is written to the stack in its final layout (as GSPMD reduces a
    scanned layer's gradient in the loop body), with the same bytes: the
    boxing's collectives act on every slice alike, so their bytes add up (the
    plan's bytes are checked to). Only where the stack has no other use, its
    boxing leaves the stacked dim whole (slices of iterations outside the run
    are boxed alike before they are written to it)."""
    template = {key: vs[0] for key, _, vs in escapes}
    out: dict = {}
    for var, key, nd, _, _ in stacks:
        boxes = ctx.boxings_of.get(id(var), [])
        if len(boxes) != 1:
            continue
        at, b = boxes[0]
        whole = shift_up(nd)
        if tuple(b.src) != whole or any(isinstance(s, Split) and s.dim == 0 for s in b.dst):
            continue
        reads = ctx.reads.get(id(var), ())
        if any(nd2 != tuple(b.src) and nd2 != tuple(b.dst) for _, nd2 in reads):
            continue
        # the stack read as it is made only by its boxing: boxed in the loop, it is never whole in
        # that layout (a mean of a scan's outputs beside their zero-filled partial read it so)
        if [i for i, nd2 in reads if nd2 == tuple(b.src)] != [at]:
            continue
        dst = shift_down(b.dst)
        y = template[key]
        plan = plan_boxing(y.shape, y.dtype, ctx.placement, nd, dst)
        if plan.bytes * var.shape[0] != b.bytes:
            continue
        out[(key, nd)] = (b, plan, dst)
    return out


def boxed_after(ctx, wanted, last) -> bool:
    """Whether code after decision ``last`` boxes each (value, layout) itself."""
    return all(any(i > last and nd == want for i, nd in ctx.made_at.get(id(v), ())) for v, want in wanted)


def direct_stacks(prop, loop, its, role, escapes, ctx, entering):
    """The stacks of ``ys`` (``jnp.stack`` of the slices: jax's stack op, or one
    expand-dims per slice and a concatenate) whose slices the rolled iterations
    make in the layout the stack reads, so the lowering writes the loop's
    slices straight into the stack (and those of iterations outside the run
    into it after them) instead of concatenating the slices again, a copy of
    every residual. Returns ``(stacks, dropped)``: (stacked Var, template
    position, output, slice layout, [(index, slice Var) of the other
    iterations], index of the stacking decision) per such stack, and the
    decision indices of the ops it replaces. A stack of the carry as it comes
    into each iteration is filled by the loop only in a layout the first
    iteration's carry has (``entering``): in another, the loop's state holds a
    placeholder there (``lower.roll``), and the stack boxes that carry itself."""
    decs, producer = prop.decisions, ctx.producer
    escaped = {key: layouts for key, layouts, _ in escapes}
    rolled = {it.index for it in its}
    by_index = {it.index: it for it in loop.iterations}
    stacks, dropped = [], set()
    n_carry = loop.n_carry
    n = len(loop.iterations)
    for k, var in enumerate(loop.stacked):
        r = role(its[0].outs[n_carry + k])
        where = producer.get(id(var))
        if r not in escaped or where is None or sorted(by_index) != list(range(n)):
            continue
        c_in = carry_input(loop, r)
        came_in = None if c_in is None else entering.get(c_in, set())
        cat = decs[where[0]]
        if cat.boxings or len(cat.node.ins) != n:
            continue
        whole = tuple(cat.out_sbp[0])
        ys = [by_index[m].outs[n_carry + k] for m in range(n)]
        missing = [(m, ys[m]) for m in range(n) if m not in rolled]
        if all(a is y for a, y in zip(cat.node.ins, ys)):
            # one op stacks the slices (jax's stack primitive)
            nd = tuple(cat.in_sbp[0])
            if (
                all(tuple(s) == nd for s in cat.in_sbp)
                and shift_up(nd) == whole
                and nd in escaped[r]
                and (came_in is None or nd in came_in)
            ):
                stacks.append((var, r, nd, missing, where[0]))
                dropped.add(where[0])
            continue
        if cat.node.name != "concatenate":
            continue
        # expand_dims of each slice, then a concatenate (jnp.stack where jax has no stack op)
        ops, ok, nd = [where[0]], True, None
        for m, e in enumerate(cat.node.ins):
            at = producer.get(id(e))
            readers = {i for i, _ in ctx.reads.get(id(e), ())}
            if at is None or tuple(cat.in_sbp[m]) != whole or readers != {where[0]}:
                ok = False
                break
            ex = decs[at[0]]
            nd = tuple(ex.in_sbp[0]) if ex.node.ins else None
            if (
                len(ex.node.ins) != 1
                or ex.node.ins[0] is not ys[m]
                or ex.boxings
                or shift_up(nd) != whole
                or tuple(ex.out_sbp[0]) != whole
                or nd not in escaped[r]
            ):
                ok = False
                break
            ops.append(at[0])
        if ok and (came_in is None or nd in came_in):
            stacks.append((var, r, nd, missing, where[0]))
            dropped.update(ops)
    return stacks, dropped


def escapes_read_after(ctx, escapes, stacks, pushed, dropped, carry_out, n_rolled, last):
    """The escapes (key, layouts, the Var in each rolled iteration) that code
    after the run reads, other than by the stacks the loop fills, each with
    the layouts it is read in; and the keys of carries read after the run
    only in the last iteration (the loop's final state, ``Run.last_only``).
    ``carry_out``: the keys of the carries the body makes; ``last``: the
    run's last decision index; ``dropped``: the stacking ops the loop replaces."""
    feeds = {key for _, key, _, _, _ in stacks}
    fed = {(key, nd) for _, key, nd, _, _ in stacks}
    kept, last_only = [], set()
    for key, layouts, vs in escapes:
        after = [
            {nd for i, nd in ctx.reads.get(id(v), ()) if i == -1 or (i > last and i not in dropped)}
            for v in vs
        ]
        # a stack whose boxing runs inside the loop takes the boxed slices instead
        fed_here = {nd for _, k2, nd, _, _ in stacks if k2 == key}
        if fed_here and all((key, nd) in pushed for nd in fed_here) and not any(after):
            kept.append((key, [nd for nd in layouts if (key, nd) in pushed], vs))
            continue
        used = [m for m, a in enumerate(after) if a]
        layouts = [nd for nd in layouts if (key, nd) in fed or any(nd in a for a in after)]
        if not layouts:
            continue
        kept.append((key, layouts, vs))
        if used == [n_rolled - 1] and key in carry_out and key not in feeds:
            last_only.add(key)
    return kept, last_only


__all__ = [
    "shift_up",
    "shift_down",
    "carry_input",
    "boxed_after",
    "pushed_boxings",
    "direct_stacks",
    "escapes_read_after",
]
