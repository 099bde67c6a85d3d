"""The layout choice as a pairwise problem: nodes with strategies, edges with cost tables.

This is the form of the IOPDDL contest (``sbpjax.solver``): every node takes
one of its strategies, each with a cost and a memory usage; every edge has a
cost for each pair of strategies at its two ends. Here:

* an **op node** per op with more than one candidate signature
  (:func:`sbpjax.compiler.signatures.candidates`, narrowed by
  :class:`~sbpjax.compiler.domains.Domains`); its strategy cost is the op's
  own communication (a halo exchange). Ops that must decide alike (the k-th
  op of every iteration of a written-out scan, and, with
  ``CompileOptions.tie_layers``, the alike ops of repeated layers) share one
  node: it is a **group** with one decision;
* an **argument node** per ``AUTO`` argument, its strategies the layouts it
  may take (an argument mirroring another, optimizer state mirroring its
  parameter, shares that one's node);
* an **edge** from a value's producer to its consumer, its table the cost of
  boxing the value from the layout each producer strategy gives it to the
  layout each consumer strategy reads it in (``pricing.boxing_cost`` of the
  plan the lowering runs). A fixed end makes it a cost on the other node;
* a **hub node** per value read by two or more consumers, its strategies the
  layouts the value may be boxed to. The value is boxed once to the hub's
  layout and each consumer boxes from there. A value is boxed once per
  layout, whichever consumers want it (a partial read by three ops is
  reduced once), and pairwise edges from the producer would count that
  reduction three times. The hub makes the count exact wherever the
  consumers want one layout other than the producer's, and an upper bound of
  what the lowering runs otherwise (it boxes each layout from the cheapest
  version at hand, ``Propagator.cheapest_source``). On the GPT steps of
  ``benchmarks/compiler.py`` the optimum of this form is the price of the
  plan it decodes to, to the byte.

  Hubs that would be alike share one node: values whose producer and
  consumers are the same nodes, through the same cost tables at the same
  weights (a value of every iteration of a written-out scan, whose ops are
  one group each). Given the nodes around them such hubs cost the same
  function of their layout, so one node at the summed cost has the same
  optimum, and each value is boxed to its layout. A 32-layer scanned GPT
  step: 1,863 nodes became 439, each solve 8x faster, the same plan.

Memory: the bytes that arguments and results hold per device (a donated
argument and its result once) are usages at time point 0, and
``memory_budget`` is the usage limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sbpjax.boxing.cost import CostModel
from sbpjax.compiler.auto import AUTO, auto_layouts
from sbpjax.compiler.classes import same_candidates
from sbpjax.compiler.dead_code import unread_last_carries
from sbpjax.compiler.decode import propagation_of, value_keys
from sbpjax.compiler.domains import Domains
from sbpjax.compiler.folding import Folded
from sbpjax.compiler.liveness import block_bytes, result_table_bytes
from sbpjax.compiler.options import DEFAULT_OPTIONS, CompileOptions
from sbpjax.compiler.pricing import BranchOdds, comm_cost
from sbpjax.compiler.program import Var
from sbpjax.compiler.propagation import NESTED, Propagation, idle_axes, op_comm, op_key
from sbpjax.compiler.propagator import Propagator
from sbpjax.compiler.signatures import candidates
from sbpjax.compiler.tables import Tables


@dataclasses.dataclass
class Formulation:
    """A program's layout choice in the pairwise form, and how to read a solution back.

    ``costs[n]``: node ``n``'s cost per strategy, in 1/64 bytes; ``edges``:
    ``{(u, v): table}`` with ``u < v`` and ``table[s_u, s_v]`` in 1/64 bytes;
    ``const``: the cost of what no node decides (all three folded from the
    nodes' own costs and the boxing ``links``, each a cost table between two
    nodes or a node and a fixed end, :mod:`sbpjax.compiler.tables`);
    ``usages[n]``: per strategy, the bytes node ``n`` makes arguments and
    results hold per device (``const_usage``: what fixed ones hold).
    ``strategies[n]``: what each strategy is (an op node's (ins, outs)
    signature, an argument's or a hub's layout)."""

    own: list  # per node: its own cost per strategy (an op's own communication)
    own_const: float
    links: list  # (Table, u or None, v or None, weight)
    tables: Tables
    usages: list
    const_usage: int
    strategies: list
    kinds: list  # per node: "op", "argument" or "hub"
    op_node: list  # per op: its node, or None (one candidate)
    cands: list  # per op: its candidates [(ins, outs)]
    arg_node: dict  # AUTO argument index -> node
    hubs: dict  # hub node -> (its values, their source: (node or None, layout per strategy))
    keys: dict  # id(value) -> decode.value_keys' key
    in_layouts: list  # per argument: the layouts it may take
    ties: dict
    out_sbp: list | None
    program: Any
    placement: Any
    pr: Propagator

    _folded: Folded | None = None  # the links folded (sbpjax.compiler.folding)

    @property
    def costs(self) -> list:
        return self._fold().costs

    @property
    def edges(self) -> dict:
        return self._fold().edges

    @property
    def const(self) -> float:
        return self._fold().const

    def _fold(self) -> Folded:
        if self._folded is None:
            self._folded = Folded(self.own, self.own_const, self.links)
        return self._folded

    def repriced(self, pr: Propagator, tables: Tables) -> Formulation:
        """The same problem with its boxings planned by ``pr`` and priced by
        ``tables`` (the second solve's ring latency): the same nodes,
        strategies and links, new cost tables."""
        links = [(tables.table(t.atom, t.src, t.dst), u, v, w) for t, u, v, w in self.links]
        own = [np.zeros(len(s)) for s in self.strategies]
        const = own_costs(self.program, pr, tables, self.cands, self.op_node, own)
        return dataclasses.replace(
            self, own=own, own_const=const, links=links, tables=tables, pr=pr, _folded=None
        )

    def settle(self, strategies) -> int:
        """Plan exactly every table entry the solution ``strategies`` uses
        (``Tables.settle``), with their rows and columns; the number of the
        solution's own entries whose cost changed (0: its cost was exact, so
        its optimality holds for the exact tables too: every other entry
        only rose from its bound). A strategy of -1 (``start``'s
        unknown) settles nothing at its node."""
        used = 0
        touched: set = set()
        for table, u, v, _ in self.links:
            a = 0 if u is None else strategies[u]
            c = 0 if v is None else strategies[v]
            if a >= 0 and c >= 0 and not table.exact[a, c]:
                own = self.tables.settle(table, a, c)
                used += own
                # the entry's row and column too: what moving either end
                # alone costs, so the next solve does not walk a bound at a time
                changed = [own]
                changed += [self.tables.settle(table, a, c2) for c2 in range(table.values.shape[1])]
                changed += [self.tables.settle(table, a2, c) for a2 in range(table.values.shape[0])]
                if any(changed):
                    touched.add(id(table))
        if touched and self._folded is not None:
            self._folded = self._folded.refold(touched)
        return used

    @property
    def groups(self) -> int:
        """Op nodes: the decisions the ops of the program make."""
        return sum(k == "op" for k in self.kinds)

    def start(self, prop: Propagation) -> list:
        """The strategies of plan ``prop`` (its ops' signatures and its
        arguments' layouts; each hub at its cheapest layout given those), or
        -1 where a node's strategy is not among its candidates."""
        out = [-1] * len(self.costs)
        for i, d in enumerate(prop.decisions):
            n = self.op_node[i]
            if n is not None and out[n] < 0:
                want = (tuple(d.in_sbp), tuple(d.out_sbp))
                out[n] = next((k for k, s in enumerate(self.strategies[n]) if s == want), -1)
        for i, n in self.arg_node.items():
            out[n] = next((k for k, nd in enumerate(self.strategies[n]) if nd == prop.in_sbp[i]), -1)
        # each hub's edges, in the edges' order (the sums' order, so ties break alike)
        touching: dict = {n: [] for n, kind in enumerate(self.kinds) if kind == "hub"}
        for (u, v), t in self.edges.items():
            if v in touching:
                touching[v].append((u, t, True))
            if u in touching:
                touching[u].append((v, t, False))
        for n, edges in touching.items():  # in node order: a hub sees the hubs before it placed
            total = self.costs[n].copy()
            for other, t, rows in edges:
                if out[other] >= 0:
                    total += t[out[other]] if rows else t[:, out[other]]
            out[n] = int(np.argmin(total))
        return out

    def plan(self, strategies) -> Propagation:
        """The Propagation of a solution (:func:`sbpjax.compiler.decode.propagation_of`)."""
        in_sbp = [lays[0] for lays in self.in_layouts]
        for i, n in self.arg_node.items():
            in_sbp[i] = self.strategies[n][strategies[n]]
        out_sbp = list(self.out_sbp) if self.out_sbp is not None else [None] * len(self.program.outputs)
        for k, i in self.ties.items():
            out_sbp[k] = in_sbp[i]
        signatures = [
            self.cands[index][0] if n is None else self.strategies[n][strategies[n]]
            for index, n in enumerate(self.op_node)
        ]
        # each hub's value boxed first to the hub's layout, where that is not its producer's
        first: dict = {}
        for n, (atoms, src) in self.hubs.items():
            lay = self.strategies[n][strategies[n]]
            made = src[1][0] if src[0] is None else src[1][strategies[src[0]]]
            if lay != made:
                first.update((self.keys[id(atom)], lay) for atom in atoms)
        cost = self.tables.cost
        prop = propagation_of(self.program, self.placement, self.pr, in_sbp, out_sbp, signatures, first, cost)
        prop.ring = self.pr.ring
        return prop


def formulate(
    program,
    placement,
    in_sbp,
    out_sbp,
    greedy: Propagation,
    cost_model=None,
    options: CompileOptions = DEFAULT_OPTIONS,
    caches=None,
    ties=None,
    same_layout=None,
    classes=None,
    lazy: bool = True,
    aliases=None,
) -> Formulation:
    """The pairwise problem of ``program``'s layout choice (see the module docstring).

    ``in_sbp`` entries may be ``AUTO``. ``ties``: {result index: index of an
    AUTO argument whose layout it must have} (a donated train-step state).
    ``same_layout``: {AUTO argument: earlier AUTO argument whose layout it
    takes}. ``aliases``: {result index: donated argument not tied to it},
    counted once where the two take one layout. ``classes``:
    per op a key or None: ops with one key decide alike (the iterations of
    a scan; alike layers). ``lazy``: cost table entries start as lower
    bounds (:mod:`sbpjax.compiler.tables`; ``Formulation.settle``).
    ``caches``: the greedy pass's
    planner caches (plans, bounds, signatures, choices, evenness) and a memo
    of candidates per ``op_key``, shared by every formulation of one choice."""
    grid = placement.shape
    cm = cost_model if cost_model is not None else CostModel()
    caches = caches if caches is not None else ({}, {}, {}, {}, {}, {})
    pr = propagator(program, placement, in_sbp, cost_model, options, caches, ring=False)
    memo = caches[5]
    ties = dict(ties or {})
    same_layout = dict(same_layout or {})
    aliases = dict(aliases or {})

    in_layouts = [
        auto_layouts(v.shape, grid) if nd is AUTO else [nd] for v, nd in zip(program.inputs, in_sbp)
    ]
    allowed = Domains(program, placement, in_layouts, greedy, pr.idle)
    cands = []
    for index, node in enumerate(program.nodes):
        if node.name in NESTED:
            # the layouts its inner programs were planned for: greedy's
            # (sbpjax.compiler.inner_loops)
            dec = greedy.decisions[index]
            cands.append(allowed.restrict(index, node, [(list(dec.in_sbp), list(dec.out_sbp))]))
        else:
            key = op_key(node)
            if key not in memo:
                memo[key] = candidates(pr, node, grid)
            cands.append(allowed.restrict(index, node, memo[key]))
    same_candidates(cands, classes)

    b = _Builder(program, placement, pr, Tables(pr, cm, options, ring=False, lazy=lazy))
    for i, lays in enumerate(in_layouts):
        if len(lays) > 1:
            j = same_layout.get(i)
            b.arg_node[i] = b.arg_node[j] if j is not None and j in b.arg_node else b.node(lays, "argument")
    b.add_ops(cands, classes)
    b.add_values(in_layouts, out_sbp, ties)
    b.add_memory(in_layouts, out_sbp, ties, aliases)
    return Formulation(
        b.costs,
        b.const,
        b.links,
        b.tables,
        b.usages,
        b.const_usage,
        b.strategies,
        b.kinds,
        b.op_node,
        cands,
        b.arg_node,
        b.hubs,
        value_keys(program),
        in_layouts,
        ties,
        out_sbp,
        program,
        placement,
        pr,
    )


def propagator(program, placement, in_sbp, cost_model, options, caches, ring: bool) -> Propagator:
    """A planner of boxings for the layout choice, sharing ``caches``."""
    pr = Propagator(program, placement, cost_model, launch_priced=options.launch_priced)
    pr.idle = idle_axes(in_sbp, placement.shape)
    pr.ring = ring
    pr.quiet = True
    pr._plans, pr._bounds, pr._sigs, pr._choices, pr._evens = caches[:5]
    return pr


def own_costs(program, pr: Propagator, tables: Tables, cands, op_node, own: list) -> float:
    """Add each op's own communication (``pricing.comm_cost`` of its
    ``Comm``s, priced as ``tables`` prices boxings, weighted by the chance
    that the op runs) to its node's entries of ``own``; returns the cost of
    the ops with one candidate, which no node decides."""
    odds, const = BranchOdds(program), 0.0
    for node, cs, n in zip(program.nodes, cands, op_node):
        chance = odds.chance(node.branch)
        cost = np.array(
            [
                chance
                * sum(
                    comm_cost(c, pr.pl, tables.cm, tables.options, ring=tables.ring)
                    for c in op_comm(node, ins, outs, pr.pl, pr.comms) or ()
                )
                for ins, outs in cs
            ]
        )
        if n is None:
            const += cost[0]
        else:
            own[n] += cost
    return const


class _Builder:
    """Nodes, edges and usages as :func:`formulate` adds them."""

    def __init__(self, program, placement, pr, tables: Tables):
        self.program, self.placement, self.pr, self.tables = program, placement, pr, tables
        self.links: list = []
        self.grid = placement.shape
        self.odds = BranchOdds(program)
        self.costs: list = []
        self.usages: list = []
        self.strategies: list = []
        self.kinds: list = []
        self.edges: dict = {}
        self.const = 0.0
        self.const_usage = 0
        self.arg_node: dict = {}
        self.op_node: list = []
        self.source: dict = {}  # id(var) -> (node or None, layout per strategy)
        self.hubs: dict = {}  # hub node -> (its values, their source)
        self.alike_hubs: dict = {}  # what makes hubs alike (see _add_value) -> hub node

    def node(self, strategies, kind) -> int:
        self.costs.append(np.zeros(len(strategies)))
        self.usages.append(np.zeros(len(strategies)))
        self.strategies.append([tuple(s) if kind != "op" else (tuple(s[0]), tuple(s[1])) for s in strategies])
        self.kinds.append(kind)
        return len(self.costs) - 1

    # -- ops -----------------------------------------------------------------
    def add_ops(self, cands, classes) -> None:
        """A node per op with a choice; ops of one class (one candidate list,
        ``same_candidates``) share it."""
        self.cands = cands
        group: dict = {}
        for index, (node, cs) in enumerate(zip(self.program.nodes, cands)):
            if len(cs) == 1:
                self.op_node.append(None)
            else:
                key = classes[index] if classes is not None else None
                n = group.get(key) if key is not None else None
                if n is None or len(self.strategies[n]) != len(cs):
                    n = self.node(cs, "op")
                    if key is not None:
                        group[key] = n
                self.op_node.append(n)
            for j, o in enumerate(node.outs):
                n = self.op_node[-1]
                self.source[id(o)] = (n, [c[1][j] for c in cs] if n is not None else [cs[0][1][j]])
        self.const = own_costs(self.program, self.pr, self.tables, cands, self.op_node, self.costs)

    # -- values --------------------------------------------------------------
    def add_values(self, in_layouts, out_sbp, ties) -> None:
        """An edge (or a hub and its edges) per value a consumer reads."""
        for i, (v, lays) in enumerate(zip(self.program.inputs, in_layouts)):
            self.source[id(v)] = (self.arg_node.get(i), lays)
        reads: dict = {}  # id(var) -> (var, [(node or None, layout per strategy, read path)])
        for index, (node, n) in enumerate(zip(self.program.nodes, self.op_node)):
            for k, atom in enumerate(node.ins):
                if isinstance(atom, Var):
                    if n is not None:
                        lays = [s[0][k] for s in self.strategies[n]]
                    else:
                        lays = [self.cands[index][0][0][k]]
                    path = self.odds.read_path(node, k)
                    reads.setdefault(id(atom), (atom, []))[1].append((n, lays, path))
        for k, atom in enumerate(self.program.outputs):
            if not isinstance(atom, Var):
                continue
            if k in ties:
                i = ties[k]
                n = self.arg_node.get(i)
                lays = list(self.strategies[n]) if n is not None else [in_layouts[i][0]]
                reads.setdefault(id(atom), (atom, []))[1].append((n, lays, ()))
            elif out_sbp is not None and out_sbp[k] is not None:
                reads.setdefault(id(atom), (atom, []))[1].append((None, [out_sbp[k]], ()))
        self._add_dead_tails(reads)
        for key, (atom, uses) in reads.items():
            self._add_value(atom, self.source[key], uses)

    def _add_dead_tails(self, reads: dict) -> None:
        """Read the carries the last iteration of a written-out scan makes
        that nothing reads (kept computed for the rolled loop:
        ``dead_code.last_carries``) as that iteration reads its carries
        coming in: the rolled loop boxes them at the end of its body for a
        next iteration like every other's (``Run.dead_tail``), and the
        solve should pay for what the program moves. Without it a scan of
        four checkpointed RMSNorm + MLP blocks, Megatron on 2x4 with the
        input's gradient not taken, left the last layer's input gradient
        partial over the tensor axis to save its reduction, so every
        layer's scale gradient was reduced over all 8 devices: as rolled,
        236,576 B, where GSPMD moves 233,504 B."""
        read = set(reads) | {id(a) for a in self.program.outputs}
        for carry, coming in unread_last_carries(self.program, read, set(self.source)):
            if id(coming) in reads:
                reads[id(carry)] = (carry, list(reads[id(coming)][1]))

    def _add_value(self, atom, source, uses) -> None:
        src_node, src_lays = source
        wanted = {nd for _, lays, _ in uses for nd in lays}
        if len(wanted | set(src_lays)) == 1:
            return  # one layout throughout: nothing to box
        if len(uses) == 1:
            n, lays, path = uses[0]
            self._link(atom, src_node, src_lays, n, lays, self.odds.chance(path))
            return
        # a hub: the layouts the value may be boxed to, the producer's first
        hub_lays = list(dict.fromkeys(list(src_lays) + sorted(wanted - set(src_lays), key=repr)))
        weight = self.odds.boxing([p for _, _, p in uses])
        boxed = self.tables.table(atom, src_lays, hub_lays)
        reads = [(n, self.tables.table(atom, hub_lays, lays), self.odds.chance(p)) for n, lays, p in uses]
        # tables are shared per shape, dtype and layouts: the same object, the same costs
        alike = (src_node, id(boxed), weight, tuple((n, id(t), w) for n, t, w in reads))
        hub = self.alike_hubs.get(alike)
        if hub is None:
            hub = self.alike_hubs[alike] = self.node(hub_lays, "hub")
            self.hubs[hub] = ([], source)
        self.hubs[hub][0].append(atom)
        self.links.append((boxed, src_node, hub, weight))
        self.links.extend((t, hub, n, w) for n, t, w in reads)

    def _link(self, atom, u, u_lays, v, v_lays, weight) -> None:
        """The cost of boxing ``atom`` from ``u``'s layouts to ``v``'s (a
        table between two nodes, or a node and a fixed end: None)."""
        self.links.append((self.tables.table(atom, u_lays, v_lays), u, v, weight))

    # -- memory --------------------------------------------------------------
    def add_memory(self, in_layouts, out_sbp, ties, aliases) -> None:
        """What arguments and results hold per device, as usages (a tied
        result reuses its argument's buffer, and an aliased one where it
        takes the argument's layout)."""
        grid = self.grid
        self.const_usage += result_table_bytes(self.program)
        for i, (v, lays) in enumerate(zip(self.program.inputs, in_layouts)):
            # a mirror shares its parameter's node, and holds its own buffer in that layout
            n = self.arg_node.get(i)
            held = [block_bytes(v.shape, v.dtype, nd, grid) for nd in lays]
            if n is None:
                self.const_usage += held[0]
            else:
                self.usages[n] += held
        for k, atom in enumerate(self.program.outputs):
            if not isinstance(atom, Var) or k in ties:
                continue
            i = aliases.get(k)
            # the layout of the donated buffer it may be in, where written (an AUTO one is chosen)
            shared = in_layouts[i][0] if i is not None and len(in_layouts[i]) == 1 else None
            want = out_sbp[k] if out_sbp is not None else None
            if want is not None:
                size = block_bytes(atom.shape, atom.dtype, want, grid)
                if i is not None and self.arg_node.get(i) is not None:
                    # an AUTO argument: where it takes the result's layout, the result is in its buffer
                    n = self.arg_node[i]
                    self.usages[n] -= np.array([size if nd == want else 0 for nd in in_layouts[i]])
                self.const_usage += 0 if want == shared else size
                continue
            n, lays = self.source[id(atom)]
            held = [0 if nd == shared else block_bytes(atom.shape, atom.dtype, nd, grid) for nd in lays]
            if n is None:
                self.const_usage += held[0]
            else:
                self.usages[n] += held


def least_usage(form: Formulation) -> int:
    """The least bytes any layout of the problem makes arguments and results
    hold per device (usages are per node, so each node's least counts)."""
    return int(form.const_usage + sum(u.min() for u in form.usages if len(u)))


__all__ = ["Formulation", "formulate", "least_usage", "propagator"]
