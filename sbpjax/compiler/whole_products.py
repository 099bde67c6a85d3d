"""Which products may run whole on an axis of the placement.

A matmul or convolution computed whole on every device of an axis runs that
many times over, so :class:`~sbpjax.compiler.domains.Domains` keeps only the
candidates that use every device (Alpa's rule), but where a product may run
whole there (``WholeProducts.whole_already``): on an axis the caller left
idle, with a weight the caller left whole there on operands already whole,
over values derived from such products, and small products of values
reduced there (Muon's Newton-Schulz iterations). The sets these rules read
are filled in program order (``derive``), as the domains are.
"""

from __future__ import annotations

import numpy as np

from sbpjax.compiler.program import Var
from sbpjax.compiler.propagation import NESTED
from sbpjax.sbp import Broadcast, Partial, Split

HEAVY = ("dot_general", "conv_general_dilated")


class WholeProducts:
    """The rules, over the domains ``dom`` as they are filled (shared with
    ``Domains``): ``weights`` are the arguments and their views,
    ``broadcast_weights`` those and their broadcasts, ``data`` the data
    arguments, ``idle`` the axes the caller left idle."""

    def __init__(self, grid, idle, dom, weights, broadcast_weights, data):
        self.grid, self.idle, self.dom = grid, idle, dom
        self.weights, self.broadcast_weights, self.data = weights, broadcast_weights, data
        # (axis, batched) -> ids of the operands of products with a replicated
        # weight there (with batch dimensions or not); filled in program
        # order, so before the weight's gradient reads them
        self.whole_operands: dict = {}
        # axis -> ids of values computed from products run whole there with a
        # replicated weight, and from such values (``whole_already``)
        self.whole_derived: dict = {}
        # axis -> ids of values made as partials there, and of values computed
        # from them with scalars and weights (``_derive_reduced``)
        self.reduced: dict = {}
        # axis -> ids of values non-product ops compute from scalars and weights whole there
        self.weighted: dict = {}

    def derive(self, node) -> None:
        """Record what ``node``'s results are, its domains set: reduced
        values, and values derived from whole products (not for products)."""
        self._derive_reduced(node)
        if node.name not in HEAVY:
            self._derive_whole(node)

    def spread(self, node, kept: list) -> list:
        """A contraction's candidates that use every device (Alpa's rule),
        unless none is left.

        Computing a contraction whole on every device of an axis moves the
        fewest bytes when weights are smaller than activations (gather the
        weights, never reduce) but multiplies its time by the axis size (8x a
        tensor-parallel step); such candidates stay out unless nothing else is
        left. The greedy choice may be one (it is then not kept), so the
        guarantee against greedy is the comparison in choose().

        One exception of ``whole_already`` (the others are listed there): a
        product with a weight the caller left B on the axis, on operands that
        exist whole there already (a head on a Megatron block's replicated
        residual stream), and that weight's gradient. Nothing is gathered for
        it and GSPMD computes it there whole; splitting the batch over the
        tensor axis instead made the head's weight gradient a partial over
        both axes: 23.5 MB on linen_mlp (models.py) against GSPMD's 22.4 (now
        21.9). Wider exceptions (any
        product without batch dimensions whose operands may be whole there,
        so also split weights' gradients) added near-ties that left the
        scanned decoder's time-limited solve at 107 MB instead of 94 on jax
        0.12, above GSPMD's 99."""
        excepted = {a for a, p in enumerate(self.grid) if p > 1 and self.whole_already(node, a)}
        spread = [
            c
            for c in kept
            if not any(
                p > 1 and a not in excepted and all(isinstance(nd[a], Broadcast) for nd in c[0] + c[1])
                for a, p in enumerate(self.grid)
            )
        ]
        return spread or kept

    def whole_already(self, node, axis) -> bool:
        """Whether ``node`` is a product that may run whole on ``axis``: one
        with a weight the caller replicated over ``axis`` (an argument, or a
        transpose, cast or reshape of one, whole there in every layout it
        may take: a tied head reads ``emb.T``; with batch dimensions, a Switch
        MoE's experts left whole over the tokens' axis), or that weight's
        gradient (a product reading an operand such a product read); a
        product with batch dimensions whose operands are all computed from
        such products' results (``whole_derived``: attention over a learned
        latent array, run replicated where its projections are); and none of
        its operands exists only split over ``axis`` (using it whole there
        would be a gather). Any contraction may run whole on an axis the
        caller left idle (``self.idle``), and a product of values reduced
        there no larger than what it reads (``_small_reduced_product``:
        Muon's Newton-Schulz iterations).

        The experts: a capacity-limited Switch MoE with experts split over y
        and tokens over x on 2x4 moved 149,664 B where GSPMD, running each
        expert whole on x, moves 68,640 (the experts' gradients then need no
        reduction over x): held to every device, the expert products split
        their capacity over x and their gradients were gathered back. Now
        65,696 B (92,592 against 95,280 on 4x2)."""
        if axis in self.idle:
            return True
        if node.name != "dot_general":
            return False
        if self._reads_split_only(node, axis):
            return False
        derived = self.whole_derived.setdefault(axis, set())
        values = [a for a in node.ins if isinstance(a, Var)]
        if self._small_reduced_product(node, axis):
            return True
        batched = bool(node.eqn.params["dimension_numbers"][1][0])
        if batched and values and all(id(a) in derived for a in values):
            derived.update(id(o) for o in node.outs)
            return True
        # a batched product's operands and an unbatched one's are kept apart:
        # an expert's gradient reads what the expert read, and attention over
        # a layer's input (batched) is not a weight's gradient
        seen = self.whole_operands.setdefault((axis, batched), set())
        weight = any(
            id(a) in self.weights and all(isinstance(nd[axis], Broadcast) for nd in self.dom[id(a)])
            for a in values
        )
        if weight:
            seen.update(id(a) for a in values)
            derived.update(id(o) for o in node.outs)
        return weight or any(id(a) in seen for a in values)

    def _reads_split_only(self, node, axis) -> bool:
        """Whether an operand of ``node`` exists only split over ``axis``
        (using it whole there would be a gather)."""
        return any(
            isinstance(a, Var) and all(isinstance(nd[axis], Split) for nd in self.dom.get(id(a), ()))
            for a in node.ins
        )

    def _derive_whole(self, node) -> None:
        """Mark the results of a non-product op whole-derived on each axis
        where all its operands are whole-derived or weights, one at least
        derived (a softmax of scores computed whole, a residual sum)."""
        values = [a for a in node.ins if isinstance(a, Var)]
        for derived in self.whole_derived.values():
            if any(id(a) in derived for a in values) and all(
                id(a) in derived or id(a) in self.weights for a in values
            ):
                derived.update(id(o) for o in node.outs)

    def _derive_reduced(self, node) -> None:
        """Mark the results of ``node`` reduced on each axis where its kept
        candidates give them as partials there: some candidate, for a product
        contracting a dim split over the axis (a Gram matrix ``x @ x.T`` of a
        matrix split by columns, a gradient over a split batch), every
        candidate for other ops; or where the op computes
        them from reduced values and neutral ones: scalars, weights whole on
        the axis (arguments that are not data, their views and broadcasts)
        and what non-product ops compute from those alone (``self.weighted``:
        a momentum decayed, ``b1 * mu``). So ``b1 * mu + (1 - b1) * g`` of a
        reduced gradient ``g`` is reduced, and so is ``a / norm``. A product
        of reduced values that may run whole (``_small_reduced_product``)
        makes reduced values too.

        Some candidate of a product, not every one: a matrix split by columns
        over both axes of 2x4 and normalized may also be split by rows over x
        (the division's domain keeps both), so its Gram matrix could be made
        split there too. Counted reduced only where every candidate was
        partial, its square was not offered whole on x: each Newton-Schulz
        iteration split it by rows and gathered it back, 368,696 B in 11
        collectives against GSPMD's one all-reduce per iteration (286,776 B
        in 6, as it now moves)."""
        values = [a for a in node.ins if isinstance(a, Var)]
        # a product or a nested program: its weights are not neutral (they are multiplied in)
        product = node.name in HEAVY or node.name in NESTED
        for axis, p in enumerate(self.grid):
            if p == 1:
                continue
            reduced = self.reduced.setdefault(axis, set())
            weighted = self.weighted.setdefault(axis, set())

            def neutral(a, axis=axis, weighted=weighted):
                if not a.shape or id(a) in weighted:
                    return True
                whole = all(isinstance(nd[axis], Broadcast) for nd in self.dom.get(id(a), ()))
                return whole and id(a) in self.broadcast_weights and id(a) not in self.data

            if product:  # only a product that may run whole on its reduced operands passes them on
                made = (
                    node.name == "dot_general"
                    and not self._reads_split_only(node, axis)
                    and self._small_reduced_product(node, axis)
                )
            else:
                made = any(id(a) in reduced for a in values) and all(
                    id(a) in reduced or neutral(a) for a in values
                )
                if values and all(neutral(a) for a in values):
                    weighted.update(id(o) for o in node.outs)
            for o in node.outs:
                lays = self.dom.get(id(o), ())
                partial = (any if node.name in HEAVY else all)(isinstance(nd[axis], Partial) for nd in lays)
                if made or (lays and partial):
                    reduced.add(id(o))

    def _small_reduced_product(self, node, axis) -> bool:
        """Whether ``node`` is a product of values reduced on ``axis``
        (``_derive_reduced``) that is no larger than what it reads: no batch
        dimension longer than 1 and no more output elements than its largest
        operand has (the Gram matrices of Muon's Newton-Schulz iterations,
        ``optax.contrib.muon``, and their products with the matrix). Run
        whole there, it reads its operands whole, as one all-reduce leaves
        them, where split over every device it reduce-scatters and gathers
        them back; the solver weighs the bytes. Products of
        activations (a batch, a sequence longer than the width) are left to
        the rule that products use every device: whole, they would repeat a
        model's main FLOPs on every device of the axis."""
        values = [a for a in node.ins if isinstance(a, Var)]
        reduced = self.reduced.get(axis, ())
        if not values or not all(id(a) in reduced for a in values):
            return False
        (_, _), (lb, _) = node.eqn.params["dimension_numbers"]
        if any(node.ins[0].shape[d] > 1 for d in lb):
            return False
        largest = max(int(np.prod(a.shape)) for a in node.ins)
        return all(int(np.prod(o.shape)) <= largest for o in node.outs)
