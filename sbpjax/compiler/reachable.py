"""Layouts a value reaches from one it has without an invented conversion:
its partials reduced, whole axes sliced locally (no bytes), a partial beside
a whole factor, an operand gathered where both of a product's operands split
their free dims alike (or it splits a dim it contracts where the other splits
a free one), an embedding lookup's ids made whole or its table
gathered; whether a weight's layout is split over two axes; and which values
a chain of views reaches from another. The candidate screen
(:mod:`sbpjax.compiler.domains`) widens each operand's allowed layouts by
these."""

from __future__ import annotations

import functools
import itertools

from sbpjax.compiler.program import Var
from sbpjax.sbp import Broadcast, Partial, Split


def two_d(nd, grid) -> bool:
    """Whether layout ``nd`` splits its value over two or more axes of
    ``grid`` (a 2-D weight, ``Domains._gathered``)."""
    return sum(isinstance(q, Split) for q, p in zip(nd, grid) if p > 1) >= 2


def beside_partial(operand, out) -> bool:
    """Whether a product or quotient may read a same-shape operand in layout
    ``operand`` for output layout ``out``: on each axis the output's own
    layout, or whole where the output is a partial sum (the factor ``b`` of
    ``(sum_i a_i) * b``; the op's rule says which operand may be so)."""
    return all(a == o or (o == Partial("sum") and isinstance(a, Broadcast)) for a, o in zip(operand, out))


def sliced_to(src, dst) -> bool:
    """Whether ``dst`` is ``src`` with some whole (B) axes split locally (no
    bytes; see ``local_slices`` for which splits are local)."""
    return src != dst and all(
        p == q or (isinstance(p, Broadcast) and isinstance(q, Split) and q.dim not in _later_splits(src, a))
        for a, (p, q) in enumerate(zip(src, dst))
    )


@functools.lru_cache(maxsize=1 << 14)  # asked per operand of every op: 58,000 times on a 32-layer step
def reductions(nd: tuple, ndim: int) -> frozenset:
    """The layouts ``nd`` reduces to: each partial axis made whole or split on
    a dim, and all of them at once (a gradient partial over both axes of a
    2-D placement, the batch split over one and the image height over the
    other, all-reduced whole: reduced one axis at a time only, the AdamW step
    of such a convolution reduce-scattered its gradients and gathered the
    parameter and both moments back, 113,720 B against GSPMD's 93,776)."""
    partial = [a for a, q in enumerate(nd) if isinstance(q, Partial)]
    targets = (Broadcast(),) + tuple(Split(d) for d in range(ndim))
    out: set = set()
    for a in partial:
        out.update(nd[:a] + (t,) + nd[a + 1 :] for t in targets)
    if len(partial) > 1:
        for chosen in itertools.product(targets, repeat=len(partial)):
            made = list(nd)
            for a, t in zip(partial, chosen):
                made[a] = t
            out.add(tuple(made))
    return frozenset(out)


def unfilled(made, read):
    """``read`` with the axes it zero-fills from ``made`` whole (a partial
    read of a value made whole there), where ``made`` reaches that layout
    with no bytes; None where ``read`` zero-fills nothing."""
    filled = [
        a for a, (m, r) in enumerate(zip(made, read)) if isinstance(r, Partial) and not isinstance(m, Partial)
    ]
    if not filled:
        return None
    whole = tuple(Broadcast() if a in filled else q for a, q in enumerate(read))
    return whole if whole == made or sliced_to(made, whole) else None


def partly_gathered(made, read) -> set:
    """The layouts between ``made`` and ``read`` where ``read`` gathers some of
    ``made``'s splits whole (and keeps its other axes as they are), ``read``
    itself not among them; empty where ``read`` does more than gather."""
    gathered = [a for a, (m, r) in enumerate(zip(made, read)) if m != r]
    if not all(isinstance(made[a], Split) and isinstance(read[a], Broadcast) for a in gathered):
        return set()
    return gathered_splits(made, gathered) - {tuple(read)}


def gathered_splits(made, axes=None) -> set:
    """``made`` with each nonempty set of ``axes`` (default: its split axes)
    gathered whole."""
    axes = [a for a, q in enumerate(made) if isinstance(q, Split)] if axes is None else list(axes)
    out = set()
    for k in range(1, len(axes) + 1):
        for some in itertools.combinations(axes, k):
            out.add(tuple(Broadcast() if a in some else q for a, q in enumerate(made)))
    return out


def moved_splits(made, ndim: int) -> set:
    """``made`` with one of its split axes splitting another dim (an
    all-to-all), the other axes as they are."""
    out: set[tuple] = set()
    for a, q in enumerate(made):
        if isinstance(q, Split):
            out.update(made[:a] + (Split(d),) + made[a + 1 :] for d in range(ndim) if d != q.dim)
    return out


def local_slices(lays, shape) -> set:
    """Every layout each of ``lays`` slices to locally (no bytes): whole (B)
    axes split on a dim of ``shape`` longer than 1 that no later axis splits
    already. An axis splits its dim's pieces in placement order, so an
    earlier axis splitting what a later one split (``(B, S(2))`` to
    ``(S(2), S(2))``) would hand each device another device's piece."""
    out = set()
    for nd in lays:
        whole = [a for a, q in enumerate(nd) if isinstance(q, Broadcast)]
        for pick in itertools.product(*(_free_dims(nd, a, shape) for a in whole)):
            new = list(nd)
            for a, d in zip(whole, pick):
                if d is not None:
                    new[a] = Split(d)
            out.add(tuple(new))
    return out


def _free_dims(nd, axis, shape) -> list:
    """None (stay whole) and the dims ``axis`` of ``nd`` may split locally."""
    later = _later_splits(nd, axis)
    return [None] + [d for d, n in enumerate(shape) if n > 1 and d not in later]


def _later_splits(nd, axis) -> set:
    """The dims the axes after ``axis`` split in ``nd``."""
    return {q.dim for q in nd[axis + 1 :] if isinstance(q, Split)}


def ids_whole(table, ids, grid) -> set:
    """An embedding lookup ``table[ids]`` from a weight split over an axis
    on every layout it may take (``table``: those layouts) may read its ids
    whole there: the table stays put and the rows come out split along the
    width (weights stationary: the residual stream then runs split along
    its width, as GSPMD runs FSDP with tensor parallelism on a small batch)
    or partial (a table split along the vocabulary: Megatron's
    vocab-parallel embedding). The ids are a few bytes per token. The
    scanned FSDP + tensor-parallel GPT of ``Domains._uses`` moved 9.63 MB
    without it (with the carries' layouts), 8.90 with it. Returns the
    layouts ``ids`` (those its ids may be read in) made whole there."""
    axes = {
        a for a, p in enumerate(grid) if p > 1 and table and all(isinstance(nd[a], Split) for nd in table)
    }
    if not axes:
        return set()
    return {tuple(Broadcast() if a in axes else q for a, q in enumerate(nd)) for nd in ids}


def table_gathered(table, ids, grid) -> set:
    """An embedding lookup ``table[ids]`` may read its table (a weight; the
    layouts it may be read in) gathered over an axis its ids may be split
    over, as FSDP gathers a weight where it is used: the rows then come out
    split as the ids are, along the batch. The other half of ``ids_whole``
    (the table stays put, the ids are gathered): which is cheaper depends on
    the table's size against the activations'. The scanned GPT of the layer
    slices (``Domains.__init__``) moved 5.76 MB without it, 4.47 MB with it
    (GSPMD 9.00 MB). Returns the layouts of ``table`` gathered there."""
    split = {a for a, p in enumerate(grid) if p > 1 and any(isinstance(nd[a], Split) for nd in ids)}
    return {nd[:a] + (Broadcast(),) + nd[a + 1 :] for nd in table for a in split if isinstance(nd[a], Split)}


def contracts_split(node, made) -> bool:
    """Whether a ``dot_general`` with its operands laid out ``made`` contracts
    a dim both split over one axis (its result is partial there)."""
    if node.name != "dot_general":
        return False
    (lc, rc), _ = node.eqn.params["dimension_numbers"]
    pairs = dict(zip(lc, rc))
    return any(
        isinstance(q, Split) and isinstance(r, Split) and q.dim in pairs and pairs[q.dim] == r.dim
        for q, r in zip(made[0], made[1])
    )


def gathered_beside(node, i, nd, other) -> set:
    """Operand ``i`` of a product, laid out ``nd``, with its split of a dim it
    contracts gathered over an axis where the other operand, laid out
    ``other``, splits a free dim: the second product of attention with the
    sequence split, V split by key gathered beside the probabilities split
    by query (``free_gathered``'s second case; ``Domains`` also calls it with
    any layout ``other`` may take rather than greedy's)."""
    if node.name != "dot_general":
        return set()
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    contracting = (lc, rc)[i]
    skip = set((lc, rc)[1 - i]) | set((lb, rb)[1 - i])
    axes = [
        a
        for a, (q, o) in enumerate(zip(nd, other))
        if isinstance(q, Split) and q.dim in contracting and isinstance(o, Split) and o.dim not in skip
    ]
    return {nd[:a] + (Broadcast(),) + nd[a + 1 :] for a in axes}


def free_gathered(node, i, made) -> set:
    """Operand ``i`` of a product (``made``: each operand's layout as the
    greedy pass made it, or as the caller gave a data argument; None for
    other arguments) with its split gathered over an axis the other
    operand's free dim is split over too, where operand ``i`` splits a free
    dim or a dim it contracts there. Two
    operands split alike on their free dims cannot both keep the split:
    attention with the sequence split (context parallelism) gathers K and V,
    as Megatron's context parallelism and GSPMD do; without this the only
    plan in the space moved both to a split of the head dim and
    reduce-scattered the scores (1.25x GSPMD's bytes). Data arguments
    (``data_arguments``) count as the caller gave them: attention of a split
    input with itself under a segment mask moved 2,193,408 B (GSPMD
    1,849,344) before, 931,840 now. Weights do not (``Domains._gathered``
    says where they are gathered): counted too, a tensor-parallel kernel
    meeting an activation split over its axis was offered gathered, and a
    clipped 2-layer Llama step's solve stopped at a 14% gap.
    From greedy's layouts (``made``) only, here: offered at every product
    from the domains, the larger space left a 2-layer GPT's effort-limited
    solve on 2x2x2 at 2.77 MB (GSPMD 1.78 MB), and alike layers of the demo's
    GPT stopped sharing one decision (a 37 s solve). ``Domains`` also calls
    it with the other operand in a layout an earlier product read it in
    (``Domains._product_reads``: a weight gradient meeting an activation the
    forward product read split on its features), a narrower widening; the
    compiler benchmark's rows kept their bytes with it."""
    if node.name != "dot_general" or any(nd is None for nd in made):
        return set()
    (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
    skips = (set(lc) | set(lb), set(rc) | set(rb))

    def free_axes(nd, skip) -> set:
        return {a for a, q in enumerate(nd) if isinstance(q, Split) and q.dim not in skip}

    shared = free_axes(made[i], skips[i]) & free_axes(made[1 - i], skips[1 - i])
    nd = made[i]
    # and split on a dim it contracts where the other operand's free dim is
    # split: the probabilities split by query meeting V split by key (the
    # second product of attention with the sequence split) gather V and keep
    # the query split, as the scores' product gathers K
    return {nd[:a] + (Broadcast(),) + nd[a + 1 :] for a in shared} | gathered_beside(node, i, nd, made[1 - i])


def drawn(program) -> set:
    """The ids of the values computed from no argument but PRNG keys (the
    arguments ``random_wrap`` reads): random draws, iotas, values of
    constants. In program order, so each op's operands are known."""
    keys = {id(n.ins[0]) for n in program.nodes if n.name == "random_wrap" and isinstance(n.ins[0], Var)}
    argued = {id(v) for v in program.inputs if id(v) not in keys}
    out: set = set()
    for n in program.nodes:
        if any(isinstance(a, Var) and id(a) in argued for a in n.ins):
            argued.update(id(o) for o in n.outs)
        else:
            out.update(id(o) for o in n.outs)
    return out


def reached(program, seeds: set, ops) -> set:
    """The ids of the values computed from ``seeds`` by chains of the
    one-operand ``ops`` (in program order, so a chain is followed whole)."""
    out: set = set()
    for n in program.nodes:
        if (
            n.name in ops
            and n.ins
            and isinstance(n.ins[0], Var)
            and (id(n.ins[0]) in seeds or id(n.ins[0]) in out)
        ):
            out.add(id(n.outs[0]))
    return out
