"""The layout choice as a problem of its own: strategies per node, pairwise costs, memory.

    import sbpjax.solver as ss
    problem = ss.load_problem("benchmarks/iopddl/asplos-2025-iopddl-G.json.gz")
    solution = ss.solve(problem)                  # deterministic: a work limit, no clock
    solution.strategies, solution.cost, solution.lower_bound, solution.feasible

The form is the IOPDDL contest's (ASPLOS 2025 / EuroSys 2025): see :mod:`sbpjax.solver.problem`.
``python -m sbpjax.solver PROBLEM.json[.gz] --time-limit SECONDS`` prints one solution line,
as the contest's entries did. :mod:`sbpjax.solver.synthetic` builds problems shaped like a
training step's. This package imports only numpy and :mod:`sbpjax._errors`.
"""

from sbpjax.solver.problem import FORBIDDEN_COST, Edge, Problem, load_problem
from sbpjax.solver.solve import DEFAULT_EFFORT, Solution, solve

__all__ = ["Problem", "Edge", "load_problem", "FORBIDDEN_COST", "Solution", "solve", "DEFAULT_EFFORT"]
