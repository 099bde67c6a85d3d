"""How the greedy pass finds an op's cheapest signature
(:class:`SignatureSearch`, the part of :class:`~sbpjax.compiler.propagator.Propagator`
that searches; the costs, bounds and checks it calls are the propagator's).

Most ops take their inputs as they are (``_free_signature`` finds those
without costing anything); for the rest, 1-D candidates are ranked per axis
(``_ranked_per_axis``), their products (``_products``) bounded with
``plan.bytes_lower_bound`` and costed exactly only while the bound can still
win (``_cheapest``).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from sbpjax.compiler.program import Node, Var
from sbpjax.compiler.propagation import axis_ties, estimate, fresh_splits, nbytes, op_comm
from sbpjax.placement import Placement
from sbpjax.rules import Sig, may_communicate, own_comm, prunes_quiet
from sbpjax.sbp import Broadcast

_TOP_K = 3  # 1-D candidates kept per axis before exact costing of their products


def _replicated(sig: Sig) -> bool:
    return all(isinstance(q, Broadcast) for q in (*sig.ins, *sig.outs))


class SignatureSearch:
    """Mixed into ``Propagator``, which supplies the state and the costs
    declared here (for the type checker only: at run time they are the
    propagator's own)."""

    pl: Placement
    grid: tuple
    comms: dict
    pref: dict
    versions: dict
    rank_with_prefs: bool
    _ranked_apart: bool

    if TYPE_CHECKING:

        def fits(self, node: Node, ins, outs) -> bool: ...
        def partial_ok(self, nd) -> bool: ...
        def cost(self, atom, dst) -> tuple: ...
        def cost_bound(self, atom, dst) -> int: ...
        def bound(self, atom, src, dst) -> int: ...
        def _partial_debt(self, cur, ins, outs, node) -> int: ...
        def _preference_cost(self, outs, node) -> tuple[int, bool]: ...
        def _stale_partial_uses(self, ins, node) -> int: ...
        def _spread_partials(self, outs, node) -> int: ...

    def _best_signature(self, node: Node, cur: list, sigs: list):
        """(ins, outs) of the cheapest candidate, or False when none is even."""
        free = self._free_signature(node, cur, sigs)
        if free is not None:
            return free
        # rank 1-D candidates per axis, then cost the products exactly
        combos = self._products(node, self._ranked_per_axis(node, cur, sigs))
        if prunes_quiet(node.eqn) and all(
            self._partial_debt(cur, ins, outs, node) for _, ins, outs, _ in combos
        ):
            # An op that communicates keeps its best few quiet candidates only
            # (see _ranked_per_axis). Where none of the products kept runs free of
            # a new partial (a strided slice whose pieces cannot keep the stride,
            # the estimate's free partials filling the few), every candidate is
            # costed, as it was before the few: the quiet ones past them (an
            # all-to-all to another dim, a gather) may be the only cheap ones
            # (x[:, 1::3] of a (8, 21, 32) value split over 2x4 moved 2.3x).
            combos = self._products(node, self._ranked_per_axis(node, cur, sigs, every=True))
        if combos and all(self._partial_debt(cur, ins, outs, node) for _, ins, outs, _ in combos):
            # The ranking sees a zero-filled partial as free (its reduction later costs
            # 2(p-1)|T|, a gather now (p-1)|T|): where every product kept zero-fills an
            # input, replicating the inputs is costed too (a reshape that cannot keep
            # a split zero-filled and all-reduced the tensor, twice the gather). Only
            # then: keeping it among every op's candidates changed 8 of the compiler
            # benchmark's 22 plans, most to more bytes.
            whole = [s for s in sigs if _replicated(s)]
            after = 1 + max(order for order, *_ in combos)  # the rule's order: after those kept
            combos += [(after + o, i, x, c) for o, i, x, c in self._products(node, [whole] * len(self.grid))]
        return self._cheapest(node, cur, combos)

    def _ranked_per_axis(self, node: Node, cur: list, sigs: list, every: bool = False) -> list:
        """Per placement axis, the 1-D candidates worth costing on it: the
        ``_TOP_K`` cheapest by ``estimate``, and for an op that communicates
        itself every candidate that may (``Rule.comm_sig_if``; ``every``: all
        of them), and the best with the outputs' preferences."""
        per_axis = []
        communicates = own_comm(node.eqn)
        for a, p in enumerate(self.grid):
            if p == 1:
                per_axis.append(
                    [Sig(tuple(Broadcast() for _ in node.ins), tuple(Broadcast() for _ in node.outs))]
                )
                continue
            # outputs' preferred layouts count too: a candidate that is free now
            # but must be boxed to the preference later ranks behind one that
            # boxes a small input now (a row vector gathered before a broadcast
            # instead of the broadcast's result all-to-all'd)
            wants = [
                (self.pref[id(o)][a], nbytes(o), j) for j, o in enumerate(node.outs) if id(o) in self.pref
            ]
            # an input already boxed to another layout for an earlier consumer is
            # free in that layout again
            have = [list(self.versions.get(id(i), ())) if isinstance(i, Var) else [] for i in node.ins]
            scored, with_pref = [], []
            for k, s in enumerate(sigs):
                est = sum(
                    0.0 if any(v[a] == q for v in vs) else estimate(c[a], q, nbytes(i), p)
                    for c, q, i, vs in zip(cur, s.ins, node.ins, have)
                )
                later = sum(estimate(s.outs[j], want, nbytes, p) for want, nbytes, j in wants)
                changed = sum(c[a] != q for c, q in zip(cur, s.ins))
                scored.append((est, changed, *axis_ties(s, cur, a), k, s))
                with_pref.append((est + later, changed, *axis_ties(s, cur, a), k, s))
            scored.sort(key=lambda t: t[:5])
            # the estimate does not see an op's own communication (a halo, a
            # prefix carry: it depends on every axis), so such ops keep every
            # candidate that may communicate (Rule.comm_sig_if) for exact
            # costing. A slice's or pad's that split no dim it moves never do:
            # ranked as any op's (the 544 slices of a 32-layer scanned GPT
            # step's written-out layers, each with its own start, took half the
            # greedy pass costing all 66 products of their candidates)
            keep = [
                t[5]
                for k, t in enumerate(scored)
                if k < _TOP_K or (communicates and (every or may_communicate(node.eqn, t[5])))
            ]
            if wants:
                top = min(with_pref, key=lambda t: t[:5])[5]
                if top not in keep:
                    self._ranked_apart = True
                    if self.rank_with_prefs:
                        keep.append(top)
            per_axis.append(keep)
        return per_axis

    def _products(self, node: Node, per_axis: list) -> list:
        """(order, ins, outs, own bytes) of each product of the per-axis
        candidates that fits the pieces and can run (its partials allowed,
        its own communication possible)."""
        combos = []
        for order, combo in enumerate(itertools.product(*per_axis)):
            ins = [tuple(s.ins[j] for s in combo) for j in range(len(node.ins))]
            outs = [tuple(s.outs[j] for s in combo) for j in range(len(node.outs))]
            if not self.fits(node, ins, outs):
                continue
            if any(not self.partial_ok(nd) for nd in ins + outs):
                continue
            comm = op_comm(node, ins, outs, self.pl, self.comms)
            if comm is None:
                continue
            combos.append((order, ins, outs, sum(c.bytes for c in comm)))
        return combos

    def _cheapest(self, node: Node, cur: list, combos: list):
        """(ins, outs) of the product with the least key, or False when none."""
        # Bound every product's bytes first (no searches), then cost them exactly
        # in order of the bound until the bound exceeds the best bytes found:
        # the rest cannot win, since bytes come first in the key.
        bounded = []
        for order, ins, outs, own in combos:
            # an op's own communication counts like a debt: bytes this choice moves
            debt = self._partial_debt(cur, ins, outs, node) + own
            low = debt + sum(self.cost_bound(atom, nd) for atom, nd in zip(node.ins, ins))
            low += sum(
                self.bound(o, nd, self.pref[id(o)])
                for o, nd in zip(node.outs, outs)
                if self.pref.get(id(o)) not in (None, nd)
            )
            bounded.append((low, order, ins, outs, debt))
        bounded.sort(key=lambda t: t[:2])
        best = None
        for low, order, ins, outs, debt in bounded:
            if best is not None and low > best[0][0]:
                break
            later, split_miss = self._preference_cost(outs, node)
            total = [debt + later, 0.0, 0]
            for atom, nd in zip(node.ins, ins):
                c = self.cost(atom, nd)
                total = [total[0] + c[0], total[1] + c[1], total[2] + c[2]]
            # Ties: no new debt (nor own communication); no input used as a partial when a reduced version
            # exists; no split output that must be gathered back; no partial with
            # several uses left to be reduced later; then time (which defers a
            # partial's reduction when paying now or later costs the same bytes,
            # as OneFlow keeps partials); then fewer boxings; then no splits
            # invented from nothing (an iota, a broadcast of a B value: they must be
            # undone where they meet B data); then the rule's order.
            stale = self._stale_partial_uses(ins, node)
            fresh = fresh_splits(outs, cur)
            key = (
                total[0],
                debt > 0,
                stale,
                split_miss,
                self._spread_partials(outs, node),
                round(total[1], 15),
                total[2],
                fresh,
                order,
            )
            if best is None or key < best[0]:
                best = (key, ins, outs)
        if best is None:
            return False
        return best[1], best[2]

    def _free_signature(self, node: Node, cur: list, sigs: list):
        """The winner of ``_best_signature`` found without ranking or costing,
        when there is one: a candidate that takes every input as it is (no
        boxing), and so makes no partial debt, has key (0, False, 0, False, 0, 0.0,
        0, fresh, order), which no candidate that boxes an input can beat (it
        counts at least one boxing), provided no input has other versions (a
        boxing to an existing version is free and counts none) and no output
        has a preferred layout (missing it costs bytes). Such candidates are
        the first of each axis' ranking (estimate 0, nothing changed), so their
        product order is known without ranking the rest. Most ops of a program
        (elementwise chains on one layout) end here."""
        if any(self.versions.get(id(a)) for a in node.ins if isinstance(a, Var)):
            return None
        if own_comm(node.eqn):
            return None  # its candidates may cost bytes of their own: cost them all
        if any(id(o) in self.pref for o in node.outs) or not all(self.partial_ok(nd) for nd in cur):
            return None
        per_axis, sizes = [], []
        for a, p in enumerate(self.grid):
            if p == 1:
                if any(not isinstance(c[a], Broadcast) for c in cur):
                    return None
                per_axis.append(
                    [Sig(tuple(Broadcast() for _ in node.ins), tuple(Broadcast() for _ in node.outs))]
                )
                sizes.append(1)
                continue
            same = sorted(
                (*axis_ties(s, cur, a), k, s)
                for k, s in enumerate(sigs)
                if all(c[a] == q for c, q in zip(cur, s.ins))
            )
            if not same:
                return None
            per_axis.append([t[3] for t in same[:_TOP_K]])
            sizes.append(min(_TOP_K, len(sigs)))
        strides = [math.prod(sizes[a + 1 :]) for a in range(len(sizes))]
        best = None
        for idx in itertools.product(*[range(len(c)) for c in per_axis]):
            combo = [per_axis[a][i] for a, i in enumerate(idx)]
            outs = [tuple(s.outs[j] for s in combo) for j in range(len(node.outs))]
            if not self.fits(node, cur, outs):
                continue
            if any(not self.partial_ok(nd) for nd in outs):
                continue  # (no debt: debt comes from an input boxed to a partial)
            fresh = fresh_splits(outs, cur)
            order = sum(i * st for i, st in zip(idx, strides))
            if best is None or (fresh, order) < best[0]:
                best = ((fresh, order), list(cur), outs)
        return None if best is None else (best[1], best[2])


__all__ = ["SignatureSearch"]
