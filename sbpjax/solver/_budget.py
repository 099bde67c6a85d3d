"""How much work a solve may do: a deterministic count, or a wall-clock deadline.

Work is counted in *table entries*: each entry of a cost table that an elimination builds
or a move reads. In library mode only the count decides when to stop, so the result is a
pure function of the problem and the effort; the count never looks at a clock.
"""

from __future__ import annotations

import time


class Budget:
    # Contest mode only: entries a second this code gets through on one core, at the least
    # (measured 1.5e8-3e8 on the benchmark machine's runs), to skip a step that cannot end
    # before the deadline.
    RATE = 5e7

    def __init__(self, effort: float, deadline: float | None = None):
        self.effort = float(effort)
        self.deadline = deadline  # time.monotonic() value; None in library mode
        self.spent = 0.0

    def spend(self, work: float) -> None:
        self.spent += float(work)

    def left(self) -> float:
        return self.effort - self.spent

    def affords(self, work: float) -> bool:
        """Whether ``work`` more entries fit (and, in contest mode, can end in time)."""
        if self.spent + work > self.effort:
            return False
        return self.deadline is None or time.monotonic() + work / self.RATE < self.deadline

    def late(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def over(self) -> bool:
        return self.spent >= self.effort or self.late()
