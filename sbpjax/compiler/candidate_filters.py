"""Which of an op's candidate signatures the solver is offered, beyond the
operands' domains (:class:`sbpjax.compiler.domains.Domains`): rules for two
kinds of op, each narrowing near-equal alternatives the solver would
otherwise spend its effort telling apart.

* :func:`in_output_layout`: an elementwise op reads its same-shape operands
  in its output's layout;
* :func:`scalar_sum`: a sum of scalars with a partial term stays a partial
  sum over every axis.
"""

from __future__ import annotations

import numpy as np

from sbpjax.compiler.program import Var
from sbpjax.compiler.reachable import beside_partial
from sbpjax.sbp import Broadcast, Partial


def in_output_layout(node, kept: list, keep_g, product_operands: set) -> list:
    """An elementwise op's candidates that read its same-shape operands
    in the output's layout (no operand zero-filled into a partial the
    others do not have): far fewer near-equal alternatives for the solver
    to tell apart. ``keep_g``: the greedy pass's candidate, always kept;
    ``product_operands``: the ids of the values a contraction reads.

    One exception (``beside_partial``): a product or quotient read by a
    contraction may read its whole factor or divisor beside a partial
    sum, (sum_i a_i) * b = sum_i a_i * b, so that the contraction reduces
    the partial at its smaller output: a top-2 MoE's expert gradient (a
    gelu between two expert einsums) moved 2.90x GSPMD's bytes at 1,024
    tokens without it, 0.83x with it. Each limit was measured:

    * only mul and div: offered to every elementwise op (a select's whole
      predicate beside partial branches), the demo's solve took 25 s and
      stopped at a 21% gap;
    * only where a contraction reads the result: offered to
      optax.MultiSteps' accumulating divisions, it kept partial gradients
      in the state to save one collective's latency, then the plan's peak
      sent choose() back to greedy's plan: 317 kB against 139 kB (GSPMD
      156 kB);
    * only to an op with a choice already: an op whose operands fix its
      one signature stays fixed. Offered there too, ~20 ops per GPT layer
      became decisions of their own, the 8-layer compiler row's solve went
      from 1.9 s to 3.7 s, and no row moved a byte less."""
    shape = node.outs[0].shape
    same = [i for i, a in enumerate(node.ins) if isinstance(a, Var) and a.shape == shape]
    strict = [c for c in kept if c == keep_g or all(c[0][i] == c[1][0] for i in same)]
    if len(strict) > 1 and node.name in ("mul", "div") and id(node.outs[0]) in product_operands:
        strict = [c for c in kept if c == keep_g or all(beside_partial(c[0][i], c[1][0]) for i in same)]
    return strict


def scalar_sum(node, cs, dom: dict, grid, weights_whole: bool):
    """A sum of scalars with a partial term (the squared norms that
    ``optax.clip_by_global_norm`` adds up, a loss of several terms) takes
    the partial sum over every axis, where offered: each term becomes one
    for free (B -> P keeps it on one device, a partial stays), and one
    all-reduce of a few bytes, where a nonlinear op first reads the sum,
    ends it. One candidate per add also keeps the chain from tying every
    layer's gradient layouts together: a 2-layer Llama-style step with
    clipping on 2x4 took 26 s to plan and stopped at a 28% gap; now
    3 s, proven, for the same plan (17,318,000 B). Sums of whole terms
    (a step count plus one) are left as they are: a partial there would
    cost an all-reduce that nothing saves.

    Where every weight a product reads is given replicated (data
    parallelism: ``weights_whole``), the sum of whole terms is offered
    beside the partial one: the gradients are all-reduced whole for the
    update anyway, and the norm is computed whole with no collective of
    its own, as GSPMD computes it (the partial sum cost one more
    all-reduce, of 4 bytes, after the gradients'). Decision: that gate
    rather than every sum: offered everywhere, the clipped Llama-style
    step above planned in 4.8 s instead of 1.4 s (the same plan); and
    rather than a test of what the terms are made from, which could not
    tell the two steps apart (the greedy pass makes both steps'
    gradients partial sums before reducing them).

    ``dom``: each value's layouts so far (``Domains.dom``); ``grid``: the
    placement's shape."""
    if node.name not in ("add", "add_any", "sub") or node.outs[0].shape != () or len(cs) < 2:
        return cs
    if not np.issubdtype(node.outs[0].dtype, np.inexact):
        # an index's arithmetic (a loop's counter, a position made
        # non-negative) adds whole integers: as a partial sum each step of
        # a decode loop all-reduced its position (15 collectives where
        # GSPMD runs 8)
        return cs
    if not any(
        isinstance(a, Var) and any(any(isinstance(q, Partial) for q in nd) for nd in dom.get(id(a), ()))
        for a in node.ins
    ):
        return cs
    full = [
        c
        for c in cs
        if all(p == 1 or (isinstance(q, Partial) and q.op == "sum") for q, p in zip(c[1][0], grid))
    ]
    if full and weights_whole:
        whole = [c for c in cs if all(isinstance(q, Broadcast) for nd in c[0] + c[1] for q in nd)]
        return full + whole
    return full or cs
