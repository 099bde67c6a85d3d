"""The layout choice's integer programs, solved by HiGHS through highspy.

Every program here is binary (0 <= x <= 1, integral) with linear rows
``lo <= A x <= hi``: :func:`solve_binary` takes them as arrays and returns the
solution, its objective, HiGHS's proven bound and its status.

Decision: highspy (HiGHS's own Python binding) rather than
``scipy.optimize.milp``, which runs the same solver: highspy takes a MIP
start. The layout choice always has a good plan in hand before it asks HiGHS
(the greedy pass's, or the best plan so far in the window search), and
without a start HiGHS spends its whole time limit at the root node looking
for one. On the model zoo's height-split ResNet step (7,949 binaries) the
solve without a start ended its 10 s anywhere between the greedy plan
(352,488 B, above GSPMD's 294,752 B) and 147,504 B, from one run to the next;
started from greedy's choices, HiGHS completes them into a plan at once and
every run ended at 147,488 B with any limit from 4 s up. (Since boxing ties
are ranked as the solver prices latency, ``Step.tie_time``, that program is
solved to optimality in about 2 s; the start still bounds every time-limited
solve by the plan it started from.) A start is a partial assignment (the
ops' candidate columns): HiGHS completes the rest (the boxing columns).

Decision: HiGHS below 1.13 (``pyproject.toml``), 1.12 being the version
scipy bundles. Measured on the 4-layer GPT step of ``benchmarks/compiler.py``
(``gpt_sweep_d64_L4_2x4``, 7,779 binaries with alike layers sharing
columns): 1.12.0 and 1.13.0 prove the shared solve within 0.12-0.36% in
4.5-5 s (8,339,512 B moved); 1.13.1, 1.14, 1.15 and 1.16 stop at their 10 s
with a 53-60% gap, with or without a start and with one thread, and the
window search that follows ends at 9.2 MB (the 8-layer step: 16.4 MB against
20.0 MB). The height-split ResNet above solves the same on both. The pin
has a cost, measured too: on the model zoo's scanned decoder
(``benchmarks/models.py``), whose whole-program solve stops at its time
limit on every release, 1.16's stop (53% gap) leads the window search to a
plan moving 73.7 MB, 1.12-1.15's (57%) to one moving 78.4 MB (GSPMD:
99.0 MB; both plans peak below GSPMD's 8.9 MB since a scan's slices share
their layouts, ``solve.loop_classes``). 1.16 costs the GPT steps more (up to
3.5 MB per step) and 1.12 proves their solves, so 1.12 is kept.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

# HiGHS prints a banner on stdout the first time a solver object is made in a
# process, whatever its options: made once with stdout closed (see _quiet).
_BANNER_SHOWN = False


@dataclasses.dataclass
class MilpResult:
    """``x``: the solution (None when HiGHS found none); ``objective``: its
    cost; ``bound``: the proven lower bound (None when unknown); ``message``:
    HiGHS's model status; ``started``: HiGHS accepted the MIP start."""

    x: np.ndarray | None
    objective: float | None
    bound: float | None
    message: str
    started: bool = False


def _quiet():
    """Make the first solver object of the process with stdout (file
    descriptor 1, where HiGHS's C++ code writes) sent to /dev/null."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return
    import highspy

    _BANNER_SHOWN = True
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to close (a GUI process): nowhere to print either
        highspy.Highs()
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_binary(
    cost,
    A,
    lo,
    hi,
    *,
    time_limit: float,
    rel_gap: float,
    start: dict[int, float] | None = None,
) -> MilpResult:
    """Minimize ``cost @ x`` over binary ``x`` with ``lo <= A @ x <= hi``.

    ``A``: a scipy sparse matrix; ``time_limit`` in seconds; ``rel_gap``:
    stop once the solution is proven within this fraction of the optimum;
    ``start``: {column: value} for some columns, a solution HiGHS completes
    and starts from (ignored by HiGHS when it cannot be completed)."""
    import highspy

    _quiet()
    A = A.tocsc()
    n = len(cost)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    lp = highspy.HighsLp()
    lp.num_col_ = n
    lp.num_row_ = A.shape[0]
    lp.col_cost_ = np.asarray(cost, dtype=np.float64)
    lp.col_lower_ = np.zeros(n)
    lp.col_upper_ = np.ones(n)
    lp.row_lower_ = np.asarray(lo, dtype=np.float64)
    lp.row_upper_ = np.asarray(hi, dtype=np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = A.indptr
    lp.a_matrix_.index_ = A.indices
    lp.a_matrix_.value_ = A.data
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h.passModel(lp)
    started = False
    if start:
        cols = np.fromiter(start.keys(), dtype=np.int32, count=len(start))
        vals = np.fromiter(start.values(), dtype=np.float64, count=len(start))
        started = h.setSolution(len(cols), cols, vals) == highspy.HighsStatus.kOk
    h.run()
    info = h.getInfo()
    message = h.modelStatusToString(h.getModelStatus())
    if info.primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        return MilpResult(None, None, None, message, started)
    bound = float(info.mip_dual_bound)
    return MilpResult(
        np.asarray(h.getSolution().col_value),
        float(info.objective_function_value),
        bound if np.isfinite(bound) else None,
        message,
        started,
    )
