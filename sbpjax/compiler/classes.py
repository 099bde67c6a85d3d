"""Ops that share one decision: the iterations of a written-out scan, and
alike layers.

The tracer writes loops out (``sbpjax.compiler.trace``); the layout choice
gives the k-th op of every iteration one signature (:func:`loop_classes`),
so the lowering can roll the iterations back into one loop
(``sbpjax.compiler.loops``). Alike layers of a model written as a Python
loop fall into classes too (:func:`layer_classes`); sharing their choice
is a restriction the formulation may use to make a large program smaller.
"""

from __future__ import annotations

import re

from sbpjax.dtypes import dtype_name


def arg_class(name: str) -> str:
    """An argument's path with list and tuple positions dropped: the same
    parameter of every layer of a list of layers (``['layers'][3]['wq']`` ->
    ``['layers'][*]['wq']``)."""
    return re.sub(r"\[\d+\]", "[*]", name)


# How many producers back two ops must look alike to share their choice: deep
# enough that an op is known by the ops it reads (so layer 3's attention
# matmul matches layer 2's, not the first layer's, which reads the
# embedding), shallow enough that the residual stream's history (different
# in every layer) is not part of it.
CLASS_DEPTH = 3


def layer_classes(program, arg_names) -> list:
    """A class per op. Two ops share a class when their primitive, parameters,
    shapes and source line are alike and their operands come, ``CLASS_DEPTH``
    producers back, from alike ops or from the same parameter of different
    layers (``_arg_class``). The layers of a model written as a loop (a
    Python loop, or a scan the tracer writes out) then fall into one class
    per op of a layer; with ``CompileOptions.tie_layers`` every op of a
    class takes the same signature (one node of the problem,
    :mod:`sbpjax.compiler.formulate`): an L-layer model has about one
    layer's decisions. It is a restriction (layers could choose
    differently)."""
    producer = {}
    own = []
    for index, node in enumerate(program.nodes):
        for j, o in enumerate(node.outs):
            producer[id(o)] = (index, j)
        own.append(own_class(node))
    args = {id(v): hash(("arg", arg_class(n), tuple(v.shape))) for v, n in zip(program.inputs, arg_names)}
    level = list(own)
    for _ in range(CLASS_DEPTH):
        prev, level = level, []
        for index, node in enumerate(program.nodes):
            operands: list = []
            for a in node.ins:
                if id(a) in args:
                    operands.append(args[id(a)])
                elif id(a) in producer:
                    i, j = producer[id(a)]
                    operands.append((prev[i], j))
                else:
                    operands.append(("const", tuple(a.shape)))
            level.append(hash((own[index], tuple(operands))))
    return level


def same_candidates(cands, same_choice) -> None:
    """Give the ops of each ``same_choice`` key one candidate list (in place):
    the union of theirs (each op's domain is cut by its own producers'
    layouts, so alike ops may keep different lists, and one node could not
    then hold them all)."""
    if same_choice is None:
        return
    groups: dict = {}
    for i, key in enumerate(same_choice):
        if key is not None:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        common, seen = [], set()
        for i in members:
            for c in cands[i]:
                k = (tuple(map(tuple, c[0])), tuple(map(tuple, c[1])))
                if k not in seen:
                    seen.add(k)
                    common.append(c)
        for i in members:
            cands[i] = list(common)


def own_class(node) -> int:
    """What an op is, apart from where its operands come from."""
    params = tuple(sorted((k, str(v)[:200]) for k, v in node.eqn.params.items()))
    return hash(
        (
            node.name,
            node.source,
            node.region > 0,
            tuple((tuple(a.shape), dtype_name(a.dtype)) for a in node.ins),
            tuple(tuple(o.shape) for o in node.outs),
            params,
        )
    )


def loop_classes(program) -> list:
    """Per op, its class among the iterations of a written-out scan (None
    outside scans): the k-th op of a kind in one iteration's body shares its
    class with the k-th of that kind in every other iteration of the loop (the
    outermost loop, for nested ones). Sharing their choices, the iterations
    take the same layouts, their carries a fixed point, and the lowering rolls
    them back into one loop (``sbpjax.compiler.loops``); an iteration whose
    carry arrives in another layout boxes it on entry, outside the loop.

    The ops that index each iteration's slices out of the stacked operands
    (``Iteration.slicing``) share theirs too, the k-th of one iteration with
    the k-th of every other: a slice's layout is otherwise a tie between
    making it in the layout the body reads and a free boxing in the body, and
    iterations that break the tie differently cannot roll into one loop. On
    the model zoo's scanned decoder (jax 0.10.2) the backward loop kept 2 of
    its 4 iterations, writing out the 2 whose slices came the other way, and
    peaked at 11.0 MB; sharing, it keeps all 4 and peaks at 7.9 MB (GSPMD:
    8.9 MB), with the same bytes."""
    out: list = []
    seen: dict = {}
    sliced: dict = {}  # id(node) -> its class, for the ops slicing the outermost loops' xs
    for loop in program.loops:
        for it in loop.iterations:
            for k, node in enumerate(it.slicing):
                # what the op is apart from its index (a slice merged with an equal one
                # before the loop, trace.LOOP_SLICES = False, shifts k: no class then joins
                # ops of different shapes)
                shapes = (tuple(tuple(a.shape) for a in node.ins), tuple(tuple(o.shape) for o in node.outs))
                sliced[id(node)] = hash(("slice", id(loop), k, node.name, shapes))
    for node, where in zip(program.nodes, loop_owners(program)):
        if where is None:
            out.append(sliced.get(id(node)))
            continue
        loop, q = where
        kind = own_class(node)
        k = seen.get((id(loop), q, kind), 0)
        seen[(id(loop), q, kind)] = k + 1
        out.append(hash(("loop", id(loop), kind, k)))
    return out


def loop_owners(program) -> list:
    """Per op, ``(loop, iteration position)`` of the outermost written-out scan
    whose iteration computes it, or None outside scans."""
    owner: dict = {}  # id(Var) -> (loop, iteration position); outer loops come last and win
    for loop in program.loops:
        for q, it in enumerate(loop.iterations):
            for vid in it.made:
                owner[vid] = (loop, q)
    return [owner.get(id(node.outs[0])) if node.outs else None for node in program.nodes]
