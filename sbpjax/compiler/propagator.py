"""The greedy signature chooser: :class:`Propagator` gives each op, in program
order, the signature whose input boxings cost least given its inputs'
layouts (the walk itself, with its passes, is :func:`sbpjax.compiler.propagate.propagate`).

Fewest bytes first (including the later reduction of a partial made by
zero-filling an input, ``Propagator._partial_debt``, and boxing outputs to
the layouts they are wanted in later), then the tie-breaks of
``SignatureSearch._cheapest`` (:mod:`sbpjax.compiler.signature_search`),
then alpha-beta time, then fewest inputs changed, then the rule's order
(deterministic). The whole-program choice
(:mod:`sbpjax.compiler.formulate`) prices its boxings with the same
:meth:`Propagator.plan` and bounds.

Speed: most ops take their inputs as they are; for the rest, 1-D candidates
are ranked per axis and their products bounded before they are costed
(:mod:`sbpjax.compiler.signature_search`).
"""

from __future__ import annotations

import warnings

from sbpjax._errors import SBPError, SBPWarning
from sbpjax.boxing.plan import bytes_lower_bound, plan_boxing, plan_zeros
from sbpjax.compiler import uneven
from sbpjax.compiler.program import Const, Node, Program, Var, located
from sbpjax.compiler.propagation import (
    CONSTRAIN,
    CONTROL_FLOW,
    NESTED,
    Boxing,
    Decision,
    dtype_ok,
    even_on,
    nbytes,
    op_comm,
    op_key,
    valid_for,
    zero_values,
)
from sbpjax.compiler.signature_search import SignatureSearch
from sbpjax.dtypes import check_partial_dtype
from sbpjax.placement import Placement
from sbpjax.rules import RULES, split_axes
from sbpjax.rules.shifts import prefix_aligned
from sbpjax.sbp import Broadcast, Partial, format_sbp


class Propagator(SignatureSearch):
    def __init__(self, program: Program, placement: Placement, cost_model=None, launch_priced: bool = True):
        self.prog = program
        # plan a boxing that borrows an axis it has nothing to do on by bytes plus latency
        # (LAUNCH PRICED in sbpjax.compiler.propagation)
        self.launch_priced = launch_priced
        self.pl = placement
        self.grid = placement.shape
        self.cm = cost_model
        self.layout: dict = {}  # id(var) -> nd-SBP
        self.versions: dict = {}  # id(var) -> {nd: True}: layouts already produced
        self._plans: dict = {}  # (shape, dtype, src, dst, zero, idle, ring) -> BoxingPlan
        self.idle: frozenset = frozenset()  # idle_axes of the program's arguments
        # each boxing's plan priced by bytes plus its collectives' ring latency
        # (plan_boxing's launch_priced="ring"): the layout choice's second solve
        # (CompileOptions.fewer_collectives)
        self.ring = False
        self._bounds: dict = {}  # (shape, dtype, src, dst) -> lower bound of its bytes
        self._sigs: dict = {}  # id(node) -> its candidate signatures
        self._choices: dict = {}  # (id(node), what the choice depends on) -> (ins, outs) | False
        self._evens: dict = {}  # (nd-SBP, shape) -> whether every split divides
        self.comms: dict = {}  # (id(node), ins, outs) -> the op's own communication
        self.uses: dict = {}  # id(var) -> how many ops and outputs use it
        self.zeros = zero_values(program)
        self.warnings: list = []
        self.quiet = False
        # Rank candidates also by the cost of boxing outputs to their preferred
        # layouts (a last pass only: it helps some programs and hurts others,
        # so propagate() keeps it only where it moves fewer bytes).
        self.rank_with_prefs = False
        self.ranked_apart = False  # whether that ranking would have kept another candidate

    def prefer(self, out_sbp):
        """Layouts values would like to end in: an output's ``out_sbp``, carried
        backwards through chains of same-shape elementwise ops (an optimizer
        update, an activation). The forward choice then counts boxing an output
        to its preference, so it does not pick a layout that is cheap now but
        must be boxed back at the end (e.g. reduce-scatter a gradient, update
        sharded, all-gather three tensors, instead of one all-reduce)."""
        from sbpjax.rules.elementwise import ELEMENTWISE

        self.pref: dict = {}
        for atom, nd in zip(self.prog.outputs, out_sbp or []):
            if nd is not None and isinstance(atom, Var) and not any(isinstance(s, Partial) for s in nd):
                self.pref.setdefault(id(atom), nd)
        for node in reversed(self.prog.nodes):
            if node.name not in ELEMENTWISE:
                continue
            for o in node.outs:
                want = self.pref.get(id(o))
                if want is None:
                    continue
                for i in node.ins:
                    if isinstance(i, Var) and i.shape == o.shape:
                        self.pref.setdefault(id(i), want)

    def _preference_cost(self, outs, node) -> tuple[int, bool]:
        """Bytes to box outputs to their preferred layouts later, and whether a
        split (not partial) output misses its preference: a split output drags
        the values it meets into the split and each must be gathered back, while
        a partial's reduction happens once wherever it is done."""
        cost, split_miss = 0, False
        for o, nd in zip(node.outs, outs):
            want = self.pref.get(id(o))
            if want is not None and want != nd:
                cost += self.plan(o, nd, want).bytes
                split_miss |= not any(isinstance(q, Partial) for q in nd)
        return cost, split_miss

    def _spread_partials(self, outs, node) -> int:
        """Partial outputs that must be reduced (their preferred layout is not
        partial) and have more than one use. Deferring a reduction is free only
        while the partial has one consumer: with two, each may carry it on into
        its own partial result and each of those is reduced (an SGD momentum
        trace and the update computed from it: two all-reduces where reducing
        the gradient once suffices)."""
        n = 0
        for o, nd in zip(node.outs, outs):
            want = self.pref.get(id(o))
            if (
                want is not None
                and any(isinstance(q, Partial) for q in nd)
                and not any(isinstance(q, Partial) for q in want)
                and self.uses.get(id(o), 0) > 1
            ):
                n += 1
        return n

    def _stale_partial_uses(self, ins, node) -> int:
        """Inputs used as partials although a reduced version already exists."""
        n = 0
        for atom, nd in zip(node.ins, ins):
            if isinstance(atom, Var) and any(isinstance(q, Partial) for q in nd):
                n += any(not any(isinstance(q, Partial) for q in v) for v in self.versions.get(id(atom), ()))
        return n

    def nd_of(self, atom):
        if isinstance(atom, Const):
            return (Broadcast(),) * len(self.grid)
        return self.layout[id(atom)]

    def plan(self, atom, src, dst):
        # plan_boxing's own cache normalizes its arguments first; choices ask
        # for the same few plans thousands of times, so look them up raw here
        zero = id(atom) in self.zeros
        key = (atom.shape, atom.dtype, src, dst, zero, self.idle, self.ring)
        hit = self._plans.get(key)
        if hit is None:
            planner = plan_zeros if zero else plan_boxing
            priced = "ring" if self.ring else False
            hit = planner(atom.shape, atom.dtype, self.pl, src, dst, cost_model=self.cm, launch_priced=priced)
            # axes the boxing has nothing to do on: idle in the program, or whole in both layouts
            lent = self.idle | {
                a for a, (s, d) in enumerate(zip(src, dst)) if isinstance(s, Broadcast) and s == d
            }
            borrows = any(st.bytes and lent.intersection(st.group) for st in hit.steps)
            if not self.ring and self.launch_priced and borrows:
                hit = planner(
                    atom.shape, atom.dtype, self.pl, src, dst, cost_model=self.cm, launch_priced=True
                )
            self._plans[key] = hit
        return hit

    def cheapest_source(self, atom, src, dst, made) -> tuple:
        """``(source, plan)`` boxing ``atom`` to ``dst`` from its producer's
        layout ``src`` or from a layout an earlier boxing already ``made``,
        whichever moves fewer bytes: a partial reduced once for one consumer
        is sliced for the next instead of reduced again, and a plan that would
        repeat an earlier boxing's first steps (which XLA merges) starts where
        that boxing ended, so the plan counts what runs."""
        best = (src, self.plan(atom, src, dst))
        for v in made:
            if v != dst:
                p = self.plan(atom, v, dst)
                if p.bytes < best[1].bytes:
                    best = (v, p)
        return best

    def bound(self, atom, src, dst) -> int:
        """A lower bound of ``plan(atom, src, dst).bytes`` without a search."""
        if id(atom) in self.zeros:
            return 0
        key = (atom.shape, atom.dtype, src, dst)
        hit = self._bounds.get(key)
        if hit is None:
            hit = self._bounds[key] = bytes_lower_bound(atom.shape, atom.dtype.itemsize, self.pl, src, dst)
        return hit

    def cost_bound(self, atom, dst) -> int:
        src = self.nd_of(atom)
        if src == dst or (isinstance(atom, Var) and dst in self.versions.get(id(atom), ())):
            return 0
        return self.bound(atom, src, dst)

    def cost(self, atom, dst):
        src = self.nd_of(atom)
        if src == dst or (isinstance(atom, Var) and dst in self.versions.get(id(atom), ())):
            return (0, 0.0, 0)
        p = self.plan(atom, src, dst)
        return (p.bytes, p.tie_time(), 1)

    # -- one equation ---------------------------------------------------------
    def candidates(self, node: Node):
        # a node's signatures depend on its equation only: computed once for all
        # passes, and once for the alike ops of every layer
        key = op_key(node)
        hit = self._sigs.get(key)
        if hit is None:
            hit = self._sigs[key] = self._candidates(node)
        return hit

    def _candidates(self, node: Node):
        rule = RULES[node.name]  # only asked for ops with a rule
        in_avals = [v.aval for v in node.eqn.invars]
        try:
            offered = rule.signatures(node.eqn, in_avals)
        except SBPError as e:
            raise located(e, node.source) from None
        sigs = [
            s
            for s in offered
            if len(s.ins) == len(node.ins)
            and len(s.outs) == len(node.outs)
            and all(valid_for(q, a.shape) and dtype_ok(q, a.dtype) for q, a in zip(s.ins, node.ins))
            and all(valid_for(q, o.shape) and dtype_ok(q, o.dtype) for q, o in zip(s.outs, node.outs))
        ]
        return sigs

    def choose(self, node: Node, index: int) -> Decision:
        cur = [self.nd_of(a) for a in node.ins]
        if node.name == CONSTRAIN:
            want = node.eqn.params["sbp"]
            if len(want) != len(self.grid):
                raise SBPError(
                    f"sj.constrain at {node.source}: nd-SBP {format_sbp(want)} has {len(want)} entries, the "
                    f"placement has {len(self.grid)} axes."
                )
            if not all(valid_for(s, node.ins[0].shape) for s in want):
                raise SBPError(
                    f"sj.constrain at {node.source}: {format_sbp(want)} splits a dim the tensor of shape "
                    f"{node.ins[0].shape} does not have; split a dim in 0..{len(node.ins[0].shape) - 1}."
                )
            check_partial_dtype(node.ins[0].dtype, want, f"sj.constrain at {node.source}")
            return self._decide(node, index, [want], [want])
        nested = NESTED.get(node.name)
        sig = nested.signature(node, cur, self.pl) if nested is not None else None
        if sig is not None:
            return self._decide(node, index, *sig)
        rule = RULES.get(node.name)
        sigs = self.candidates(node) if rule is not None else []
        if not sigs:
            kind = "control flow" if node.name in CONTROL_FLOW else "no SBP rule for"
            msg = (
                f"{kind} '{node.name}' at {node.source}: its operands are boxed to B and it runs whole "
                "on every device"
            )
            if node.name in CONTROL_FLOW:
                msg += " (loop-carried layouts are forced to B)"
            self.warnings.append(msg)
            if not self.quiet:
                warnings.warn(SBPWarning(msg), stacklevel=5)
            rep = (Broadcast(),) * len(self.grid)
            return self._decide(node, index, [rep] * len(node.ins), [rep] * len(node.outs))
        # The choice depends only on the op (its op_key: its candidates, shapes
        # and constants), the input layouts, the versions of the inputs that
        # exist, and the outputs' preferences and whether they have several
        # uses: later passes reuse it wherever those are unchanged, and the
        # alike ops of every layer share it.
        key = (
            op_key(node),
            tuple(cur),
            tuple(frozenset(self.versions.get(id(a), ())) if isinstance(a, Var) else None for a in node.ins),
            tuple(self.pref.get(id(o)) for o in node.outs),
            tuple(self.uses.get(id(o), 0) > 1 for o in node.outs),
            self.rank_with_prefs and any(id(o) in self.pref for o in node.outs),
        )
        hit = self._choices.get(key)
        if hit is None:
            self._ranked_apart = False
            hit = self._choices[key] = (self._best_signature(node, cur, sigs), self._ranked_apart)
        best, ranked_apart = hit
        self.ranked_apart |= ranked_apart
        if best is False:
            rep = (Broadcast(),) * len(self.grid)
            return self._decide(node, index, [rep] * len(node.ins), [rep] * len(node.outs))
        return self._decide(node, index, *best)

    def _even(self, nd, shape) -> bool:
        key = (nd, shape)
        hit = self._evens.get(key)
        if hit is None:
            hit = self._evens[key] = even_on(nd, shape, self.grid)
        return hit

    def fits(self, node: Node, ins, outs) -> bool:
        """Whether ``node`` can run this nd-signature on its pieces: every
        split even, or uneven splits that keep their padded positions in place
        and need no communication of the op's own (``sbpjax.compiler.uneven``)."""
        vals = list(node.ins) + list(node.outs)
        nds = list(ins) + list(outs)
        shapes = [v.shape for v in vals]
        moved = uneven.moved_shapes(node.eqn, ins, outs, shapes, self.grid)
        if moved is not None:
            return bool(moved) and (
                all(self._even(nd, sh) for nd, sh in zip(nds, moved)) or uneven.fits(nds, moved, self.grid)
            )
        if node.name == "concatenate":
            # a split dim filled at its end: local where the pieces line up
            for d, (n, m) in enumerate(zip(node.ins[0].shape, node.outs[0].shape)):
                axes = split_axes(ins[0], d)
                if n != m and (axes or split_axes(outs[0], d)):
                    if axes != split_axes(outs[0], d) or not prefix_aligned(n, m, axes, self.grid):
                        return False
            # read both at the longer size: the shorter's pieces are the longer's cut short
            longer = tuple(max(n, m) for n, m in zip(node.ins[0].shape, node.outs[0].shape))
            shapes[0] = shapes[-1] = longer
        if all(self._even(nd, shape) for nd, shape in zip(nds, shapes)):
            return True
        if not uneven.fits(nds, shapes, self.grid):
            return False
        return not op_comm(node, ins, outs, self.pl, self.comms)

    def _partial_debt(self, cur, ins, outs, node) -> int:
        """Bytes a new partial will cost later, charged when an op's partial
        output exists only because an input was zero-filled into a partial
        (S or B -> P is free): that output must be reduced some time, and without this charge a greedy choice
        would turn a split tensor into a full-size partial to save a small
        reduction elsewhere. The charge is an all-reduce, ``2(p-1)|T|``: such a
        partial is usually needed whole later (an optimizer state, an
        activation). Partials an op creates from inputs that need no
        fill (a contracting matmul, a reduction over a split dim) and partials
        carried through (P x B -> P) cost nothing: OneFlow Table 1 signatures are
        kept and partials live as long as they stay valid."""
        debt = 0
        for o, nd in zip(node.outs, outs):
            for a, s in enumerate(nd):
                if not isinstance(s, Partial) or any(c[a] == s for c in cur):
                    continue
                if any(isinstance(q[a], Partial) and c[a] != q[a] for c, q in zip(cur, ins)):
                    debt += 2 * (self.grid[a] - 1) * nbytes(o)
        return debt

    @staticmethod
    def partial_ok(nd) -> bool:
        # mixed partial ops on one tensor are valid but no rule produces them on purpose
        return len({s.op for s in nd if isinstance(s, Partial)}) <= 1

    def _decide(self, node, index, ins, outs) -> Decision:
        boxings = []
        for atom, nd in zip(node.ins, ins):
            src = self.nd_of(atom)
            if src == nd:
                continue
            made: list = []
            if isinstance(atom, Var):
                seen = self.versions.setdefault(id(atom), {})
                if nd in seen:
                    continue
                made = list(seen)
                seen[nd] = True
            src, plan = self.cheapest_source(atom, src, nd, made)
            boxings.append(Boxing(atom, src, nd, plan, f"{node.name} at {node.source}", index))
        for v, nd in zip(node.outs, outs):
            self.layout[id(v)] = nd
        comm = op_comm(node, ins, outs, self.pl, self.comms) or []
        return Decision(node, list(ins), list(outs), boxings, comm)
