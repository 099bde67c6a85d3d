"""``f.explain(...)``: what the compiler decided, as data and as a table."""

from __future__ import annotations

import dataclasses
import os

from sbpjax.boxing.plan import human_bytes
from sbpjax.compiler.flops import estimated_flops
from sbpjax.compiler.liveness import estimated_peak_bytes
from sbpjax.compiler.loops import plan_runs
from sbpjax.compiler.propagation import Propagation
from sbpjax.compiler.switches import plan_switches
from sbpjax.sbp import format_sbp

_WIDEST = 60  # characters a column shows


def _cell(text: str, width: int) -> str:
    """``text`` padded to ``width``, or cut to it with an ellipsis that says so
    (the whole of it is in ``Explanation.boxings`` / ``decisions``)."""
    return text.ljust(width) if len(text) <= width else text[: width - 1] + "…"


def _short_source(source: str) -> str:
    """``path:line:col (function)`` within a column: a long path gives way to its
    file name first, so the line number stays (it is what one looks up)."""
    if len(source) <= _WIDEST:
        return source
    path, sep, rest = source.partition(":")
    return os.path.basename(path) + sep + rest if sep else source


def _short(nd) -> str:
    return format_sbp(nd)[1:-1] if len(nd) > 1 else str(nd[0])


@dataclasses.dataclass
class Explanation:
    """Per-op signatures with source lines, every boxing, totals, warnings.

    ``bytes``: total planned bytes (OneFlow Table 2 convention);
    ``boxings``: each with ``.src``, ``.dst`` (nd-SBPs), ``.plan``, ``.bytes``."""

    propagation: Propagation

    @property
    def boxings(self) -> list:
        """The plan's boxings, and those of :attr:`dead_tail`."""
        return self.propagation.boxings + self.dead_tail

    @property
    def dead_tail(self) -> list:
        """Boxings a rolled loop runs in its last iteration on a carry nothing
        reads, as it does in every other iteration (``sbpjax.compiler.loops``,
        ``Run.dead_tail``): the written-out plan has no such boxing, the
        compiled program moves its bytes. Each is the loop body's own
        ``Boxing`` (it is also in the plan's), run once more."""
        return [b for r in plan_runs(self.propagation) for b in r.dead_tail]

    @property
    def bytes(self) -> int:
        return self.propagation.bytes + sum(b.bytes for b in self.dead_tail)

    @property
    def comm(self) -> list:
        """Communication ops run themselves (``sbpjax.rules.Comm``: a
        convolution's halo exchange, a cumulative sum's carries), as (op
        index, Comm) pairs, each exchange once; counted in ``bytes``."""
        return self.propagation.comm

    @property
    def choice(self):
        """How the layouts were chosen (``sbpjax.compiler.choice.Choice``): ``method``
        ("ilp" or "greedy"), ``reason`` greedy was kept, the ILP's ``objective``,
        proven ``bound`` and ``gap``, ``solve_s``, ``greedy_bytes``."""
        return self.propagation.choice

    @property
    def timings(self) -> dict:
        """Seconds per phase of the front end: ``trace_s`` (the function to a
        flat program), ``choose_s`` (layouts: the greedy pass and the solver,
        whose own share is ``choice.solve_s``), ``build_s`` (the ``shard_map``
        program); after ``explain(..., compile=True)`` also ``lower_s`` (JAX's
        lowering) and ``xla_compile_s`` (XLA)."""
        return dict(self.propagation.timings)

    def _timing_line(self) -> str | None:
        t = self.propagation.timings
        if not t:
            return None
        front = t.get("trace_s", 0.0) + t.get("choose_s", 0.0) + t.get("build_s", 0.0)
        line = (
            f"front end {front:.2f} s: trace {t.get('trace_s', 0.0):.2f} s, layouts "
            f"{t.get('choose_s', 0.0):.2f} s, build {t.get('build_s', 0.0):.2f} s"
        )
        if "xla_compile_s" in t:
            line += (
                f"; lowering {t['lower_s']:.2f} s, XLA compile {t['xla_compile_s']:.2f} s "
                f"(front end = {front / max(t['xla_compile_s'], 1e-9):.2f} x XLA's)"
            )
        return line

    @property
    def estimated_peak_bytes(self) -> int:
        """The bytes one device is estimated to hold while the program runs:
        its arguments and its values, placed as XLA's buffer assignment
        places them (``sbpjax.compiler.liveness.estimated_peak_bytes``).
        Compare it with ``jitted.lower(...).compile().memory_analysis()``."""
        return estimated_peak_bytes(self.propagation)

    @property
    def estimated_flops(self) -> int:
        """The floating-point work one device does under the plan, estimated
        from its layouts (``sbpjax.compiler.flops``): the compute beside the
        bytes, remat's recomputation and ops left whole on an axis included.
        Compare it with ``compiled.cost_analysis()["flops"]`` (which counts a
        rolled loop's body once)."""
        return estimated_flops(self.propagation)

    @property
    def warnings(self) -> list:
        return self.propagation.warnings

    @property
    def loops(self) -> list:
        """Per scan written out to choose layouts (``jax.lax.scan``, ``nnx.scan``, a
        ``fori_loop``; the backward pass of each is a scan too): ``(source line,
        iterations, iterations the compiled program runs as one loop)``. The
        rest run written out around the loop (``sbpjax.compiler.loops``)."""
        runs = plan_runs(self.propagation)
        out = []
        for loop in self.propagation.program.loops:
            rolled = sum(len(r.positions) for r in runs if r.loop is loop)
            out.append((loop.source, len(loop.iterations), rolled))
        return out

    def _loops_line(self) -> str | None:
        loops = self.loops
        if not loops:
            return None
        runs = plan_runs(self.propagation)
        parts = []
        for (src, n, rolled), loop in zip(loops, self.propagation.program.loops):
            where = os.path.basename(src.split(" (")[0]) + (" (reversed)" if loop.reverse else "")
            part = f"{where}: {rolled} of {n} iterations"
            part += f", {n - rolled} written out" if n > rolled else ""
            tail = sum(b.bytes for r in runs if r.loop is loop for b in r.dead_tail)
            part += f", the last boxing a carry nothing reads ({tail} B)" if tail else ""
            parts.append(part)
        kept = sum(1 for _, _, rolled in loops if rolled)
        return f"loops: {kept} of {len(loops)} scans kept as loops ({'; '.join(parts)})"

    @property
    def conds(self) -> list:
        """Per ``cond`` / ``switch`` written out to choose layouts: ``(source
        line, branches, whether the compiled program runs it as a lax.switch)``;
        one that does not computes every branch and selects
        (``sbpjax.compiler.switches``)."""
        prop = self.propagation
        live = {id(d.node) for d in prop.decisions}
        switches, _ = plan_switches(prop, plan_runs(prop))
        return [
            (c.source, c.n_branches, c.id in switches)
            for c in prop.program.conds
            if any(id(n) in live for n in c.selects)
        ]

    def _conds_line(self) -> str | None:
        conds = self.conds
        if not conds:
            return None
        parts = [
            f"{os.path.basename(src.split(' (')[0])}: {n} branches"
            + ("" if kept else ", every branch computed")
            for src, n, kept in conds
        ]
        kept = sum(1 for *_, k in conds if k)
        return f"conds: {kept} of {len(conds)} run as lax.switch ({'; '.join(parts)})"

    def _regather_line(self) -> str | None:
        prop = self.propagation
        again = [b for b in self.boxings if b.regather]
        if prop.regather_declined is not None:
            count, before, after, extra, with_them, limit = prop.regather_declined
            whose = "the greedy pass's"
            if prop.choice is not None and limit != prop.choice.greedy_bytes:
                whose = "a hand-written layout's that fits the budget"
            return (
                f"regathers: none; gathering {count} gathered arguments again would lower the estimated "
                f"peak per device {human_bytes(before)} -> {human_bytes(after)} for +{extra} B, but the plan "
                f"would then move {with_them} B, more than {whose} {limit} B (regather='auto'; "
                f"sj.jit(..., regather=True) runs them)"
            )
        if not again or prop.regathered is None:
            return None
        before, after = prop.regathered
        return (
            f"regathers: {len(again)} gathered arguments gathered again after the estimated memory peak "
            f"(+{sum(b.bytes for b in again)} B; estimated peak per device {human_bytes(before)} -> "
            f"{human_bytes(after)}; sj.jit(..., regather=False) holds them instead)"
        )

    @property
    def ops(self) -> list:
        """(primitive, source, input nd-SBPs, output nd-SBPs) per op."""
        return [(d.node.name, d.node.source, d.in_sbp, d.out_sbp) for d in self.propagation.decisions]

    def summary(self) -> str:
        """A few lines for logs: op and boxing counts, and bytes per collective."""
        prop = self.propagation
        counts: dict = {}
        for b in self.boxings:
            for s in b.plan.steps:
                n, nbytes = counts.get(s.op, (0, 0))
                counts[s.op] = (n + 1, nbytes + s.bytes)
        for _, c in self.comm:
            n, nbytes = counts.get(c.what, (0, 0))
            counts[c.what] = (n + 1, nbytes + c.bytes)
        lines = [
            f"sj.jit on {prop.placement!r}: {len(prop.decisions)} ops, {len(self.boxings)} boxings, "
            f"{human_bytes(self.bytes)} per step (bytes received, all devices), estimated peak "
            f"{human_bytes(self.estimated_peak_bytes)} and {self.estimated_flops:.3g} FLOPs per device"
        ]
        if prop.choice is not None:
            lines.append("  " + prop.choice.describe())
        if (timing := self._timing_line()) is not None:
            lines.append("  " + timing)
        if (loops := self._loops_line()) is not None:
            lines.append("  " + loops)
        if (conds := self._conds_line()) is not None:
            lines.append("  " + conds)
        if (again := self._regather_line()) is not None:
            lines.append("  " + again)
        for op, (n, nbytes) in sorted(counts.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {op:<15} x{n:<4} {human_bytes(nbytes)}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        prop = self.propagation
        pl = prop.placement
        lines = [
            f"sj.jit on {pl!r}: {len(prop.decisions)} ops, {len(self.boxings)} boxings, "
            f"{self.bytes} B planned, estimated peak {self.estimated_peak_bytes} B and "
            f"{self.estimated_flops} FLOPs per device"
        ]
        if prop.choice is not None:
            lines.append("  " + prop.choice.describe())
        if (timing := self._timing_line()) is not None:
            lines.append("  " + timing)
        if (loops := self._loops_line()) is not None:
            lines.append("  " + loops)
        if (conds := self._conds_line()) is not None:
            lines.append("  " + conds)
        if (again := self._regather_line()) is not None:
            lines.append("  " + again)
        rows = self._rows()
        widths = [min(max(len(r[c]) for r in rows), _WIDEST) for c in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(_cell(v, w) for v, w in zip(r, widths)).rstrip())
        lines.append("  totals: " + self._totals())
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)

    def _rows(self) -> list:
        """The table: a header, a row per op, a row per result's boxing."""
        prop = self.propagation
        names = prop.placement.axis_names
        rows = [("#", "op", "inputs", "outputs", "boxing", "bytes", "source")]
        own: dict = {}
        for i, c in self.comm:
            own.setdefault(i, []).append(c)
        for i, d in enumerate(prop.decisions):
            box = "; ".join(
                [
                    f"{_short(b.src)}->{_short(b.dst)} [{', '.join(s.label() for s in b.plan.steps) or 'free'}]"
                    + (" again" if b.regather else "")
                    for b in d.boxings
                ]
                + [
                    f"{c.what}({','.join(names[a] for a in c.axes)})"
                    + ("" if c in own.get(i, ()) else ", shared with an earlier op")
                    for c in d.comm
                ]
            )
            moved = sum(b.bytes for b in d.boxings) + sum(c.bytes for c in own.get(i, ()))
            rows.append(
                (
                    str(i),
                    d.node.name,
                    " | ".join(_short(n) for n in d.in_sbp),
                    " | ".join(_short(n) for n in d.out_sbp),
                    box,
                    str(moved) if d.boxings or d.comm else "",
                    _short_source(d.node.source),
                )
            )
        for b in prop.out_boxings:
            steps = ", ".join(s.label() for s in b.plan.steps)
            rows.append(("out", "", _short(b.src), _short(b.dst), f"[{steps}]", str(b.bytes), b.where))
        return rows

    def _totals(self) -> str:
        """Bytes per kind of communication."""
        by_kind: dict = {}
        for b in self.boxings:
            for s in b.plan.steps:
                by_kind[s.op] = by_kind.get(s.op, 0) + s.bytes
        for _, c in self.comm:
            by_kind[c.what] = by_kind.get(c.what, 0) + c.bytes
        return ", ".join(f"{k} {v} B" for k, v in sorted(by_kind.items())) or "no communication"

    __repr__ = __str__
