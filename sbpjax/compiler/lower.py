"""Lowering a propagated program to one ``jax.jit(shard_map(...))``.

The body runs the program on local tensors: before each equation its inputs
are boxed (the boxing steps of :mod:`sbpjax.boxing.lower`, inside the same
``shard_map``), then the primitive runs on the local pieces, with shape
parameters made local by its rule. Inputs and outputs use the physical form of
global tensors (one leading dim per partial axis).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax.boxing.lower import group_index, run_plan
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler import uneven
from sbpjax.compiler.buckets import plan_buckets, run_bucket
from sbpjax.compiler.loop_exits import shift_up
from sbpjax.compiler.loops import plan_runs
from sbpjax.compiler.program import Const, Var
from sbpjax.compiler.propagation import CONSTRAIN, NESTED, Propagation
from sbpjax.compiler.switches import plan_switches
from sbpjax.layout import Geometry
from sbpjax.rules import RULES, local_shape, split_axes
from sbpjax.sbp import Partial


class LocalCtx:
    """What a rule's local evaluation may ask about the current equation."""

    def __init__(self, placement, in_nd, out_nd, out_shapes, in_keys=None, shared=None):
        self.placement = placement
        self.grid = placement.shape
        self.in_nd = in_nd
        self.out_nd = out_nd
        self.local_out_shapes = [local_shape(s, nd, self.grid) for s, nd in zip(out_shapes, out_nd)]
        self._in_keys = in_keys
        self._shared = shared if shared is not None else {}

    def memo(self, operand: int, detail, make):
        """``make()``, computed once per program for the same input value (in
        the same layout) and ``detail``: ops that send the same data (a halo
        exchange read by a convolution and by its kernel gradient) share it."""
        if self._in_keys is None:
            return make()
        key = (self._in_keys[operand], detail)
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    @staticmethod
    def is_split(nd, dim) -> bool:
        return bool(split_axes(nd, dim))

    def offset(self, nd, shape, dim):
        """Where this device's piece starts along ``dim``."""
        axes = split_axes(nd, dim)
        if not axes:
            return 0
        p = math.prod(self.grid[a] for a in axes)
        if shape[dim] % p:
            return uneven.piece(shape[dim], axes, self.placement.axis_names, self.grid)[0]
        return group_index(axes, self.placement.axis_names, self.grid) * (shape[dim] // p)


STACKED = "stacked"  # env key tag: (STACKED, id(Var), layout) -> (a loop's stacked output, index)


def _default_local(eqn, ins, ctx):
    params = dict(eqn.params)
    outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _after(xs: list, anchor: tuple) -> list:
    """``xs`` unchanged, but computed after ``anchor``: a regather's sources
    (sbpjax.compiler.regather). An optimization barrier does not do it: XLA's
    CPU pipeline removes barriers before scheduling, and its scheduler then
    ran a regather (an all-gather of a parameter) at the start of the step,
    holding its result as long as the first gather's. Instead each source's
    bits are OR-ed with a zero that XLA only knows at run time (the minimum of
    an anchor element's bits and 0, unsigned), which leaves every bit as it
    is; float arithmetic would not (``x + -0.0`` flushes subnormals to zero on
    CPU). Sources of other dtypes (bool, complex), and anchors with no element,
    are left as they are."""
    seed = next((jnp.ravel(a)[0] for a in anchor if jnp.size(a)), None)
    if seed is None:
        return xs
    seed = seed.real if jnp.iscomplexobj(seed) else seed
    zero = jnp.minimum(lax.convert_element_type(seed, np.float32).view(np.uint32), 0)  # 0, opaque
    out = []
    for x in xs:
        dtype = np.dtype(x.dtype)
        if dtype.kind not in "fiu" or dtype.itemsize not in (1, 2, 4, 8):
            out.append(x)
            continue
        bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
        out.append(lax.bitcast_convert_type(lax.bitcast_convert_type(x, bits) | zero.astype(bits), x.dtype))
    return out


def build(prop: Propagation, donate: tuple[int, ...] = ()):
    """The jitted function of physical inputs -> physical outputs; ``donate``:
    indices of the inputs whose buffers the program may reuse (``jax.jit``'s
    ``donate_argnums``)."""
    pl = prop.placement
    grid, names = pl.shape, pl.axis_names
    prog = prop.program

    def specs(vars_, nds):
        return tuple(
            Geometry(v.shape, grid).partition_spec(normalized_layout(nd, len(v.shape), grid), names)
            for v, nd in zip(vars_, nds)
        )

    mapped = jax.shard_map(
        local_program(prop),
        mesh=pl.mesh,
        in_specs=specs(prog.inputs, prop.in_sbp),
        out_specs=specs(prog.outputs, prop.out_sbp),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=tuple(donate))


def local_program(prop: Propagation, physical: bool = True):
    """The program as one device runs it, inside a ``shard_map`` over the
    placement's mesh: local blocks in, local blocks out (``physical``: a
    partial's block with a leading dim of 1 per partial axis, as its physical
    array has). ``build`` maps it over the mesh; the body of a loop planned
    on its own runs it in each iteration, on plain blocks
    (:mod:`sbpjax.compiler.inner_loops`)."""
    pl = prop.placement
    grid, names = pl.shape, pl.axis_names
    prog = prop.program

    def n_partial(nd):  # leading physical dims: one per partial axis of size > 1
        if not physical:
            return 0
        return sum(isinstance(s, Partial) and grid[a] > 1 for a, s in enumerate(nd))

    # written-out scans whose iterations are alike run as loops (sbpjax.compiler.loops)
    runs = plan_runs(prop)
    run_at = {r.first: r for r in runs}
    dropped = {i for r in runs for i in r.dropped}
    finish = {
        i: (var, nd, missing, r.pushed.get((key, nd)))
        for r in runs
        for var, key, nd, missing, i in r.stacks
        if missing
    }
    hoisted = {id(b) for r in runs for b in r.hoisted}
    zones: dict = {}
    for n, r in enumerate(runs):
        for m, body_ in enumerate(r.bodies):
            for i in body_:
                for b in prop.decisions[i].boxings:
                    zones[id(b)] = (*zones.get(id(b), ()), (n, "before" if id(b) in hoisted else m))
        # the code between the bodies runs before the loop: its boxings join only each other
        for i in r.slices:
            for b in prop.decisions[i].boxings:
                zones[id(b)] = (*zones.get(id(b), ()), (n, "slices"))

    for r in runs:
        # boxings a loop ran already (Run.pushed, Run.done) run alone, so box() can skip them
        for b in [b for b, _, _ in r.pushed.values()] + r.done:
            zones[id(b)] = (("done in a loop", id(b)),)
    # written-out conds that run as lax.switch (sbpjax.compiler.switches): a bucket
    # stays inside one branch, or outside them all
    switches, places = plan_switches(prop, runs)
    for b_id, place in places.items():
        zones[b_id] = (*zones.get(b_id, ()), ("branch", place))
    switch_at: dict = {}  # first decision index -> the switches starting there (nested ones share it)
    for sw in switches.values():
        switch_at.setdefault(sw.span[0], []).append(sw)
    before_switch = {id(b) for sw in switches.values() for b in sw.before}
    # a regather runs at its consumer, after the value it is anchored to
    # (sbpjax.compiler.regather): it joins only the regathers of that consumer
    for i, dec in enumerate(prop.decisions):
        for b in dec.boxings:
            if b.regather:
                zones[id(b)] = ("regather", i)
    # boxings that run the same collectives run together (sbpjax.compiler.buckets)
    buckets, joined = plan_buckets(prop, zones=zones)

    # jax.checkpoint regions (sbpjax.compiler.trace.REMAT): the Vars each reads from outside it
    produced: dict = {}
    region_inputs: dict = {}
    for dec in prop.decisions:
        r = dec.node.region
        if r:
            made = produced.setdefault(r, set())
            region_inputs.setdefault(r, set()).update(
                id(a) for a in dec.node.ins if isinstance(a, Var) and id(a) not in made
            )
            made.update(id(o) for o in dec.node.outs)

    def read(env, atom, nd):
        key = (id(atom), nd)
        if key in env:
            return env[key]
        return jnp.asarray(atom.value)  # a constant, used as B

    def settled(env, atom, nd):
        """The value with its padded positions (uneven splits) holding the
        identity of its partial, as boxing and results expect."""
        x = read(env, atom, nd)
        return uneven.fill_holes(x, atom.shape, nd, names, grid, uneven.holes_op(nd))

    def box(env, b, anchor=()):
        """Run boxing ``b`` (with its bucket); a regather's sources are made
        to depend on ``anchor`` (values the op before its consumer made, see
        ``_after``)."""
        if id(b) in joined:  # ran earlier, with its bucket
            return
        bucket = buckets.get(id(b))
        if bucket is None and not b.regather and (id(b.var), b.dst) in env:
            return  # a rolled loop made it already (Run.done, Run.pushed)
        members = [b] if bucket is None else bucket.boxings
        srcs = [settled(env, c.var, c.src) for c in members]
        if b.regather and anchor:
            srcs = _after(srcs, anchor)
        if bucket is None:
            env[(id(b.var), b.dst)] = run_plan(b.plan, srcs[0])
            return
        ys = run_bucket(bucket, srcs)
        for c, y in zip(bucket.boxings, ys):
            env[(id(c.var), c.dst)] = y

    def walk(indices, env, template=None, depth=0):
        """Run these decisions (program order) on local pieces held in ``env``
        (``template``: the run whose body these are; ``depth``: how many
        switches' branches they lie in)."""
        entered: set = set()
        shared: dict = {}  # what ops' own communication made (LocalCtx.memo)
        anchor: tuple = ()  # the last outputs with an element (a regather waits for them)
        k = 0
        while k < len(indices):
            i = indices[k]
            run = run_at.get(i)
            sw = next((w for w in switch_at.get(i, ()) if w.depth == depth), None)
            if sw is not None and run is not None and run is not template and run.last > sw.span[1]:
                sw = None  # the cond lies in the loop's first iteration: the loop runs it
            if sw is not None:
                switch(sw, env, template)
                while k < len(indices) and indices[k] in sw.members:
                    k += 1
                continue
            if run is not None and run is not template:
                roll(run, env, depth)
                while k < len(indices) and indices[k] <= run.last:
                    k += 1
                continue
            k += 1
            if i in dropped:
                if i in finish:  # a stack the loop filled, but for the slices made outside it
                    var, nd, missing, push = finish[i]
                    buf = env[(STACKED, id(var))]
                    for m, y in missing:
                        y = read(env, y, nd) if push is None else run_plan(push[1], settled(env, y, nd))
                        buf = lax.dynamic_update_index_in_dim(buf, y, m, 0)
                    env[(id(var), shift_up(nd) if push is None else push[0].dst)] = buf
                continue
            dec = prop.decisions[i]
            r = dec.node.region
            if r and r not in entered:
                # one optimization barrier over every value the region reads from outside,
                # in every layout present, as jax.jit lowers a checkpoint: the recomputation
                # can be neither merged with the forward pass nor run before its inputs
                entered.add(r)
                keys = [key for key in env if key[0] in region_inputs[r]]
                if keys:
                    env.update(zip(keys, lax.optimization_barrier(tuple(env[key] for key in keys))))
            for b in dec.boxings:
                if id(b) not in hoisted and id(b) not in before_switch:
                    box(env, b, anchor)
            node = dec.node
            ins = [read(env, a, nd) for a, nd in zip(node.ins, dec.in_sbp)]
            # a reduction over an uneven split reads identities in the padding
            for j, op in uneven.reduced_operands(dec.in_sbp, dec.out_sbp, [a.shape for a in node.ins], grid):
                ins[j] = uneven.fill_holes(ins[j], node.ins[j].shape, dec.in_sbp[j], names, grid, op)
            if node.name == CONSTRAIN:
                outs = ins
            else:
                rule = RULES.get(node.name)
                keys = [(id(a), nd) for a, nd in zip(node.ins, dec.in_sbp)]
                ctx = LocalCtx(pl, dec.in_sbp, dec.out_sbp, [o.shape for o in node.outs], keys, shared)
                if node.name in NESTED:  # runs a planned program of its own
                    local = NESTED[node.name].local
                elif rule is not None and rule.local is not None:
                    local = rule.local
                else:
                    local = _default_local
                outs = local(node.eqn, ins, ctx)
            for v, nd, y in zip(node.outs, dec.out_sbp, outs):
                env[(id(v), nd)] = y
            if any(jnp.size(y) for y in outs):
                anchor = tuple(outs)

    def switch(sw, env, template):
        """A written-out cond as one lax.switch (sbpjax.compiler.switches)."""
        for b in sw.before:
            box(env, b)
        sel = [prop.decisions[i] for i in sw.selects]
        index = read(env, sw.cond.index, sel[0].in_sbp[0])

        def branch(k):
            def run_branch():
                inner = dict(env)  # values from before the cond are closed over
                walk(sw.branches[k], inner, template, sw.depth + 1)
                for b in sw.cases[k]:
                    box(inner, b)
                outs = []
                for d in sel:
                    out, nd = d.node.outs[0], d.out_sbp[0]
                    y = read(inner, d.node.ins[1 + k], d.in_sbp[1 + k])
                    outs.append(jnp.broadcast_to(y, local_shape(out.shape, nd, grid)).astype(out.dtype))
                return outs

            return run_branch

        outs = lax.switch(index, [branch(k) for k in range(sw.cond.n_branches)])
        for d, y in zip(sel, outs):
            env[(id(d.node.outs[0]), d.out_sbp[0])] = y

    def stacked(env, vs, nd):
        """The values ``vs`` (layout ``nd``, consecutive loop indices) as
        ``(array, index of vs[0] in it, [(position in vs, value)])``: the
        loop output they came from where they are its consecutive slices, but
        for the values listed (made outside that loop's run, the body selects
        them), else a new stack of all."""
        where = [env.get((STACKED, id(v), nd)) for v in vs]
        known = [(m, w) for m, w in enumerate(where) if w is not None]
        if known:
            whole, off = known[0][1][0], known[0][1][1] - known[0][0]
            if all(w[0] is whole and w[1] == m + off for m, w in known):
                return (
                    whole,
                    off,
                    [(m, read(env, v, nd)) for m, (v, w) in enumerate(zip(vs, where)) if w is None],
                )
        return jnp.stack([read(env, v, nd) for v in vs]), 0, []

    def roll(run, env, depth=0):
        """A run of alike iterations as one lax.scan over its template's body."""
        loop, t = run.loop, run.template
        nc = loop.n_consts
        walk(run.slices, env, depth=depth)
        for b in run.hoisted:
            box(env, b)
        lo = min(run.indices)
        length = len(run.indices)
        by_index = sorted((loop.iterations[q] for q in run.positions), key=lambda it: it.index)
        # each slice read is indexed out of its whole stack inside the body (slicing
        # the run's part out first would copy it): (stack, loop index of its first)
        sources = []
        for k, nd, x in run.xs:
            if x is not None:
                sources.append((read(env, x, shift_up(nd)), 0, []))
            else:
                whole, off, extra = stacked(env, [it.ins[k] for it in by_index], nd)
                sources.append((whole, lo - off, [(lo + m, y) for m, y in extra]))
        xs = [jnp.arange(lo, lo + length)]
        init = []
        placeholders = set()
        for c, layouts in run.carries:
            v = t.ins[nc + c]
            for nd in layouts:
                held = env.get((id(v), nd))
                if held is None:
                    # a layout the body makes before reading it needs no value in: zeros hold
                    # its place (and are no value of the carry coming in: see the escapes)
                    held = jnp.zeros(local_shape(v.shape, nd, grid), v.dtype)
                    placeholders.add((id(v), nd))
                init.append(held)
        # values the loop hands on, one slice per iteration: where a stack of all the
        # loop's slices reads them (Run.stacks), written into that stack in place
        # (a buffer carried through the loop: the other iterations fill their
        # slices after it), else stacked by the scan
        n_all = len(loop.iterations)
        outs = [
            (e, nd)
            for e, (key, layouts, _) in enumerate(run.escapes)
            if key not in run.last_only
            for nd in layouts
        ]
        into = {(key, nd) for _, key, nd, missing, _ in run.stacks if missing}
        buffered = [(e, nd) for e, nd in outs if (run.escapes[e][0], nd) in into]
        stacked_out = [(e, nd) for e, nd in outs if (e, nd) not in buffered]
        for e, nd in buffered:
            v = run.escapes[e][2][0]
            push = run.pushed.get((run.escapes[e][0], nd))
            held = nd if push is None else push[2]
            init.append(jnp.zeros((n_all, *local_shape(v.shape, held, grid)), v.dtype))
        tbody = run.bodies[0]
        n_state = sum(len(layouts) for _, layouts in run.carries)

        def step(state, slices):
            inner = dict(env)  # values from before the loop are closed over
            it = iter(state[:n_state])
            for c, layouts in run.carries:
                for nd in layouts:
                    inner[(id(t.ins[nc + c]), nd)] = next(it)
            (index,) = slices
            for (k, nd, _), (whole, base, extra) in zip(run.xs, sources):
                piece = lax.dynamic_index_in_dim(whole, index - base, 0, keepdims=False)
                for i, y in extra:  # (an index outside ``whole`` is clamped, then replaced)
                    piece = jnp.where(index == i, y, piece)
                inner[(id(t.ins[k]), nd)] = piece
            walk(tbody, inner, run, depth)
            for c, b in run.rotated:  # the next iteration's boxings of its carry
                inner[(id(t.outs[c]), b.dst)] = run_plan(b.plan, settled(inner, t.outs[c], b.src))
            carry = [inner[(id(t.outs[c]), nd)] for c, layouts in run.carries for nd in layouts]

            def out(e, nd):
                v = run.escapes[e][2][0]
                push = run.pushed.get((run.escapes[e][0], nd))
                # a stack boxed as a whole after the loop: each slice boxed here instead
                return inner[(id(v), nd)] if push is None else run_plan(push[1], settled(inner, v, nd))

            for (e, nd), buf in zip(buffered, state[n_state:]):
                carry.append(lax.dynamic_update_index_in_dim(buf, out(e, nd), index, 0))
            return carry, [out(e, nd) for e, nd in stacked_out]

        final, ys = lax.scan(step, init, xs, length=length, reverse=loop.reverse)
        its = [loop.iterations[q] for q in run.positions]
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

    def body(*blocks):
        env: dict = {}
        for v, nd, x in zip(prog.inputs, prop.in_sbp, blocks):
            env[(id(v), nd)] = x.reshape(x.shape[n_partial(nd) :])
        walk(range(len(prop.decisions)), env)
        for b in prop.out_boxings:
            box(env, b)
        results = []
        for atom, nd in zip(prog.outputs, prop.out_sbp):
            y = read(env, atom, nd)
            if isinstance(atom, Const):
                y = jnp.broadcast_to(y, local_shape(atom.shape, nd, grid))
            y = uneven.fill_holes(y, atom.shape, nd, names, grid, uneven.holes_op(nd))
            results.append(y.reshape((1,) * n_partial(nd) + y.shape))
        return tuple(results)

    return body
