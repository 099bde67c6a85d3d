"""Matmul and convolution FLOPs of a compiled program, each loop counted as often as it runs.

XLA's ``cost_analysis()`` counts a ``while`` loop's body once, whatever its trip count:
a scanned model's figure is that of one iteration of each loop plus whatever runs outside
them. Two programs of one step compare fairly by it only when they keep the same loops
alike. A plan that writes one iteration of a scan out of its loop (sbpjax does, where the
first layer wants other layouts) is charged that iteration on top: the model zoo's scanned
decoder counted 1.22x GSPMD's FLOPs for the same work.

:func:`loop_flops` reads the compiled HLO text instead: every ``dot`` (2 x output
elements x contracted size) and ``convolution`` (2 x output elements x kernel elements
per output feature), in every computation the entry reaches, each computation counted as
often as it runs: ``sbpjax.comm``'s reading of the program, the one ``sj.collectives``
counts a loop's collectives by (a while body its ``known_trip_count`` times, once where
XLA knows none; a conditional's branches each once, an upper bound). Elementwise work is
left out: in these models it is a few percent of the matmuls' (the decoder's: 5%), and
XLA's fusions hide how much of it runs.
"""

from __future__ import annotations

import math
import re

# the HLO reading sj.collectives uses: computations' lines, and how often each runs
from sbpjax.comm import _computations, _multipliers

_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ([a-z0-9]+)\[([\d,]*)\]\S* ([\w\-]+)\(([^)]*)\)(.*)$")


def _dims(text: str) -> tuple:
    return tuple(int(d) for d in text.split(",") if d)


def _op_flops(op: str, out: tuple, operands: list, attrs: str) -> float:
    if op == "dot" and operands and operands[0] is not None:
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
        k = math.prod(operands[0][i] for i in _dims(contracted.group(1))) if contracted else 1
        return 2.0 * math.prod(out) * k
    if op == "convolution" and len(operands) > 1 and operands[1] is not None:
        labels = re.search(r"dim_labels=\w+_(\w+)->", attrs)
        kernel = operands[1]
        per_out = math.prod(kernel) // kernel[labels.group(1).index("o")] if labels else 1
        return 2.0 * math.prod(out) * per_out
    return 0.0


def _computation_flops(lines: list) -> float:
    shapes: dict = {}  # array-valued instructions (parameters included) by name
    total = 0.0
    for line in lines:
        d = _DEF.match(line)
        if not d:  # a tuple-valued instruction, or not an instruction
            continue
        name, shape, op, args, attrs = d.group(1), _dims(d.group(3)), d.group(4), d.group(5), d.group(6)
        shapes[name] = shape
        operands = [shapes.get(o) for o in re.findall(r"%([\w.\-]+)", args)]  # typed or not
        total += _op_flops(op, shape, operands, attrs)
    return total


def loop_flops(hlo: str) -> float:
    """Matmul and convolution FLOPs of the compiled HLO text ``hlo`` (see the module
    docstring), per device for an SPMD program."""
    comps = _computations(hlo)
    runs = _multipliers(comps)
    return sum(runs.get(name, 1) * _computation_flops(lines) for name, lines in comps.items())
