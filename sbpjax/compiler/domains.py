"""Which signatures each op may take, and which layouts each value may be in.

The layout choice (:mod:`sbpjax.compiler.choose`) picks one candidate
nd-signature per op. Here the candidates are made (every product of the
rule's 1-D signatures over the placement's axes that fits the pieces) and
then narrowed (:class:`Domains`) to those that use each input in a layout it
can be in without an invented conversion: a layout its producer can give it,
a reduction of one of its partials, or the layout the greedy pass used. The
narrowing keeps the problem small and removes near-ties; the greedy pass's
choice always stays, so the optimum over the narrowed space never costs more
than greedy's plan. An ``sj.AUTO`` argument's domain is every layout
:func:`sbpjax.compiler.auto.auto_layouts` lists.
"""

from __future__ import annotations

from sbpjax.compiler.candidate_filters import in_output_layout, scalar_sum
from sbpjax.compiler.data import batch_axes, data_arguments
from sbpjax.compiler.program import Var
from sbpjax.compiler.reachable import (
    contracts_split,
    drawn,
    free_gathered,
    gathered_beside,
    gathered_splits,
    ids_whole,
    local_slices,
    moved_splits,
    partly_gathered,
    reached,
    reductions,
    sliced_to,
    table_gathered,
    two_d,
    unfilled,
)
from sbpjax.compiler.screen import OperandIndex
from sbpjax.compiler.whole_products import HEAVY, WholeProducts
from sbpjax.rules.elementwise import ELEMENTWISE
from sbpjax.sbp import Broadcast, Split

VIEWS = ("transpose", "convert_element_type", "reshape", "copy")


class Domains:
    """Which layouts each value may take, to keep the integer program small.

    A value's producer layouts are those its producer's kept candidates give;
    a consumer's candidates are kept when each input is used in a layout the
    value can be in without an invented conversion: a producer layout, one of
    its partials reduced (to B or to a split of any dim, the layouts a
    reduction makes), the layout the greedy pass used, at a product a
    layout an earlier product may read it in (``product_reads``), in a
    scan's later iteration a layout of the first iteration's carry
    (``_uses``), its slices of stacked arguments as arguments, an
    embedding lookup's ids whole over the axes its table is split over
    (``ids_whole``) or its table gathered over the axes its ids are
    split over (``table_gathered``), and a broadcast weight read by an
    elementwise op sliced locally (``local_slices``). The greedy choice is
    kept (except a contraction computed whole on an axis, below), so the
    program's optimum is at most greedy's bytes; layouts
    flow forward from the annotations as they do in GSPMD's propagation, so a
    choice that keeps a parameter's split through its matmuls is in the space
    even where greedy gathered it. Contractions computed whole on an axis are
    left out where another candidate exists (see ``restrict``)."""

    def __init__(self, program, placement, in_layouts, greedy, idle=frozenset()):
        self.grid = placement.shape
        self.dom: dict = {id(v): set(lays) for v, lays in zip(program.inputs, in_layouts)}
        # Weights split over the batch's axis alone (ZeRO-3 / FSDP) may be
        # gathered at contractions (``_gathered``) on a placement of one axis
        # of size > 1, which the batch then spans, and on a placement of
        # several where none is idle: a weight split over the batch's axis
        # beside tensor parallelism over the other (attention's heads over y,
        # its output kernel's rows over x, 2x4) was otherwise never gathered,
        # and the plan moved the activations around it: 220,240 B in 14
        # collectives for an attention step against GSPMD's 151,584 (now
        # 106,552 in 7). A 2-layer GPT at d 64 laid out so moved 5.03 MB in
        # 33 collectives at a 16.5% gap on 2x4, now 3.91 MB in 12, proven
        # (GSPMD 6.26 MB); on 4x2 4.80 MB at a 4.9% gap, above GSPMD's 4.49,
        # now 4.03. Decision: not where an axis is idle. ZeRO-3 over x of that
        # GPT with y idle, offered, moved 6.64 MB in 27 collectives on 4x2
        # instead of 4.95 MB in 24, and 4.99 MB instead of 4.64 on 2x4 (though
        # 5.05 instead of 5.98 with the kernels split by rows, 10.82 instead
        # of 12.14 at d 128; GSPMD 17.6, 25.2, 6.72 and 51.1 MB): the solve
        # charges a launch per gradient reduction that XLA combines into one.
        # And weights only there (``_gathered``): the batch itself offered
        # gathered over x (as on one axis, where it spans every device), a
        # Perceiver step with Megatron over y on 2x4 moved 792,704 B in 8
        # collectives instead of 532,512 in 7.
        self.one_axis = one_axis = sum(p > 1 for p in self.grid) == 1
        # data arguments count as made for free_gathered (weights: _gathered)
        self.data = data_arguments(program)
        gathers_batch = one_axis or not idle
        self.batch_axes = (
            batch_axes(program, in_layouts, self.grid, self.data) if gathers_batch else frozenset()
        )
        self.args = {id(v) for v in program.inputs}
        # A scan's slice of a stacked argument (``lax.index_in_dim`` of a
        # layer stack, written out as a slice and a squeeze) counts as an
        # argument: a layer's weight, as it is in the same model unrolled.
        # Without it a scanned GPT with FSDP and tensor parallelism (2x4,
        # batch 16) was never offered its kernels gathered over the FSDP axis
        # (``_gathered``): 7.23 MB against GSPMD's 9.00 MB, 5.76 MB with it
        # (4.47 MB with ``table_gathered`` too).
        # Data arguments' slices (a batch's inputs and its shifted labels) stay
        # values: a product reads them as the greedy pass made them.
        self.args |= reached(program, self.args - self.data, ("slice", "squeeze"))
        # values that are an argument seen another way (a transpose, a cast, a
        # reshape): the tied embedding's ``emb.T``, a bf16 copy of a kernel
        self.weights = self.args | reached(program, self.args, VIEWS)
        # weights and their broadcasts (a layernorm's scale, a bias), which an
        # elementwise op may read locally sliced (``local_slices`` in ``restrict``)
        self.broadcast_weights = self.weights | reached(
            program, self.weights, (*VIEWS, "broadcast_in_dim", "squeeze", "expand_dims")
        )
        # values computed from no argument but PRNG keys (a noise draw, an iota)
        self.drawn = drawn(program)
        self.greedy = greedy.decisions
        # each value's layout as the greedy pass made it (arguments: their given layout)
        self.made: dict = {id(v): lays[0] for v, lays in zip(program.inputs, in_layouts) if len(lays) == 1}
        for d in self.greedy:
            self.made.update((id(o), nd) for o, nd in zip(d.node.outs, d.out_sbp))
        # Axes the caller left idle (``propagation.idle_axes``). Data parallelism
        # annotated on 4x2 splits the batch over x and nothing over y; GSPMD
        # then runs the step replicated over y and all-reduces the gradients
        # over x once. Holding contractions to "use every device" there made
        # the solve split attention's heads over y and regather them:
        # 1,479,728 B in 20 collectives on a 2-layer GPT at d 32 against
        # GSPMD's 1,382,448 B in 1. On an idle axis running a contraction
        # whole gathers nothing (see ``WholeProducts.whole_already``).
        self.idle = idle
        # which products may run whole on an axis (``_using_every_device``)
        self.whole = WholeProducts(self.grid, idle, self.dom, self.weights, self.broadcast_weights, self.data)
        self.screen = OperandIndex()
        # each later iteration's carry -> the first iteration's (see _uses)
        self.carry_of: dict = {}
        for loop in program.loops:
            carried = slice(loop.n_consts, loop.n_consts + loop.n_carry)
            first = loop.iterations[0].ins[carried]
            for it in loop.iterations[1:]:
                for a, b in zip(it.ins[carried], first):
                    if isinstance(a, Var) and isinstance(b, Var) and a is not b:
                        self.carry_of[id(a)] = b
        # values a contraction reads (a partial may reach one through a product: ``restrict``)
        self.product_operands = {
            id(a) for n in program.nodes if n.name in HEAVY for a in n.ins if isinstance(a, Var)
        }
        # Whether every weight a product reads is replicated, as given (data
        # parallelism): the squared norms a global-norm clip sums are then of
        # gradients made whole for the update (``candidate_filters.scalar_sum``).
        self.weights_whole = all(
            len(lays) == 1 and all(isinstance(q, Broadcast) for q in lays[0])
            for v, lays in zip(program.inputs, in_layouts)
            if id(v) in self.product_operands and id(v) not in self.data
        )
        # value id -> the layouts the products before this one may read it
        # in. A later product may read it so too: the hub boxes the value once
        # per layout, so a kernel gradient reads the activation its forward
        # product gathered at no further cost. Without it, CLIP's text tower
        # on 2x4 (batch over x, kernels over y) regathered the token means
        # split over both axes and reduce-scattered the kernel's gradient:
        # 2,200,744 B against GSPMD's 1,769,824 (now 1,758,352).
        self.product_reads: dict = {}

    def _uses(self, atom) -> set:
        # An S or P over an axis of size 1 is B (a user's (B, S(1)) on an 8x1
        # placement): the normalized form too. Gathering a split value to B is
        # not offered (only greedy's own gathers are, and an embedding
        # lookup's ids: ``ids_whole``): bytes alone would then
        # gather a small batch and run the whole step replicated on every
        # device (Alpa likewise enumerates only strategies that use every
        # device).
        base = self.dom.get(id(atom), set())
        first = self.carry_of.get(id(atom))
        if first is not None:
            # A scan's later iteration may read its carry in a layout the
            # first iteration's carry may take (boxed back at the iteration's
            # end, the form a rolled loop runs: one layout per iteration).
            # Without it the layer stack of a scanned GPT with FSDP and tensor
            # parallelism (2x4, 2 layers, batch 16) ran its second layer in
            # the layouts its first layer's end made: 10.68 MB against GSPMD's
            # 9.00 (now 8.90).
            base = base | self.dom.get(id(first), set())
        base = base | {tuple(Broadcast() if p == 1 else q for p, q in zip(self.grid, nd)) for nd in base}
        out = set(base)
        for nd in base:
            out |= reductions(nd, len(atom.shape))
        return out

    def _gathered(self, arg) -> set:
        """A weight's layouts with its split over one axis gathered: an
        argument split over two or more axes (the data and the tensor axes,
        FSDP with tensor parallelism), all-gathered over one of them where a
        contraction reads it, as ZeRO-3 and GSPMD do; and on a placement of
        one axis of size > 1, or of several none idle (see ``__init__``), an
        argument split over the batch's axis
        (``batch_axes``: FSDP on 8x1, where no weight is split over two
        axes; its kernels were otherwise kept split, their matmuls moving
        activations by all-to-alls: a 2-layer MLP at d 32 moved 301,112 B
        in 12 collectives, gathered 258,104 B in 8, GSPMD 344,120 B in 5).
        Only such arguments, and only at contractions: the contraction
        still uses every device
        (``restrict`` drops one computed whole on an axis), so the batch is
        not gathered by it. Without these a 3-layer MLP with kernels split
        over both axes of 4x2 kept its weights split and permuted
        activations around them: 302 kB where gathering each kernel once
        moves 188 kB (GSPMD: 324 kB).
        Decision: not for weights split over a tensor axis alone (Megatron's). Offered
        there too (gathering a tensor-parallel kernel to split the batch over
        the tensor axis), they moved no GPT sweep row of
        ``benchmarks/compiler.py`` to fewer bytes, slowed the 1- and 4-layer
        solves from 4 s to 12 s, and left the shared solves of the 8- and
        32-layer GPTs far from their bounds (71-73%), at 2.2x the bytes
        (36.2 MB and 139.9 MB against 16.2 MB and 63.5 MB)."""
        out = set()
        for nd in self._uses(arg):
            wide = two_d(nd, self.grid)
            for a, q in enumerate(nd):
                if isinstance(q, Split) and (
                    wide or (a in self.batch_axes and (self.one_axis or id(arg) not in self.data))
                ):
                    out.add(nd[:a] + (Broadcast(),) + nd[a + 1 :])
        # and sliced locally over the axes it is then whole on: the kernel
        # of rows split over x gathered, then its rows split over y where the
        # activations it meets split their features over y (the attention
        # step in ``__init__``: the gathers alone left it at 220,240 B); the
        # compiler benchmark's budget GPT (d 128, 2x4) laid out ZeRO-3 over
        # both axes by hand moved 15.84 MB before, 14.41 MB with them
        return out | local_slices(out, arg.shape)

    def restrict(self, index, node, cs):
        """The candidates ``cs`` of op ``node`` (decision ``index``) kept for
        the solver: each operand read in a layout it may be in (``_reads``),
        an elementwise op's same-shape operands in its output's layout, a
        contraction using every device; greedy's candidate always stays, but
        for a contraction computed whole on an axis. Records the layouts the
        op's results may then take."""
        dec = self.greedy[index]
        keep_g = (list(dec.in_sbp), list(dec.out_sbp))
        if len(cs) > 1:
            uses = self._reads(node, dec.in_sbp, cs)
            # each operand's allowed layouts, greedy's among them, so greedy's own
            # candidate passes the screen (8,700 ops on a 32-layer step: bitsets
            # per candidate list, OperandIndex, not a test per candidate)
            allow = [None if u is None else u | {tuple(g)} for u, g in zip(uses, dec.in_sbp)]
            kept = self.screen.reading(cs, allow)
            if node.name in ELEMENTWISE:
                kept = in_output_layout(node, kept, keep_g, self.product_operands)
            if node.name in HEAVY:
                kept = self._using_every_device(node, kept)
            elif keep_g not in kept:
                kept.append(keep_g)
            cs = scalar_sum(node, kept, self.dom, self.grid, self.weights_whole)
        for j, o in enumerate(node.outs):
            self.dom[id(o)] = {c[1][j] for c in cs}
        self.whole.derive(node)
        return cs

    def _reads(self, node, greedy_reads, cs) -> list:
        """Per operand of ``node``, the layouts it may be read in (None for a
        constant): those ``_uses`` gives, widened for the op's kind
        (``greedy_reads``: the layouts the greedy pass reads them in; ``cs``:
        the op's candidate signatures)."""
        uses: list = [self._uses(a) if isinstance(a, Var) else None for a in node.ins]
        alike = [  # operands (i, j) of one shape, both values
            (i, j)
            for i, a in enumerate(node.ins)
            for j, b in enumerate(node.ins)
            if i != j and uses[i] is not None and uses[j] is not None and a.shape == b.shape
        ]
        if node.name in HEAVY or node.name == "add_any":
            # A contraction or a sum of gradients may also take an operand in
            # a layout another operand of the same shape has (an activation
            # and its gradient meeting at a kernel gradient, or two gradients
            # of one value, one split along height, the other along the
            # batch): one is boxed to the other's layout, where the producer
            # layouts alone would leave a gather, or zero-filling both into a
            # partial that is reduced later at full size. (All elementwise
            # ops would triple the integer program for little more.)
            for i, j in alike:
                uses[i] = uses[i] | self._uses(node.ins[j])
        elif node.name in ELEMENTWISE:
            self._elementwise_reads(node, uses, alike)
        if node.name in ELEMENTWISE:  # add_any too
            self._beside_zero_fill(node, uses, greedy_reads)
        elif node.name not in HEAVY:
            self._gathered_or_moved_reads(node, uses, greedy_reads, cs)
        if node.name in HEAVY:
            self._product_reads(node, uses, greedy_reads)
        table = node.ins[0] if node.name == "gather" else None
        if isinstance(table, Var) and id(table) in self.weights and uses[1] is not None:
            uses[1] = uses[1] | ids_whole(self.dom.get(id(table), ()), uses[1], self.grid)
            if uses[0] is not None:
                uses[0] = uses[0] | table_gathered(uses[0], uses[1], self.grid)
        return uses

    def _elementwise_reads(self, node, uses: list, alike: list) -> None:
        """Widen ``uses`` in place for an elementwise op.

        An argument whole on an axis may be read split there as another
        operand of its shape may be (a free local slice): a replicated
        optimizer state meeting a tensor-split gradient. optax.MultiSteps'
        accumulation kept its gradients partial over both axes without it:
        4.69 MB against GSPMD's 2.20 (now 1.93). Arguments only: their
        domains are given, not grown layer by layer. Offered for every
        operand (1.15 MB there), alike layers of the demo's GPT stopped
        sharing one decision (1,131 decisions instead of 724, a 3.7 s solve
        instead of 1.7).

        A broadcast weight (a layernorm's scale, a bias) may be read sliced
        from any layout it has, so that the op can follow its full-size
        operand's split: the slice moves nothing. Before, only the split the
        greedy pass gave the scale was offered, so a scanned GPT with FSDP and
        tensor parallelism (2x4, 2 layers, batch 16) could run its first
        layer with the residual stream split along its width but not its
        second: 8.90 MB against GSPMD's 9.00 MB, now 7.23 MB (4 layers 17.39
        -> 13.77 MB, GSPMD 17.04). Broadcast weights only: offered for any
        broadcast operand (a layernorm's mean too), a 3-layer GPT sweep step
        (4x2, 2-D kernels, seed 849) gathered an activation for its layernorm
        and sliced the result back, which XLA on jax 0.12 removes, so the plan
        no longer counted what XLA runs.

        A broadcast operand that can only be whole (``_whole_everywhere``: a
        factor computed from replicated optimizer state) may be read sliced
        too: no gather precedes its slice. optax.adafactor's update of a
        row-split kernel (2x4) all-reduced the gradient whole to meet its
        replicated row factors: 721,024 B against GSPMD's 337,120 (now
        337,072); 829,856 -> 445,904 B on a 3-layer MLP (GSPMD 445,952).
        Likewise an operand of the op's shape drawn whole (computed from no
        argument but PRNG keys, ``reachable.drawn``): a VAE's noise
        ``jax.random.normal(key, mu.shape)`` met ``exp(0.5 * logvar)`` split
        over the batch and whole over the model axis (2x4, Megatron encoder);
        read whole there, the product ran split over both axes and the latent
        was gathered back for the decoder: 188,960 B in 5 collectives against
        GSPMD's 185,888 B in 4. Draws only: offered for any value that can
        only be whole, optax's Muon (2x4) split its momentum's sum, so its
        Newton-Schulz products, run whole before, were held to use every
        device (``restrict``): 1.57 MB in 28 collectives instead of 1.41 MB
        in 18."""
        for i, j in alike:
            a = node.ins[i]
            if id(a) in self.args or (id(a) in self.drawn and self._whole_everywhere(a)):
                uses[i] = uses[i] | {nd for nd in uses[j] if any(sliced_to(m, nd) for m in uses[i])}
        for i, a in enumerate(node.ins):
            if (
                uses[i] is not None
                and a.shape != node.outs[0].shape
                and (id(a) in self.broadcast_weights or self._whole_everywhere(a))
            ):
                uses[i] = uses[i] | local_slices(uses[i], a.shape)

    def _whole_everywhere(self, a) -> bool:
        """Whether ``a`` can only be whole on every axis (its domain is all B)."""
        lays = self.dom.get(id(a), ())
        return bool(lays) and all(all(isinstance(q, Broadcast) for q in nd) for nd in lays)

    def _beside_zero_fill(self, node, uses: list, greedy_reads) -> None:
        """Widen ``uses`` in place where the greedy pass zero-fills a whole
        operand into a partial (``reachable.unfilled``): it may be read whole
        there too, after the partial beside it is reduced. Without it SGD with
        Nesterov momentum on 2x4 (gradient partial over x; momentum replicated)
        reduced both the gradient and the new momentum: 81,920 B against
        GSPMD's 65,536. Zero-filled operands only: widening every operand
        computed from an argument (``0.9 * m``) grew the demo GPT's decisions
        by 45%."""
        for i, a in enumerate(node.ins):
            made = self.made.get(id(a)) if isinstance(a, Var) else None
            whole = None if uses[i] is None or made is None else unfilled(made, greedy_reads[i])
            if whole is not None:
                uses[i] = uses[i] | {whole}

    def _gathered_or_moved_reads(self, node, uses: list, greedy_reads, cs) -> None:
        """Widen ``uses`` in place for an op that is neither a contraction nor
        elementwise (a reshape, an FFT, a sort, a broadcast):

        * an operand may be gathered over only some of the axes the greedy
          pass gathers it over, keeping a split the op can run on:
          ``abs(rfft(x, axis=1))`` of an (S(0), S(1)) ``x`` on 2x4 gathered it
          whole, 43,008 B against 30,976 gathering dim 1 only (GSPMD's 30,976);
        * where no candidate of the op reads the operand as it is made, it may
          be gathered over any of its split axes, or have one split moved to
          another dim (an all-to-all): a zero-fill into a partial, reduced
          later at twice a gather's bytes, or a gather of everything, was
          otherwise the only way to read it (the key and value projections of
          grouped-query attention with 2 key/value heads over 4 devices:
          211,968 B against 193,536 gathered; GroupNorm's reshape of 64
          channels split over 8 devices into 4 groups: 14.7 MB gathered,
          1.8 MB moved to the rows, at (8, 32, 32, 64)); and so where a
          slice strides over a split dim (``_strided_on_split``): the
          levels of ``lax.associative_scan`` halve the sequence with stride
          2, local for as long as the pieces stay aligned, so the greedy
          pass moved each level's values as they lost alignment (25,088 B
          over 8 devices) where moving the inputs once moves 14,336 B
          (GSPMD's 14,336);
        * a vector (rank 1: a bias, a norm's scale or statistics, reshaped to
          be broadcast) may be gathered over any of its split axes: its
          O(width) bytes are what lets the O(batch x width) values it meets
          keep their layouts. The demo GPT (2x4, column-split biases) moved
          10.22 MiB without it, 7.26 MiB with it, in 68 collectives instead
          of 66 and the same 0.5-0.7 s solve;
        * so may the operand of a broadcast that moves a split dim to another
          place (``_shifts_a_split``): a pairwise mask compares values
          broadcast by query (``seg[:, :, None]``) and by key
          (``seg[:, None, :]``), which, made as the operand is, are split on
          different dims, so the comparison could only run after moving one
          of them at full (b, t, t) size. Packed-sequence attention (a token
          sees its own segment, causally; batch over x, time over y on 2x4)
          moved 29,184 B in 14 collectives, the mask and scores split by
          key, where gathering the segment ids moves 13,056 B in 2 (GSPMD:
          13,440 in 3). Decision: only such broadcasts. Offered for every
          broadcast's operand (a norm's statistics broadcast over its
          width), the compiler benchmark's GPT rows planned 2-20x slower
          (the 8x8 row 0.55 s -> 11.8 s) and its 32-layer row stopped at a
          1.4% gap, for at most 3.5% fewer bytes on five rows.

        Offered for every operand of such ops, the demo GPT's solve took
        13.6 s instead of 0.5 s (to 7.24 MiB). Contractions have their own
        (``_gathered``, ``free_gathered``); elementwise ops follow their
        operands' layouts."""
        for i, a in enumerate(node.ins):
            made = self.made.get(id(a)) if isinstance(a, Var) else None
            if uses[i] is None or made is None:
                continue
            uses[i] = uses[i] | partly_gathered(made, tuple(greedy_reads[i]))
            if len(a.shape) == 1:
                uses[i] = uses[i] | gathered_splits(made)
            elif all(tuple(c[0][i]) != made for c in cs) or _strided_on_split(node, made):
                uses[i] = uses[i] | gathered_splits(made) | moved_splits(made, len(a.shape))
            elif _shifts_a_split(node, made):
                uses[i] = uses[i] | gathered_splits(made)

    def _product_reads(self, node, uses: list, greedy_reads) -> None:
        """Widen ``uses`` in place for a contraction: a weight gathered over
        one axis (``_gathered``), an operand made whole for free
        (``free_gathered``), and a layout an earlier product read the operand
        in (``product_reads``)."""
        made = [
            None
            if not isinstance(a, Var) or (id(a) in self.args and id(a) not in self.data)
            else self.made.get(id(a))
            for a in node.ins
        ]
        gathered = [free_gathered(node, i, made) for i in range(len(uses))]
        # the other operand in a layout an earlier product read it in, too: a
        # weight gradient (dy^T h) whose activation the forward product read
        # split on its features meets dy split on the batch it contracts
        for i in range(min(len(uses), 2)):
            if made[i] is None or made[1 - i] is None:
                continue
            for other in self.product_reads.get(id(node.ins[1 - i]), ()):
                if other != made[1 - i]:
                    pair = [made[0], made[1]]
                    pair[1 - i] = other
                    gathered[i] = gathered[i] | free_gathered(node, i, pair)
        # V split by key gathered beside probabilities split by query where
        # greedy split both by key (a partial product): without it attention
        # with the sequence split over 8 devices (a sliding-window mask) moved
        # the probabilities to a split by key and reduce-scattered the
        # partial result, 258,048 B in 3 collectives against GSPMD's 229,376
        # in 2 (now 229,376). Only at products greedy left partial: at every
        # product the space would grow as free_gathered's docstring measured.
        # Partial as greedy read the operands, too: grouped-query attention
        # with the sequence split over 8 devices (2 key/value heads) had its
        # probabilities made whole and sliced by key beside V split by key;
        # V was never offered gathered, and the plan moved the probabilities
        # by key and all-reduced the attention output: 544,768 B against
        # GSPMD's 458,808 (gathering K and V).
        pair_made = len(uses) >= 2 and made[0] is not None and made[1] is not None
        if pair_made and (
            contracts_split(node, made) or contracts_split(node, [tuple(g) for g in greedy_reads[:2]])
        ):
            for i in range(2):
                for other in self.dom.get(id(node.ins[1 - i]), ()):
                    gathered[i] = gathered[i] | gathered_beside(node, i, made[i], other)
        for i, a in enumerate(node.ins):
            if uses[i] is not None and id(a) in self.args:
                uses[i] = uses[i] | self._gathered(a)
            if gathered[i]:
                uses[i] = uses[i] | gathered[i]
            if uses[i] is not None:
                uses[i] = uses[i] | self.product_reads.get(id(a), set())

    def _using_every_device(self, node, kept: list) -> list:
        """A contraction's candidates that use every device, but on the axes
        where it may run whole (``WholeProducts.spread``); records the layouts
        they read (``product_reads``)."""
        kept = self.whole.spread(node, kept)
        for i, a in enumerate(node.ins):
            if isinstance(a, Var):
                self.product_reads.setdefault(id(a), set()).update(c[0][i] for c in kept)
        return kept


def _strided_on_split(node, made) -> bool:
    """Whether ``node`` is a slice with a stride over a dim ``made`` splits."""
    strides = node.eqn.params.get("strides") if node.name == "slice" else None
    if not strides:
        return False
    return any(isinstance(q, Split) and strides[q.dim] > 1 for q in made)


def _shifts_a_split(node, made) -> bool:
    """Whether ``node`` is a broadcast that moves a dim ``made`` splits to
    another place (a new dim before it: the keys' side ``seg[:, None, :]``
    of a pairwise mask)."""
    if node.name != "broadcast_in_dim":
        return False
    dims = node.eqn.params["broadcast_dimensions"]
    return any(isinstance(q, Split) and dims[q.dim] != q.dim for q in made)
