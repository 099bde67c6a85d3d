"""The search space: device grids refined into prime axes, and per-layer matmul choices.

AutoDDL's 3-D SBP matmul (section 4.2.2) factors the devices as p = p0*p1*p2 and
lays ``Y = X W`` out as X (S(0), B, S(1)), W (B, S(1), S(0)), Y (S(0), S(1), P).
Data parallelism is (p, 1, 1), Megatron column / row parallelism (1, p, 1) /
(1, 1, p), SUMMA-like 2-D (1, a, b). On a cluster (section 4.2.3) every
placement axis (e.g. nodes, GPUs per node) is factored on its own.

Different layers use different factorizations, yet one program needs one
placement. So every placement axis is refined, row-major, into *fine axes*: its
prime factors in ascending order (an axis of 8 becomes three axes of 2). A
factorization of that axis gives each role a run of consecutive fine axes, in the
order data (D), column (C), row (R); the nd-SBP of each tensor then has one SBP
per fine axis. An axis of 12 = 2*2*3 offers the runs of (2, 2, 3) only, so (3,
4, 1) is not in its space (it would need another device order).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import CostModel
from sbpjax.sbp import B, P, S

DATA, COLUMN, ROW = "D", "C", "R"

# Per fine axis, the SBP of each tensor of Y = X W under each role (AutoDDL Fig. 6),
# and of the gradients: dX = dY W^T, dW = X^T dY.
_X = {DATA: S(0), COLUMN: B, ROW: S(1)}
_W = {DATA: B, COLUMN: S(1), ROW: S(0)}
_Y = {DATA: S(0), COLUMN: S(1), ROW: P}
_DX = {DATA: S(0), COLUMN: P, ROW: S(1)}  # before the boxing to the previous layer's output
_DY = {DATA: S(0), COLUMN: S(1), ROW: B}  # what both gradient products need
_DW = {DATA: P, COLUMN: S(1), ROW: S(0)}  # before the weight-gradient all-reduce
_SBPS = {"x": _X, "w": _W, "y": _Y, "dx": _DX, "dy": _DY, "dw": _DW}

# A choice's roles and layouts are pure functions of its runs, and pricing asks for them
# for every pair of choices: computed once per runs (a grid has a few hundred at most).


@functools.cache
def _roles(runs: tuple) -> tuple[str, ...]:
    return tuple(r for d, c, w in runs for r in (DATA,) * d + (COLUMN,) * c + (ROW,) * w)


@functools.cache
def _degrees(runs: tuple, fine_sizes: tuple) -> tuple[int, int, int]:
    roles = _roles(runs)
    p0, p1, p2 = (
        math.prod(s for s, r in zip(fine_sizes, roles) if r == role) for role in (DATA, COLUMN, ROW)
    )
    return p0, p1, p2


@functools.cache
def _nd_sbp(runs: tuple, tensor: str) -> tuple:
    return tuple(_SBPS[tensor][r] for r in _roles(runs))


@functools.cache
def _out_sbp(runs: tuple, dim: int) -> tuple:
    return tuple(S(dim) if r == ROW else _Y[r] for r in _roles(runs))


def prime_factors(n: int) -> tuple[int, ...]:
    """Prime factors of ``n`` in ascending order (``prime_factors(12) == (2, 2, 3)``)."""
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    if n > 1:
        out.append(n)
    return tuple(out)


class Grid:
    """A device grid for the search: named placement axes, their sizes, and their
    alpha-beta network parameters. It needs no devices, so a search can plan for a
    cluster that is not here (``Grid((128, 8), ("node", "gpu"), cost_model=...)``).

    ``fine_sizes``: the prime refinement of every axis, outer axis first;
    ``fine_owner[i]``: the axis that fine axis ``i`` refines; ``fine_names``:
    ``"<axis><j>"``, e.g. ``x0, x1, x2`` for an axis ``x`` of 8. With
    ``refine=False`` every axis stays one fine axis (its devices take one role).
    """

    def __init__(
        self,
        shape: int | Sequence[int],
        axis_names: Sequence[str] | str | None = None,
        cost_model: CostModel | None = None,
        refine: bool = True,
    ):
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not shape or any(not isinstance(s, (int, np.integer)) or s < 1 for s in shape):
            raise SBPError(
                f"Grid: axis sizes must be positive ints, got {shape}; e.g. Grid((16, 8), ('node', 'gpu'))."
            )
        if axis_names is None:
            axis_names = tuple("xyzw"[i] if i < 4 else f"a{i}" for i in range(len(shape)))
        elif isinstance(axis_names, str):
            axis_names = (axis_names,)
        axis_names = tuple(axis_names)
        if len(axis_names) != len(shape) or len(set(axis_names)) != len(axis_names):
            raise SBPError(f"Grid: {len(shape)} axes {shape} need as many distinct names, got {axis_names}.")
        self.shape = tuple(int(s) for s in shape)
        self.axis_names = axis_names
        self.cost_model = cost_model or CostModel()
        # refine=False keeps every axis whole: each gives all its devices to one role
        # (a smaller space, and fewer axes for the planner on large real placements)
        self.axis_factors = tuple(prime_factors(s) if refine else ((s,) if s > 1 else ()) for s in self.shape)
        self.fine_sizes = tuple(f for fs in self.axis_factors for f in fs)
        self.fine_owner = tuple(a for a, fs in enumerate(self.axis_factors) for _ in fs)
        self.fine_names = tuple(
            f"{self.axis_names[a]}{j}" for a, fs in enumerate(self.axis_factors) for j in range(len(fs))
        )

    @classmethod
    def from_placement(cls, placement, cost_model: CostModel | None = None, refine: bool = True) -> Grid:
        """The grid of a real placement (its axis names and sizes)."""
        return cls(placement.shape, placement.axis_names, cost_model, refine)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def fine_placement(self, placement):
        """``placement`` (of this grid's shape) reshaped row-major onto the fine axes;
        the device order is kept, so S over ``x0, x1, x2`` is S over ``x``."""
        from sbpjax.placement import Placement

        if tuple(placement.shape) != self.shape:
            raise SBPError(
                f"Grid.fine_placement: the placement has shape {placement.shape}, the grid {self.shape}; "
                "search on Grid.from_placement(placement) to apply a strategy to it."
            )
        if not self.fine_sizes:  # one device
            return placement
        return Placement(placement.devices.reshape(self.fine_sizes), self.fine_names)

    def fine_axis_names(self, fine_axes: Sequence[int]) -> tuple[str, ...]:
        """The placement axes (not fine axes) that a group of fine axes spans; the
        cost model prices a group at its slowest axis."""
        return tuple(dict.fromkeys(self.axis_names[self.fine_owner[i]] for i in fine_axes))

    def __eq__(self, other):
        return isinstance(other, Grid) and (self.shape, self.axis_names, repr(self.cost_model)) == (
            other.shape,
            other.axis_names,
            repr(other.cost_model),
        )

    def __hash__(self):
        return hash((self.shape, self.axis_names))

    def __repr__(self):
        return "Grid(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + ")"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One layer's factorization: for every placement axis, how many of its fine axes
    (a consecutive run each) go to data, column and row parallelism."""

    runs: tuple  # per placement axis: (n_data, n_column, n_row) fine axes

    def roles(self) -> tuple[str, ...]:
        """The role of every fine axis, outer first."""
        return _roles(self.runs)

    def degrees(self, grid: Grid) -> tuple[int, int, int]:
        """(p0, p1, p2): the data, column and row parallel degrees over the whole grid."""
        return _degrees(self.runs, grid.fine_sizes)

    def per_axis(self, grid: Grid) -> dict:
        """``{axis name: (p0, p1, p2)}``: the factorization of every placement axis."""
        return {
            name: (math.prod(fs[:d]), math.prod(fs[d : d + c]), math.prod(fs[d + c :]))
            for name, fs, (d, c, _) in zip(grid.axis_names, grid.axis_factors, self.runs)
        }

    def fine_axes(self, role: str) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.roles()) if r == role)

    # nd-SBPs over the fine axes
    def x_sbp(self) -> tuple:
        return _nd_sbp(self.runs, "x")

    def w_sbp(self) -> tuple:
        return _nd_sbp(self.runs, "w")

    def y_sbp(self) -> tuple:
        """The product's natural layout (partial over the row axes)."""
        return _nd_sbp(self.runs, "y")

    def out_sbp(self, dim: int) -> tuple:
        """The layer output (AutoDDL 4.2: split, never partial): the row partials
        reduce-scattered onto tensor dim ``dim``."""
        return _out_sbp(self.runs, dim)

    def dx_sbp(self) -> tuple:
        return _nd_sbp(self.runs, "dx")

    def dy_sbp(self) -> tuple:
        return _nd_sbp(self.runs, "dy")

    def dw_sbp(self) -> tuple:
        return _nd_sbp(self.runs, "dw")

    def label(self, grid: Grid) -> str:
        """``D4 C16 R1`` on one axis; ``node:D2C4R1 gpu:D1C1R8`` on several."""
        if len(grid.shape) == 1:
            d, c, r = self.degrees(grid)
            return f"D{d} C{c} R{r}"
        return " ".join(f"{n}:D{d}C{c}R{r}" for n, (d, c, r) in self.per_axis(grid).items())


def choices(grid: Grid) -> list[Choice]:
    """Every factorization of the grid, data-parallel first (layers drop those
    their dims do not divide)."""
    per_axis = []
    for fs in grid.axis_factors:
        k = len(fs)
        per_axis.append([(d, c, k - d - c) for d in range(k, -1, -1) for c in range(k - d, -1, -1)])
    return [Choice(tuple(r)) for r in itertools.product(*per_axis)]
