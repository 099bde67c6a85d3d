"""A plan from its ops' signatures: the boxings every value then needs.

The layout choice decides signatures (and the layouts of ``AUTO``
arguments); the boxings follow from them. Each value is boxed once per
layout some consumer reads it in, at its first such consumer, from its
producer's layout or from a version an earlier boxing made, whichever costs
least (``cost``: the solver's price; without one, the fewest bytes,
``Propagator.cheapest_source``): a partial reduced once for one consumer is
sliced for the next instead of reduced again. ``first`` names, for values
read by several consumers, the version the solver boxed them to before
anything else (a hub's layout, :mod:`sbpjax.compiler.formulate`): it is made
first, at the first consumer, so that the others box from it as the solver
priced them (in consumer order by bytes alone, a partial read as (S(0), S(0))
and then as (S(0), B) was reduce-scattered and all-gathered, two
collectives, where the solver had priced one all-reduce and a slice). The
solver's plans and the plan cache's entries are both made into plans here.
"""

from __future__ import annotations

from sbpjax.compiler.program import Const
from sbpjax.compiler.propagation import Boxing, Decision, Propagation, op_comm
from sbpjax.compiler.propagator import Propagator
from sbpjax.sbp import Broadcast


def propagation_of(
    program, placement, pr: Propagator, in_sbp, out_sbp, signatures, first=None, cost=None
) -> Propagation:
    """The Propagation the lowering and ``explain()`` read, for ``signatures``
    (per op its (ins, outs) nd-SBPs), arguments in ``in_sbp`` and results
    boxed to ``out_sbp`` (None: as computed). ``first``: {value key
    (``value_keys``): the layout it is boxed to before any other};
    ``cost(plan)``: how boxing sources are compared (None: by bytes)."""
    layout: dict = {id(v): nd for v, nd in zip(program.inputs, in_sbp)}
    boxed: dict = {}  # id(atom) -> the layouts boxings made of it, in order
    rep = (Broadcast(),) * len(placement.shape)
    keys = value_keys(program) if first else {}
    before = {vid: first[k] for vid, k in keys.items() if k in first}

    def source(atom, src, nd, made):
        if cost is None:
            return pr.cheapest_source(atom, src, nd, made)
        options = [(s, pr.plan(atom, s, nd)) for s in [src, *made] if s != nd]
        return min(options, key=lambda sp: cost(sp[1]))

    def box(atom, nd, reader, index, out):
        """``reader``: the op (or, a str, the output) that reads ``atom`` as
        ``nd``; named in the boxing only where one is made (most reads need
        none, and a node's source line costs a lookup)."""
        src = rep if isinstance(atom, Const) else layout[id(atom)]
        made = boxed.setdefault(id(atom), [])
        if src == nd or nd in made:
            return
        where = reader if isinstance(reader, str) else f"{reader.name} at {reader.source}"
        hub = before.get(id(atom))
        if hub is not None and hub != src and hub not in made and hub != nd:
            made.append(hub)
            out.append(Boxing(atom, src, hub, pr.plan(atom, src, hub), where, index))
        src, plan = source(atom, src, nd, made)
        made.append(nd)
        out.append(Boxing(atom, src, nd, plan, where, index))

    decisions = []
    for index, (node, (ins, outs)) in enumerate(zip(program.nodes, signatures)):
        boxings: list = []
        for atom, nd in zip(node.ins, ins):
            box(atom, nd, node, index, boxings)
        for v, nd in zip(node.outs, outs):
            layout[id(v)] = nd
        comm = op_comm(node, ins, outs, placement, pr.comms) or []
        decisions.append(Decision(node, list(ins), list(outs), boxings, comm))
    out_boxings: list = []
    final: list = []
    for k, atom in enumerate(program.outputs):
        want = out_sbp[k] if out_sbp is not None else None
        have = rep if isinstance(atom, Const) else layout[id(atom)]
        if want is None or want == have:
            final.append(have)
            continue
        box(atom, want, f"output {k}", None, out_boxings)
        final.append(want)
    prop = Propagation(program, placement, list(in_sbp), decisions, out_boxings, final, [])
    prop.first_versions = dict(first or {})
    return prop


def value_keys(program) -> dict:
    """{id(value): its key}: ``("arg", i)`` for the i-th argument, ``("op",
    k, j)`` for the j-th result of op k; the same for every trace of one
    program (a plan cache entry names values so)."""
    keys: dict = {id(v): ("arg", i) for i, v in enumerate(program.inputs)}
    for k, node in enumerate(program.nodes):
        for j, o in enumerate(node.outs):
            keys[id(o)] = ("op", k, j)
    return keys


__all__ = ["propagation_of", "value_keys"]
