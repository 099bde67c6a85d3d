"""The local program's control flow: written-out scans run as ``lax.scan``,
written-out conds as ``lax.switch``.

:class:`sbpjax.compiler.lower.LocalProgram` walks the decisions in program
order and hands a run (:mod:`sbpjax.compiler.loops`) to :func:`roll` and a
switch (:mod:`sbpjax.compiler.switches`) to :func:`switch`; both walk their
bodies with it again. ``lp`` is that walker: its ``prop``, ``grid``,
``read``, ``settled``, ``box`` and ``walk``. Values live in ``env``, keyed
``(id(Var), layout)``, as in the walk.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.lower import run_plan
from sbpjax.compiler.loop_exits import shift_up
from sbpjax.rules import local_shape

STACKED = "stacked"  # env key tag: (STACKED, id(Var), layout) -> (a loop's stacked output, index)


def switch(lp, sw, env: dict, template) -> None:
    """A written-out cond as one lax.switch (sbpjax.compiler.switches)."""
    prop = lp.prop
    for b in sw.before:
        lp.box(env, b)
    sel = [prop.decisions[i] for i in sw.selects]
    index = lp.read(env, sw.cond.index, sel[0].in_sbp[0])

    def branch(k):
        def run_branch():
            inner = dict(env)  # values from before the cond are closed over
            lp.walk(sw.branches[k], inner, template, sw.depth + 1)
            for b in sw.cases[k]:
                lp.box(inner, b)
            outs = []
            for d in sel:
                out, nd = d.node.outs[0], d.out_sbp[0]
                y = lp.read(inner, d.node.ins[1 + k], d.in_sbp[1 + k])
                outs.append(jnp.broadcast_to(y, local_shape(out.shape, nd, lp.grid)).astype(out.dtype))
            return outs

        return run_branch

    outs = lax.switch(index, [branch(k) for k in range(sw.cond.n_branches)])
    for d, y in zip(sel, outs):
        env[(id(d.node.outs[0]), d.out_sbp[0])] = y


def _stacked(lp, env: dict, vs: list, nd):
    """The values ``vs`` (layout ``nd``, consecutive loop indices) as
    ``(array, index of vs[0] in it, [(position in vs, value)])``: the loop
    output they came from where they are its consecutive slices, but for the
    values listed (made outside that loop's run, the body selects them), else
    a new stack of all."""
    where = [env.get((STACKED, id(v), nd)) for v in vs]
    known = [(m, w) for m, w in enumerate(where) if w is not None]
    if known:
        whole, off = known[0][1][0], known[0][1][1] - known[0][0]
        if all(w[0] is whole and w[1] == m + off for m, w in known):
            return (
                whole,
                off,
                [(m, lp.read(env, v, nd)) for m, (v, w) in enumerate(zip(vs, where)) if w is None],
            )
    return jnp.stack([lp.read(env, v, nd) for v in vs]), 0, []


def roll(lp, run, env: dict, depth: int = 0) -> None:
    """A run of alike iterations as one lax.scan over its template's body."""
    lp.walk(run.slices, env, depth=depth)
    for b in run.hoisted:
        lp.box(env, b)
    lo = min(run.indices)
    sources = _sources(lp, run, env, lo)
    init, placeholders = _carries_in(lp, run, env)
    buffered, stacked_out = _escapes(run)
    n_state = len(init)
    init += _buffers(lp, run, buffered)
    # the iteration's index is carried, not scanned over as an arange: XLA fuses a
    # slice of a scanned index array into every fusion that reads the index (69
    # slices in a 32-layer scanned GPT step's program), a carried scalar is read whole
    n = len(run.indices)
    init.append(jnp.int32(lo + n - 1 if run.loop.reverse else lo))
    step = _step(lp, run, env, depth, sources, buffered, stacked_out, n_state)
    final, ys = lax.scan(step, init, None, length=n, reverse=run.loop.reverse)
    _results(run, env, lo, final[:-1], ys, n_state, buffered, stacked_out, placeholders)


def _sources(lp, run, env: dict, lo: int) -> list:
    """Per sliced input of the body: (stack, loop index of its first, values
    outside the stack). Each slice is indexed out of its whole stack inside
    the body (slicing the run's part out first would copy it)."""
    by_index = sorted((run.loop.iterations[q] for q in run.positions), key=lambda it: it.index)
    sources: list = []
    for k, nd, x in run.xs:
        if x is not None:
            sources.append((lp.read(env, x, shift_up(nd)), 0, []))
        else:
            whole, off, extra = _stacked(lp, env, [it.ins[k] for it in by_index], nd)
            sources.append((whole, lo - off, [(lo + m, y) for m, y in extra]))
    return sources


def _carries_in(lp, run, env: dict) -> tuple[list, set]:
    """The carries' values coming in, each in every layout the body reads,
    and the keys of those that only hold a place."""
    t, nc = run.template, run.loop.n_consts
    init, placeholders = [], set()
    for c, layouts in run.carries:
        v = t.ins[nc + c]
        for nd in layouts:
            held = env.get((id(v), nd))
            if held is None:
                # a layout the body makes before reading it needs no value in: zeros hold
                # its place (and are no value of the carry coming in: see _results)
                held = jnp.zeros(local_shape(v.shape, nd, lp.grid), v.dtype)
                placeholders.add((id(v), nd))
            init.append(held)
    return init, placeholders


def _escapes(run) -> tuple[list, list]:
    """The values the loop hands on, one slice per iteration, as (escape,
    layout): those a stack of all the loop's slices reads (Run.stacks) are
    written into that stack in place (a buffer carried through the loop: the
    other iterations fill their slices after it), the others stacked by the
    scan."""
    outs = [
        (e, nd)
        for e, (key, layouts, _) in enumerate(run.escapes)
        if key not in run.last_only
        for nd in layouts
    ]
    into = {(key, nd) for _, key, nd, missing, _ in run.stacks if missing}
    buffered = [(e, nd) for e, nd in outs if (run.escapes[e][0], nd) in into]
    return buffered, [(e, nd) for e, nd in outs if (e, nd) not in buffered]


def _buffers(lp, run, buffered: list) -> list:
    n_all = len(run.loop.iterations)
    bufs = []
    for e, nd in buffered:
        v = run.escapes[e][2][0]
        push = run.pushed.get((run.escapes[e][0], nd))
        held = nd if push is None else push[2]
        bufs.append(jnp.zeros((n_all, *local_shape(v.shape, held, lp.grid)), v.dtype))
    return bufs


def _step(lp, run, env: dict, depth: int, sources, buffered, stacked_out, n_state: int):
    """The scan's body: the template's decisions on one iteration's slices."""
    t, nc = run.template, run.loop.n_consts

    def step(state, _):
        *state, index = state
        inner = dict(env)  # values from before the loop are closed over
        it = iter(state[:n_state])
        for c, layouts in run.carries:
            for nd in layouts:
                inner[(id(t.ins[nc + c]), nd)] = next(it)
        for (k, nd, _), (whole, base, extra) in zip(run.xs, sources):
            piece = lax.dynamic_index_in_dim(
                whole, index - base, 0, keepdims=False, allow_negative_indices=False
            )
            for i, y in extra:  # (an index outside ``whole`` is clamped, then replaced)
                piece = jnp.where(index == i, y, piece)
            inner[(id(t.ins[k]), nd)] = piece
        lp.walk(run.bodies[0], inner, run, depth)
        for c, b in run.rotated:  # the next iteration's boxings of its carry
            inner[(id(t.outs[c]), b.dst)] = run_plan(b.plan, lp.settled(inner, t.outs[c], b.src))
        carry = [inner[(id(t.outs[c]), nd)] for c, layouts in run.carries for nd in layouts]

        def out(e, nd):
            v = run.escapes[e][2][0]
            push = run.pushed.get((run.escapes[e][0], nd))
            # a stack boxed as a whole after the loop: each slice boxed here instead
            return inner[(id(v), nd)] if push is None else run_plan(push[1], lp.settled(inner, v, nd))

        for (e, nd), buf in zip(buffered, state[n_state:]):
            carry.append(
                lax.dynamic_update_index_in_dim(buf, out(e, nd), index, 0, allow_negative_indices=False)
            )
        carry.append(index - 1 if run.loop.reverse else index + 1)
        return carry, [out(e, nd) for e, nd in stacked_out]

    return step


def _results(run, env: dict, lo: int, final, ys, n_state: int, buffered, stacked_out, placeholders) -> None:
    """What the loop made, into ``env``: the last carries, each iteration's
    slice of the stacked outputs, and the stacks themselves."""
    its = [run.loop.iterations[q] for q in run.positions]
    state = iter(final[:n_state])
    for c, layouts in run.carries:
        for nd in layouts:
            env[(id(its[-1].outs[c]), nd)] = next(state)
    made_at = {}
    for (e, nd), stack in [*zip(stacked_out, ys), *zip(buffered, final[n_state:])]:
        if (run.escapes[e][0], nd) in run.pushed:
            made_at[(run.escapes[e][0], nd)] = stack
            continue
        base = 0 if (e, nd) in buffered else lo
        for it, v in zip(its, run.escapes[e][2]):
            if (id(v), nd) in placeholders:
                # the carry coming into the first iteration, read after the loop in a
                # layout it did not come in: its slice holds the placeholder, and the
                # code after the loop boxes the carry itself (a scan's input kept as
                # the backward pass's first residual, split where the body splits it)
                continue
            env[(id(v), nd)] = stack[it.index - base]
            env[(STACKED, id(v), nd)] = (stack, it.index - base)
        made_at[(run.escapes[e][0], nd)] = stack
    for var, key, nd, missing, _ in run.stacks:
        push = run.pushed.get((key, nd))
        if push is not None and not missing:  # boxed already: its own boxing then finds it done
            env[(id(var), push[0].dst)] = made_at[(key, nd)]
            continue
        # the stack itself, or (with slices of other iterations to come) the buffer
        env[(STACKED, id(var)) if missing else (id(var), shift_up(nd))] = made_at[(key, nd)]
