"""What XLA's buffer assignment makes of a program's values: the bytes
``memory_analysis()`` reports beside the arguments.

:mod:`sbpjax.compiler.liveness` says when each value is alive. The sum of
what is alive at once is a program's live-range peak, but XLA reports the
allocations it makes, which hold more (the 2-layer 2x4 GPT step at d_model
256 of ``benchmarks/compiler.py``: live-range peak 10,018,324 B, allocations
11,795,796 B). Its buffer assignment:

- gives each result an allocation of its own, alive for the whole run: the
  caller reads it after the program ends;
- lets a temporary value use a result's allocation where it fits and their
  lives do not overlap (before the result is made), trying values from the
  largest down. A value that an elementwise op overwrites in place with a
  result (a gradient and the optimizer state made from it) ends before that
  result begins: the liveness pass cuts its span so (``fused=True``), and
  it may share the result's allocation;
- packs every other temporary into one allocation, whose size is at least
  the most of them alive at once (what is counted here; XLA's packing can
  leave gaps).

:func:`allocated_bytes` follows that on the spans the liveness pass counts,
in program order. XLA's scheduler reorders ops and shortens some spans, so
the figure errs high where the program order keeps values alive longer than
XLA's does (0.92-1.09 of ``memory_analysis()`` on the rows of
``benchmarks/compiler.py``, highest on the deepest).
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass
class Value:
    """A value one device holds: its bytes and the first and last steps of
    the program (decisions) it is alive after."""

    size: int
    first: int
    last: int


class _Allocation:
    """A result's allocation: its size and the spans of the values using it,
    sorted and disjoint."""

    def __init__(self, result: Value):
        self.size = result.size
        self.firsts = [result.first]
        self.lasts = [result.last]

    def takes(self, v: Value) -> bool:
        """Put ``v`` here if it fits and its span overlaps none here. Whether it did."""
        if v.size > self.size:
            return False
        k = bisect.bisect_right(self.firsts, v.first)
        if k > 0 and self.lasts[k - 1] >= v.first:
            return False  # the span before it is still alive
        if k < len(self.firsts) and self.firsts[k] <= v.last:
            return False  # the span after it begins before it ends
        self.firsts.insert(k, v.first)
        self.lasts.insert(k, v.last)
        return True


def allocated_bytes(values: list, results: list, steps: int) -> int:
    """Bytes of the results' allocations and of the one packed with the other
    temporaries (the most of them alive after any of ``steps`` steps), as
    XLA's buffer assignment makes them (module docstring). ``values``: the
    temporaries; ``results``: the program's results (each once)."""
    allocations = [_Allocation(r) for r in sorted(results, key=lambda r: -r.size)]
    heap = [0] * (steps + 1)
    for v in sorted(values, key=lambda v: (-v.size, v.first)):
        if not any(a.takes(v) for a in allocations):
            heap[v.first] += v.size
            heap[v.last + 1] -= v.size
    peak = alive = 0
    for d in heap[:steps]:
        alive += d
        peak = max(peak, alive)
    return sum(r.size for r in results) + peak
