"""Combined collectives: boxings that run the same collectives share them.

A train step reduces every gradient with the same collectives over the same
axes (data parallel: one all-reduce; 2-D: reduce-scatter, all-reduce,
all-gather; ZeRO: a reduce-scatter). Lowered one boxing at a time that is one
collective per parameter. As PyTorch DDP's gradient buckets and XLA's
collective combiners do, the lowering instead runs such boxings together, as
a bucket: for each collective (a round), the local tensors taking part are laid
out in one flat buffer, the collective runs once on it, and the pieces are
split back. (A sum all-reduce round is one ``psum`` of the tensors instead: XLA
combines the all-reduces of one ``psum`` without a buffer; it has no such
combiner for reduce-scatters and all-gathers on CPU.) The bytes each device receives are
linear in the buffer size for every bucketed collective (all-reduce
``2 (g-1)/g n``, reduce-scatter ``(g-1) n``, all-gather ``(g-1)/g n``, see
:mod:`sbpjax.comm`), so a bucket moves exactly the sum of its members' planned
bytes; only the number of collectives changes.

Which boxings qualify: plans whose collective steps are all-reduces, sum
reduce-scatters or all-gathers, the last two over evenly split layouts (uneven
ones need per-device index tables, and run alone as before), with at least one
collective. Local steps (``local_slice``, ``zero_fill``) run per member
between the combined collectives. A bucket holds tensors of one dtype.

When (:func:`plan_buckets`): the program's boxings keep their places (each
runs before the op that first consumes it) except that, when a qualifying
boxing runs, every later qualifying boxing of the same dtype whose source is
already computed joins it (DDP's flush of a ready bucket), if that saves a
collective: boxings with the same steps always join; a different sequence of
steps joins when it shares a round with the bucket (:func:`schedule`: a
(P, S(1)) -> (B, S(1)) all-reduce over ``x`` rides in the middle round of the
(P, P) -> (B, B) reduce-scatter, all-reduce, all-gather). In a train step the
gradient reductions are first consumed by the optimizer, after the whole
backward pass, so the gradients are ready together. Joining runs a boxing
earlier than before, never later, and a boxing is a function of its source
only, so values do not change; buffers may live longer. A bucket does not
cross the edge of a ``jax.checkpoint`` region (the recomputation stays after
its optimization barrier).

``CompileOptions.bucket_bytes`` caps a bucket's local input size (bytes one
device contributes): 25 MiB, PyTorch DDP's default ``bucket_cap_mb``. Larger
buckets mean fewer collectives and fewer latency terms; a cap bounds the extra
memory of the flat buffer (about twice its size while the pieces are copied in
and out). A boxing larger than the cap runs alone. ``bucketing=False`` turns
combining off (each boxing runs alone, as before).

A bucket of all-gathers only is also capped at ``gather_share`` (1/16) of the
program's estimated peak per device (:mod:`sbpjax.compiler.liveness`). Such
buckets gather parameters (ZeRO-3 / FSDP plans), and every parameter is ready
at the start, so without that cap the first gather takes every layer's
weights: on jax 0.12 the model zoo's unrolled decoder then peaked at that
point, with the 2.8 MB gathered buffer and the pieces cut from it alive
together (9.68 MB per device against GSPMD's 9.07 MB; capped: 8.38 MB, one
more collective). A share of 1/8 still let that bucket through; on the
compiler benchmark 1/16 splits one bucket of one program (the 4-layer GPT).
FSDP gathers one layer's parameters at a time for the same reason.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax.boxing.device_index import axis_arg
from sbpjax.boxing.extremes import preduce_extreme
from sbpjax.boxing.lower import apply_step
from sbpjax.compiler.liveness import live_bytes
from sbpjax.compiler.program import Const, Var
from sbpjax.compiler.propagation import Boxing, Propagation
from sbpjax.layout import Geometry


@dataclasses.dataclass
class Bucket:
    """Boxings lowered together, in program order (the first is the one whose
    place in the program the bucket takes); ``rounds``: the bucket's
    collectives in order, each ``((op, group, reduce), members taking part)``."""

    boxings: list
    rounds: list

    @property
    def collectives(self) -> int:
        """Collectives the bucket emits."""
        return len(self.rounds)

    @property
    def bytes(self) -> int:
        return int(sum(b.bytes for b in self.boxings))


Kind = tuple  # (op, axis group, reduce) of a collective step


def bucket_key(b: Boxing, grid) -> tuple | None:
    """(dtype, collective kinds in order) for a boxing that can share a
    bucket, else None."""
    plan = b.plan
    if isinstance(b.var, Const) or not plan.steps or 0 in plan.shape:
        return None
    if plan.dst_placement is not None and plan.dst_placement != plan.placement:
        return None
    geom = Geometry(plan.shape, grid)
    kinds: list[Kind] = []
    for s in plan.steps:
        if s.op == "all_reduce":
            kinds.append(("all_reduce", tuple(s.group), s.reduce))
        elif s.op in ("reduce_scatter", "all_gather"):
            if s.op == "reduce_scatter" and s.reduce != "sum":
                return None
            if not (geom.even(s.src) and geom.even(s.dst)) or s.dim is None:
                return None
            kinds.append((s.op, tuple(s.group), s.reduce))
        elif s.op not in ("local_slice", "zero_fill"):  # local steps run per member
            return None
    if not kinds:
        return None
    return (np.dtype(plan.dtype).str, tuple(kinds))


def schedule(seqs: list) -> list:
    """Rounds running every sequence of collective kinds in order, a round
    serving every sequence whose next kind it is: ``[(kind, [indices])]``.
    Greedy: the next kind of the sequence with the most kinds left (the first
    such sequence on ties), which keeps equal sequences together and lets a
    short sequence join a long one's matching round."""
    pos = [0] * len(seqs)
    rounds: list = []
    while True:
        live = [i for i, q in enumerate(seqs) if pos[i] < len(q)]
        if not live:
            return rounds
        lead = max(live, key=lambda i: (len(seqs[i]) - pos[i], -i))
        kind = seqs[lead][pos[lead]]
        who = [i for i in live if seqs[i][pos[i]] == kind]
        for i in who:
            pos[i] += 1
        rounds.append((kind, who))


def _local_bytes(b: Boxing, grid) -> int:
    plan = b.plan
    assert plan.src_layout is not None
    return math.prod(Geometry(plan.shape, grid).padded(plan.src_layout)) * np.dtype(plan.dtype).itemsize


def plan_buckets(
    prop: Propagation,
    cap: int | None = None,
    enabled: bool | None = None,
    zones: dict | None = None,
    gather_cap: int | None = None,
):
    """The buckets of a propagated program.

    ``zones`` (``id`` of a boxing -> a key) keeps boxings with different keys
    apart: the lowering gives each iteration of a rolled loop its own zone (a
    bucket inside the loop body is one iteration's), and the boxings run once
    before the loop another (:mod:`sbpjax.compiler.loops`).

    Returns ``(buckets, joined)``: ``buckets`` maps ``id`` of each bucket's
    first boxing to its :class:`Bucket` (buckets of one boxing are left out:
    they lower as before); ``joined``: ids of the other members, which run with
    their bucket and are skipped at their own place."""
    cap = prop.options.bucket_bytes if cap is None else cap
    enabled = prop.options.bucketing if enabled is None else enabled
    if not enabled:
        return {}, set()
    grid = prop.placement.shape
    order = [b for d in prop.decisions for b in d.boxings] + list(prop.out_boxings)
    keys: dict = {id(b): bucket_key(b, grid) for b in order}
    pending: dict = {}  # dtype -> qualifying boxings not yet run, program order
    local: dict = {}  # id(boxing) -> its block's bytes, read once per bucket a pending boxing is tried for
    for b in order:
        k = keys[id(b)]
        if k is not None:
            pending.setdefault(k[0], []).append(b)
            local[id(b)] = _local_bytes(b, grid)
    if not any(len(v) > 1 for v in pending.values()):
        return {}, set()
    if gather_cap is None and any(
        k is not None and all(q[0] == "all_gather" for q in k[1]) for k in keys.values()
    ):
        peak = int(live_bytes(prop).max())
        gather_cap = int(prop.options.gather_share * peak) if peak > 0 else None
    filling = _Filling(keys, pending, local, _regions(prop, zones or {}), cap, gather_cap)
    return filling.run(prop)


def _regions(prop: Propagation, zones: dict) -> dict:
    """id(boxing) -> (its jax.checkpoint region, its zone). A bucket stays
    inside one region (or outside all), so no boxing moves across the
    region's optimization barrier, and inside one zone."""
    region = {
        id(b): (getattr(d.node, "region", 0), zones.get(id(b), ())) for d in prop.decisions for b in d.boxings
    }
    region.update({id(b): (0, zones.get(id(b), ())) for b in prop.out_boxings})
    return region


@dataclasses.dataclass
class _Filling:
    """Buckets filled in program order: each boxing not yet run opens one and
    takes in the pending boxings of its dtype whose sources are ready, up to
    the byte cap, in its region, where they share a round."""

    keys: dict  # id(boxing) -> bucket_key
    pending: dict  # dtype -> qualifying boxings not yet run, program order
    local: dict  # id(boxing) -> its block's bytes
    region: dict  # id(boxing) -> (region, zone)
    cap: int
    gather_cap: int | None

    def run(self, prop: Propagation) -> tuple[dict, set]:
        buckets: dict = {}
        joined: set = set()
        ready = {(id(v), nd) for v, nd in zip(prop.program.inputs, prop.in_sbp)}
        done: set = set()
        for dec in [*prop.decisions, None]:
            for b in dec.boxings if dec is not None else prop.out_boxings:
                if id(b) in done:
                    continue
                done.add(id(b))
                if self.keys[id(b)] is None:
                    ready.add((id(b.var), b.dst))
                    continue
                members = self._members(b, ready, done)
                if len(members) > 1:
                    rounds = schedule([self.keys[id(c)][1] for c in members])
                    buckets[id(b)] = Bucket(members, rounds)
                    joined.update(id(c) for c in members[1:])
                ready.update((id(c.var), c.dst) for c in members)
            if dec is not None:
                ready.update((id(v), nd) for v, nd in zip(dec.node.outs, dec.out_sbp))
        return buckets, joined

    def _members(self, b, ready: set, done: set) -> list:
        """The bucket ``b`` opens: ``b`` and the pending boxings that join it
        (marked done, taken off ``pending``)."""
        k = self.keys[id(b)]
        members = [b]
        seqs = [k[1]]  # distinct kind sequences in the bucket
        n_rounds = len(k[1])
        size = self.local[id(b)]
        limit = self.cap
        if self.gather_cap is not None and all(kind[0] == "all_gather" for kind in k[1]):
            limit = min(self.cap, self.gather_cap)
        rest = []
        for c in self.pending[k[0]]:
            if id(c) in done:
                continue
            nb = self.local[id(c)]
            if (
                (id(c.var), c.src) not in ready
                or size + nb > limit
                or self.region.get(id(c), (0, ())) != self.region.get(id(b), (0, ()))
            ):
                rest.append(c)
                continue
            q = self.keys[id(c)][1]
            if q not in seqs:
                # join only where that saves collectives (shares a round)
                n = len(schedule([*seqs, q]))
                if n >= n_rounds + len(q):
                    rest.append(c)
                    continue
                seqs.append(q)
                n_rounds = n
            members.append(c)
            size += nb
            done.add(id(c))
        self.pending[k[0]] = rest
        return members


def count_collectives(prop: Propagation, combined_all_reduces: bool = False, **kw) -> int:
    """Collectives the lowering emits for a program (a bucket counts once per
    round). XLA may combine further (its CPU backend combines independent
    all-reduces), never less. ``combined_all_reduces=True``: with the
    all-reduces combined as XLA combines them, and a permute counted once
    per round (``emitted_collectives``)."""
    if combined_all_reduces:
        return launch_count(emitted_collectives(prop))
    buckets, joined = plan_buckets(prop, **kw)
    n = sum(bk.collectives for bk in buckets.values())
    for b in prop.boxings:
        if id(b) not in joined and id(b) not in buckets:
            n += sum(1 for s in b.plan.steps if s.collective is not None)
    return n


def launch_count(launched: dict) -> int:
    """The collectives of ``emitted_collectives``' answer: one per entry, a
    permute once per round."""
    return sum(max(1, rounds) if op == "permute" else 1 for c in launched.values() for op, _, rounds in c)


def emitted_collectives(prop: Propagation) -> dict:
    """id(boxing) -> the collectives the compiled program runs for it, as
    ``(op, axes, rounds)`` (rounds: a permute's). All-reduces are counted as
    XLA combines them, bucketed or not (a data-parallel step's gradients,
    reduced where each is made, compile to one all-reduce): one per kind and
    position in the longest chain of dependent all-reduces of that kind
    (``all_reduce_rounds``), paid by the first boxing to reach it. Other
    collectives as the lowering's buckets run them (XLA on CPU combines no
    reduce-scatters or all-gathers): a bucket's rounds, paid by its first
    boxing, else each boxing's own."""
    buckets, joined = plan_buckets(prop)
    names = prop.placement.axis_names
    ar_rounds = all_reduce_rounds(prop)
    paid: set = set()
    launched: dict = {}
    for b in [b for d in prop.decisions for b in d.boxings] + list(prop.out_boxings):
        mine = []
        for (axes, reduce, dtype), position in ar_rounds[id(b)]:
            if (axes, reduce, dtype, position) not in paid:
                paid.add((axes, reduce, dtype, position))
                mine.append(("all_reduce", axes, 0))
        bucket = buckets.get(id(b))
        if bucket is not None:
            for (op, group, _), _members in bucket.rounds:
                if op != "all_reduce":
                    mine.append((op, tuple(names[g] for g in group), 0))
        elif id(b) not in joined:
            for st in b.plan.steps:
                if st.bytes > 0 and st.collective is not None and st.op != "all_reduce":
                    mine.append((st.op, tuple(st.axes), st.rounds))
        launched[id(b)] = mine
    return launched


def all_reduce_rounds(prop: Propagation) -> dict:
    """id(boxing) -> [(kind, position)] for each all-reduce it runs: kind is
    (axes, reduce, dtype), position the most all-reduces of that kind on a
    path from the program's arguments up to and including this one. All-reduces of one
    kind at one position cannot depend on one another, and the longest chain
    of dependent ones bounds how few launches any combining can reach (Mirsky's
    theorem); XLA's all-reduce combiner reaches it on the programs measured."""
    chains: dict = {}  # id(var), or (id(var), layout) for a boxed version -> {kind: count}
    rounds: dict = {}

    def box(b) -> None:
        chain = dict(chains.get(id(b.var), {}))
        rounds[id(b)] = []
        for st in b.plan.steps:
            if st.op == "all_reduce" and st.bytes > 0:
                kind = (tuple(st.axes), st.reduce, np.dtype(b.plan.dtype).str)
                chain[kind] = chain.get(kind, 0) + 1
                rounds[id(b)].append((kind, chain[kind]))
        chains[(id(b.var), b.dst)] = chain

    for d in prop.decisions:
        for b in d.boxings:
            box(b)
        out: dict = {}  # the most of each kind on any operand's path
        for a, nd in zip(d.node.ins, d.in_sbp):
            if isinstance(a, Var):
                for k, n in chains.get((id(a), nd), chains.get(id(a), {})).items():
                    out[k] = max(out.get(k, 0), n)
        for o in d.node.outs:
            chains[id(o)] = out
    for b in prop.out_boxings:
        box(b)
    return rounds


# ---------------------------------------------------------------------------
# Lowering a bucket (inside the program's shard_map body)
# ---------------------------------------------------------------------------


def run_bucket(bucket: Bucket, xs: list) -> list:
    """The members' target local tensors from their source ones (as
    :func:`sbpjax.boxing.lower.run_plan` would give each)."""
    boxings = bucket.boxings
    plans = [b.plan for b in boxings]
    pl = plans[0].placement
    names = pl.axis_names
    xs = list(xs)
    at = [0] * len(plans)  # each member's next step

    def run_local(i):
        steps = plans[i].steps
        while at[i] < len(steps) and steps[at[i]].collective is None:
            xs[i] = apply_step(steps[at[i]], xs[i], plans[i])
            at[i] += 1

    for i in range(len(plans)):
        run_local(i)
    for (op, group, reduce), who in bucket.rounds:
        steps = [plans[i].steps[at[i]] for i in who]
        if len(who) == 1:
            i = who[0]
            ys = [apply_step(steps[0], xs[i], plans[i])]
        else:
            axis = axis_arg(tuple(names[a] for a in group))
            n = math.prod(pl.shape[a] for a in group)
            ys = _combined(op, reduce, axis, n, steps, [xs[i] for i in who])
        for i, y in zip(who, ys):
            xs[i] = y
            at[i] += 1
            run_local(i)
    return xs


def _combined(op, reduce, axis, n, steps, xs) -> list:
    """One collective for several tensors: their pieces laid out in one buffer."""
    if op == "all_reduce":
        if reduce == "sum":
            # one psum of all the tensors: XLA's all-reduce combiner (CPU, GPU and
            # TPU pipelines) makes it one all-reduce without copying them into a
            # buffer (a buffer costs temp memory: +35% on a scanned 2-layer step)
            return list(lax.psum(tuple(xs), axis))
        flat = jnp.concatenate([x.reshape(-1) for x in xs])
        return _split(preduce_extreme(flat, axis, reduce), [x.shape for x in xs])
    if op == "reduce_scatter":
        # each tensor as (n, rest): row k is the chunk device k of the group keeps
        chunks, shapes = [], []
        for s, x in zip(steps, xs):
            d = s.dim
            assert d is not None  # bucket_key keeps only gathers and scatters with a dim
            c = x.shape[d] // n
            y = x.reshape(x.shape[:d] + (n, c) + x.shape[d + 1 :])
            chunks.append(jnp.moveaxis(y, d, 0).reshape(n, -1))
            shapes.append(x.shape[:d] + (c,) + x.shape[d + 1 :])
        buf = jnp.concatenate(chunks, axis=1)
        return _split(lax.psum_scatter(buf, axis, scatter_dimension=0, tiled=True).reshape(-1), shapes)
    # all_gather: row k of the gathered buffer is device k's pieces
    flat = jnp.concatenate([x.reshape(-1) for x in xs])
    got = lax.all_gather(flat, axis, axis=0, tiled=False)
    out, off = [], 0
    for s, x in zip(steps, xs):
        d = s.dim
        assert d is not None
        m = math.prod(x.shape)
        y = got[:, off : off + m].reshape((n,) + x.shape)
        off += m
        y = jnp.moveaxis(y, 0, d) if d else y
        out.append(y.reshape(x.shape[:d] + (n * x.shape[d],) + x.shape[d + 1 :]))
    return out


def _split(flat, shapes) -> list:
    out, off = [], 0
    for shape in shapes:
        m = math.prod(shape)
        out.append(flat[off : off + m].reshape(shape))
        off += m
    return out
