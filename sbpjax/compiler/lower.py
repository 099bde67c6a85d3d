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

from sbpjax._errors import SBPError
from sbpjax.boxing.device_index import group_index
from sbpjax.boxing.lower import run_plan
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler import lower_control, uneven
from sbpjax.compiler.buckets import run_bucket
from sbpjax.compiler.local_plan import plan_local
from sbpjax.compiler.loop_exits import shift_up
from sbpjax.compiler.lower_control import STACKED
from sbpjax.compiler.program import Const, located
from sbpjax.compiler.propagation import CONSTRAIN, NESTED, Propagation
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
        return self.extent(nd, shape, dim)[0]

    def extent(self, nd, shape, dim):
        """(start, size) of this device's piece along ``dim``: on an uneven
        split its size without the padding its block has."""
        axes = split_axes(nd, dim)
        if not axes:
            return 0, shape[dim]
        p = math.prod(self.grid[a] for a in axes)
        if shape[dim] % p:
            return uneven.piece(shape[dim], axes, self.placement.axis_names, self.grid)
        return group_index(axes, self.placement.axis_names, self.grid) * (shape[dim] // p), shape[dim] // p


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
    return LocalProgram(prop, physical).body


class LocalProgram:
    """Runs the decisions in program order on local pieces held in an
    ``env`` keyed ``(id(Var), layout)``: each decision's boxings (with their
    buckets), then its op on the local pieces. Runs and switches
    (:mod:`sbpjax.compiler.local_plan`) go to
    :mod:`sbpjax.compiler.lower_control`, which walks their bodies here."""

    def __init__(self, prop: Propagation, physical: bool = True):
        self.prop = prop
        self.physical = physical
        self.grid = prop.placement.shape
        self.names = prop.placement.axis_names
        self.plan = plan_local(prop)

    def n_partial(self, nd) -> int:
        """Leading physical dims: one per partial axis of size > 1."""
        if not self.physical:
            return 0
        return sum(isinstance(s, Partial) and self.grid[a] > 1 for a, s in enumerate(nd))

    def body(self, *blocks):
        """The program on one device: its input blocks in, its output blocks out."""
        prop = self.prop
        env: dict = {}
        for v, nd, x in zip(prop.program.inputs, prop.in_sbp, blocks):
            env[(id(v), nd)] = x.reshape(x.shape[self.n_partial(nd) :])
        self.walk(range(len(prop.decisions)), env)
        for b in prop.out_boxings:
            self.box(env, b)
        results = []
        for atom, nd in zip(prop.program.outputs, prop.out_sbp):
            y = self.read(env, atom, nd)
            if isinstance(atom, Const):
                y = jnp.broadcast_to(y, local_shape(atom.shape, nd, self.grid))
            y = uneven.fill_holes(y, atom.shape, nd, self.names, self.grid, uneven.holes_op(nd))
            results.append(y.reshape((1,) * self.n_partial(nd) + y.shape))
        return tuple(results)

    @staticmethod
    def read(env, atom, nd):
        key = (id(atom), nd)
        if key in env:
            return env[key]
        return jnp.asarray(atom.value)  # a constant, used as B

    def settled(self, env, atom, nd):
        """The value with its padded positions (uneven splits) holding the
        identity of its partial, as boxing and results expect."""
        x = self.read(env, atom, nd)
        return uneven.fill_holes(x, atom.shape, nd, self.names, self.grid, uneven.holes_op(nd))

    def box(self, env, b, anchor=()):
        """Run boxing ``b`` (with its bucket); a regather's sources are made
        to depend on ``anchor`` (values the op before its consumer made, see
        ``_after``)."""
        plan = self.plan
        if id(b) in plan.joined:  # ran earlier, with its bucket
            return
        bucket = plan.buckets.get(id(b))
        if bucket is None and not b.regather and (id(b.var), b.dst) in env:
            return  # a rolled loop made it already (Run.done, Run.pushed)
        members = [b] if bucket is None else bucket.boxings
        srcs = [self.settled(env, c.var, c.src) for c in members]
        if b.regather and anchor:
            srcs = _after(srcs, anchor)
        if bucket is None:
            env[(id(b.var), b.dst)] = run_plan(b.plan, srcs[0])
            return
        ys = run_bucket(bucket, srcs)
        for c, y in zip(bucket.boxings, ys):
            env[(id(c.var), c.dst)] = y

    def walk(self, indices, env, template=None, depth=0):
        """Run these decisions (program order) on local pieces held in ``env``
        (``template``: the run whose body these are; ``depth``: how many
        switches' branches they lie in)."""
        plan = self.plan
        entered: set = set()
        shared: dict = {}  # what ops' own communication made (LocalCtx.memo)
        anchor: tuple = ()  # the last outputs with an element (a regather waits for them)
        k = 0
        while k < len(indices):
            i = indices[k]
            run = plan.run_at.get(i)
            sw = next((w for w in plan.switch_at.get(i, ()) if w.depth == depth), None)
            if sw is not None and run is not None and run is not template and run.last > sw.span[1]:
                sw = None  # the cond lies in the loop's first iteration: the loop runs it
            if sw is not None:
                lower_control.switch(self, sw, env, template)
                while k < len(indices) and indices[k] in sw.members:
                    k += 1
                continue
            if run is not None and run is not template:
                lower_control.roll(self, run, env, depth)
                while k < len(indices) and indices[k] <= run.last:
                    k += 1
                continue
            k += 1
            if i in plan.unread:
                continue
            if i in plan.dropped:
                if i in plan.finish:
                    self._fill_stack(env, i)
                continue
            dec = self.prop.decisions[i]
            r = dec.node.region
            if r and r not in entered:
                entered.add(r)
                self._enter_region(env, r)
            for b in dec.boxings:
                if id(b) not in plan.hoisted and id(b) not in plan.before_switch:
                    self.box(env, b, anchor)
            outs = self._run_op(dec, env, shared)
            if any(jnp.size(y) for y in outs):
                anchor = tuple(outs)

    def _fill_stack(self, env, i):
        """A stack the loop filled, but for the slices made outside it."""
        var, nd, missing, push = self.plan.finish[i]
        buf = env[(STACKED, id(var))]
        for m, y in missing:
            y = self.read(env, y, nd) if push is None else run_plan(push[1], self.settled(env, y, nd))
            buf = lax.dynamic_update_index_in_dim(buf, y, m, 0)
        env[(id(var), shift_up(nd) if push is None else push[0].dst)] = buf

    def _enter_region(self, env, r):
        """One optimization barrier over every value the jax.checkpoint region
        ``r`` reads from outside, in every layout present, as jax.jit lowers a
        checkpoint: the recomputation can be neither merged with the forward
        pass nor run before its inputs."""
        keys = [key for key in env if key[0] in self.plan.region_inputs[r]]
        if keys:
            env.update(zip(keys, lax.optimization_barrier(tuple(env[key] for key in keys))))

    def _run_op(self, dec, env, shared) -> list:
        """Decision ``dec``'s op on the local pieces of its (boxed) inputs; its
        outputs go into ``env``."""
        node, grid = dec.node, self.grid
        ins = [self.read(env, a, nd) for a, nd in zip(node.ins, dec.in_sbp)]
        # a reduction over an uneven split reads identities in the padding
        for j, op in uneven.reduced_operands(dec.in_sbp, dec.out_sbp, [a.shape for a in node.ins], grid):
            ins[j] = uneven.fill_holes(ins[j], node.ins[j].shape, dec.in_sbp[j], self.names, grid, op)
        if node.name == CONSTRAIN:
            outs = ins
        else:
            rule = RULES.get(node.name)
            keys = [(id(a), nd) for a, nd in zip(node.ins, dec.in_sbp)]
            ctx = LocalCtx(
                self.prop.placement, dec.in_sbp, dec.out_sbp, [o.shape for o in node.outs], keys, shared
            )
            if node.name in NESTED:  # runs a planned program of its own
                local = NESTED[node.name].local
            elif rule is not None and rule.local is not None:
                local = rule.local
            else:
                local = _default_local
            try:
                outs = local(node.eqn, ins, ctx)
            except SBPError as e:
                raise located(e, node.source) from None
        for v, nd, y in zip(node.outs, dec.out_sbp, outs):
            env[(id(v), nd)] = y
        return outs
