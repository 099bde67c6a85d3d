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
from jax import lax

from sbpjax.boxing.lower import group_index, run_plan
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler import uneven
from sbpjax.compiler.buckets import plan_buckets, run_bucket
from sbpjax.compiler.propagate import CONSTRAIN, Propagation
from sbpjax.compiler.trace import Const, Var
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


def _default_local(eqn, ins, ctx):
    params = dict(eqn.params)
    outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def build(prop: Propagation, donate: tuple[int, ...] = ()):
    """The jitted function of physical inputs -> physical outputs; ``donate``:
    indices of the inputs whose buffers the program may reuse (``jax.jit``'s
    ``donate_argnums``)."""
    pl = prop.placement
    grid, names = pl.shape, pl.axis_names
    prog = prop.program

    def n_partial(nd):  # leading physical dims: one per partial axis of size > 1
        return sum(isinstance(s, Partial) and grid[a] > 1 for a, s in enumerate(nd))

    def specs(vars_, nds):
        return tuple(
            Geometry(v.shape, grid).partition_spec(normalized_layout(nd, len(v.shape), grid), names)
            for v, nd in zip(vars_, nds)
        )

    # boxings that run the same collectives run together (sbpjax.compiler.buckets)
    buckets, joined = plan_buckets(prop)

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

    def body(*blocks):
        env: dict = {}
        entered: set = set()
        shared: dict = {}  # what ops' own communication made (LocalCtx.memo)

        def barrier(region):
            """One optimization barrier over every value the region reads from outside,
            in every layout present, as jax.jit lowers a checkpoint: the recomputation
            can be neither merged with the forward pass nor run before its inputs."""
            entered.add(region)
            keys = [k for k in env if k[0] in region_inputs[region]]
            if keys:
                env.update(zip(keys, lax.optimization_barrier(tuple(env[k] for k in keys))))

        for v, nd, x in zip(prog.inputs, prop.in_sbp, blocks):
            env[(id(v), nd)] = x.reshape(x.shape[n_partial(nd) :])

        def read(atom, nd):
            key = (id(atom), nd)
            if key in env:
                return env[key]
            return jnp.asarray(atom.value)  # a constant, used as B

        def settled(atom, nd):
            """The value with its padded positions (uneven splits) holding the
            identity of its partial, as boxing and results expect."""
            x = read(atom, nd)
            return uneven.fill_holes(x, atom.shape, nd, names, grid, uneven.holes_op(nd))

        def box(b):
            if id(b) in joined:  # ran earlier, with its bucket
                return
            bucket = buckets.get(id(b))
            if bucket is None:
                env[(id(b.var), b.dst)] = run_plan(b.plan, settled(b.var, b.src))
                return
            ys = run_bucket(bucket, [settled(c.var, c.src) for c in bucket.boxings])
            for c, y in zip(bucket.boxings, ys):
                env[(id(c.var), c.dst)] = y

        for dec in prop.decisions:
            if dec.node.region and dec.node.region not in entered:
                barrier(dec.node.region)
            for b in dec.boxings:
                box(b)
            node = dec.node
            ins = [read(a, nd) for a, nd in zip(node.ins, dec.in_sbp)]
            # a reduction over an uneven split reads identities in the padding
            for j, op in uneven.reduced_operands(dec.in_sbp, dec.out_sbp, [a.shape for a in node.ins], grid):
                ins[j] = uneven.fill_holes(ins[j], node.ins[j].shape, dec.in_sbp[j], names, grid, op)
            if node.name == CONSTRAIN:
                outs = ins
            else:
                rule = RULES.get(node.name)
                keys = [(id(a), nd) for a, nd in zip(node.ins, dec.in_sbp)]
                ctx = LocalCtx(pl, dec.in_sbp, dec.out_sbp, [o.shape for o in node.outs], keys, shared)
                local = rule.local if (rule is not None and rule.local is not None) else _default_local
                outs = local(node.eqn, ins, ctx)
            for v, nd, y in zip(node.outs, dec.out_sbp, outs):
                env[(id(v), nd)] = y
        for b in prop.out_boxings:
            box(b)
        results = []
        for atom, nd in zip(prog.outputs, prop.out_sbp):
            y = read(atom, nd)
            if isinstance(atom, Const):
                y = jnp.broadcast_to(y, local_shape(atom.shape, nd, grid))
            y = uneven.fill_holes(y, atom.shape, nd, names, grid, uneven.holes_op(nd))
            results.append(y.reshape((1,) * n_partial(nd) + y.shape))
        return tuple(results)

    mapped = jax.shard_map(
        body,
        mesh=pl.mesh,
        in_specs=specs(prog.inputs, prop.in_sbp),
        out_specs=specs(prog.outputs, prop.out_sbp),
        check_vma=False,
    )
    return jax.jit(mapped, donate_argnums=tuple(donate))
