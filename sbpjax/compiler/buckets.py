"""Combined collectives: boxings that run the same collectives are bucketed.

A train step reduces every gradient with the same collectives over the same
axes (data parallel: one all-reduce; 2-D: reduce-scatter, all-reduce,
all-gather; ZeRO: a reduce-scatter). Lowered one boxing at a time that is one
collective per parameter. As PyTorch DDP's gradient buckets and XLA's
collective combiners do, the lowering instead runs such boxings together: their
local tensors are laid out in one flat buffer, each collective runs once on the
buffer, and the pieces are split back. The bytes each device receives are
linear in the buffer size for every bucketed collective (all-reduce
``2 (g-1)/g n``, reduce-scatter ``(g-1) n``, all-gather ``(g-1)/g n``, see
:mod:`sbpjax.comm`), so a bucket moves exactly the sum of its members' planned
bytes; only the number of collectives changes.

Which boxings share a bucket (:func:`plan_buckets`): boxings whose plans have
the same steps (op, axis group, reduction) and whose tensors have the same
dtype; a plan qualifies when all its collective steps are all-reduces, sum
reduce-scatters or all-gathers, the last two over evenly split layouts (uneven
ones need per-device index tables, and run alone as before), and it has at
least one collective. Local steps (``local_slice``, ``zero_fill``) run per
member between the combined collectives.

When (the schedule): the program's boxings keep their places (each runs before
the op that first consumes it) except that, when a qualifying boxing runs,
every later qualifying boxing with the same steps whose source is already
computed joins it (DDP's flush of a ready bucket). In a train step the gradient
reductions are first consumed by the optimizer, after the whole backward pass,
so all gradients with the same steps are ready together. Joining runs a
boxing earlier than before, never later, and a boxing is a function of its
source only, so values do not change; buffers may live longer.

``BUCKET_BYTES`` caps a bucket's local input size (bytes one device
contributes): 25 MiB, PyTorch DDP's default ``bucket_cap_mb``. Larger buckets
mean fewer collectives and fewer latency terms; a cap bounds the extra memory
of the flat buffer (about twice its size while the pieces are copied in and
out). A boxing larger than the cap runs alone. ``BUCKETING = False`` turns
combining off (each boxing runs alone, as before).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax.boxing.lower import _apply, _axis_arg, _Tables, preduce_extreme, run_plan
from sbpjax.compiler.propagate import Boxing, Propagation
from sbpjax.compiler.trace import Const
from sbpjax.layout import Geometry

BUCKETING = True
"""Combine qualifying boxings (module default; ``False`` lowers each boxing alone)."""

BUCKET_BYTES = 25 * 2**20
"""Cap on the bytes one device contributes to a bucket (PyTorch DDP's 25 MiB)."""


@dataclasses.dataclass
class Bucket:
    """Boxings lowered together, in program order (the first is the one whose
    place in the program the bucket takes); ``key``: (dtype, steps)."""

    boxings: list
    key: tuple

    @property
    def collectives(self) -> int:
        """Collectives the bucket emits (one per collective step)."""
        return sum(1 for s in self.key[1] if s[0] != "local")

    @property
    def bytes(self) -> int:
        return int(sum(b.bytes for b in self.boxings))


def bucket_key(b: Boxing, grid) -> tuple | None:
    """(dtype, steps) for a boxing that can share a bucket, else None."""
    plan = b.plan
    if isinstance(b.var, Const) or not plan.steps or 0 in plan.shape:
        return None
    if plan.dst_placement is not None and plan.dst_placement != plan.placement:
        return None
    geom = Geometry(plan.shape, grid)
    steps: list[tuple] = []
    for s in plan.steps:
        if s.op == "all_reduce":
            steps.append(("all_reduce", tuple(s.group), s.reduce))
        elif s.op in ("reduce_scatter", "all_gather"):
            if s.op == "reduce_scatter" and s.reduce != "sum":
                return None
            if not (geom.even(s.src) and geom.even(s.dst)) or s.dim is None:
                return None
            steps.append((s.op, tuple(s.group), s.reduce))
        elif s.op in ("local_slice", "zero_fill"):
            steps.append(("local",))
        else:
            return None
    if all(s[0] == "local" for s in steps):
        return None
    return (np.dtype(plan.dtype).str, tuple(steps))


def _local_bytes(b: Boxing, grid) -> int:
    plan = b.plan
    assert plan.src_layout is not None
    return math.prod(Geometry(plan.shape, grid).padded(plan.src_layout)) * np.dtype(plan.dtype).itemsize


def plan_buckets(prop: Propagation, cap: int | None = None, enabled: bool | None = None):
    """The buckets of a propagated program.

    Returns ``(buckets, joined)``: ``buckets`` maps ``id`` of each bucket's
    first boxing to its :class:`Bucket` (buckets of one boxing are left out:
    they lower as before); ``joined``: ids of the other members, which run with
    their bucket and are skipped at their own place."""
    cap = BUCKET_BYTES if cap is None else cap
    enabled = BUCKETING if enabled is None else enabled
    buckets: dict = {}
    joined: set = set()
    if not enabled:
        return buckets, joined
    grid = prop.placement.shape
    prog = prop.program
    order: list = [(i, b) for i, d in enumerate(prop.decisions) for b in d.boxings]
    order += [(len(prop.decisions), b) for b in prop.out_boxings]
    keys = {id(b): bucket_key(b, grid) for _, b in order}
    pending: dict = {}  # key -> boxings not yet run, program order
    for _, b in order:
        k = keys[id(b)]
        if k is not None:
            pending.setdefault(k, []).append(b)
    if not any(len(v) > 1 for v in pending.values()):
        return buckets, joined

    ready = {(id(v), nd) for v, nd in zip(prog.inputs, prop.in_sbp)}
    done: set = set()
    for dec in [*prop.decisions, None]:
        boxings = dec.boxings if dec is not None else prop.out_boxings
        for b in boxings:
            if id(b) in done:
                continue
            done.add(id(b))
            k = keys[id(b)]
            if k is not None:
                members = [b]
                size = _local_bytes(b, grid)
                rest = []
                for c in pending[k]:
                    if id(c) in done:
                        continue
                    nb = _local_bytes(c, grid)
                    if (id(c.var), c.src) in ready and size + nb <= cap:
                        members.append(c)
                        size += nb
                        done.add(id(c))
                    else:
                        rest.append(c)
                pending[k] = rest
                if len(members) > 1:
                    buckets[id(b)] = Bucket(members, k)
                    joined.update(id(c) for c in members[1:])
                for c in members:
                    ready.add((id(c.var), c.dst))
            else:
                ready.add((id(b.var), b.dst))
        if dec is not None:
            ready.update((id(v), nd) for v, nd in zip(dec.node.outs, dec.out_sbp))
    return buckets, joined


def count_collectives(prop: Propagation, **kw) -> int:
    """Collectives the lowering emits for a program (a bucket counts once per
    collective step). XLA may combine further (its CPU backend combines
    independent all-reduces), never less."""
    buckets, joined = plan_buckets(prop, **kw)
    n = sum(bk.collectives for bk in buckets.values())
    for b in prop.boxings:
        if id(b) not in joined and id(b) not in buckets:
            n += sum(1 for s in b.plan.steps if s.collective is not None)
    return n


# ---------------------------------------------------------------------------
# Lowering a bucket (inside the program's shard_map body)
# ---------------------------------------------------------------------------


def run_bucket(bucket: Bucket, xs: list) -> list:
    """The members' target local tensors from their source ones (as
    :func:`sbpjax.boxing.lower.run_plan` would give each)."""
    boxings = bucket.boxings
    if len(boxings) == 1:
        return [run_plan(boxings[0].plan, xs[0])]
    plan0 = boxings[0].plan
    pl = plan0.placement
    names = pl.axis_names
    geoms = [Geometry(b.plan.shape, pl.shape) for b in boxings]
    xs = list(xs)
    flat = None  # between collectives: the members' local tensors, flattened and concatenated
    shapes = [x.shape for x in xs]
    for k, sig in enumerate(bucket.key[1]):
        steps = [b.plan.steps[k] for b in boxings]
        op = sig[0]
        if op == "local":
            if flat is not None:
                xs, flat = _split(flat, shapes), None
            xs = [
                _apply(s, x, g, _Tables(g, names), names, b.plan.dtype)
                for s, x, g, b in zip(steps, xs, geoms, boxings)
            ]
            shapes = [x.shape for x in xs]
            continue
        group = sig[1]
        axis = _axis_arg(tuple(names[a] for a in group))
        n = math.prod(pl.shape[a] for a in group)
        if op == "all_reduce":
            if flat is None:
                flat = jnp.concatenate([x.reshape(-1) for x in xs])
            flat = lax.psum(flat, axis) if sig[2] == "sum" else preduce_extreme(flat, axis, sig[2])
        elif op == "reduce_scatter":
            if flat is not None:
                xs, flat = _split(flat, shapes), None
            chunks, shapes = [], []
            for s, x in zip(steps, xs):
                d = s.dim
                assert d is not None  # bucket_key keeps only gathers and scatters with a dim
                c = x.shape[d] // n
                y = x.reshape(x.shape[:d] + (n, c) + x.shape[d + 1 :])
                chunks.append(jnp.moveaxis(y, d, 0).reshape(n, -1))
                shapes.append(x.shape[:d] + (c,) + x.shape[d + 1 :])
            buf = jnp.concatenate(chunks, axis=1)
            flat = lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True).reshape(-1)
        else:  # all_gather
            if flat is None:
                flat = jnp.concatenate([x.reshape(-1) for x in xs])
            got = lax.all_gather(flat, axis, axis=0, tiled=False)  # (n, total)
            xs, off = [], 0
            for s, shape in zip(steps, shapes):
                m = math.prod(shape)
                y = got[:, off : off + m].reshape((n,) + shape)
                off += m
                d = s.dim
                assert d is not None
                y = jnp.moveaxis(y, 0, d) if d else y
                xs.append(y.reshape(shape[:d] + (n * shape[d],) + shape[d + 1 :]))
            shapes = [x.shape for x in xs]
            flat = None
    if flat is not None:
        xs = _split(flat, shapes)
    return xs


def _split(flat, shapes) -> list:
    out, off = [], 0
    for shape in shapes:
        m = math.prod(shape)
        out.append(flat[off : off + m].reshape(shape))
        off += m
    return out
