"""Cost tables' lower bounds: never above the plan an entry settles to.

The layout choice solves on bounds and plans exactly only the entries its
solution uses (``sbpjax.compiler.tables``); a bound above its entry's cost
would make a plan look optimal that is not. The oracle here is the boxing
planner itself, as the tables call it, priced as the tables price it.
"""

import itertools

import jax
import numpy as np
import pytest

import sbpjax as sj
from sbpjax.boxing.plan import bytes_lower_bound
from sbpjax.compiler.options import DEFAULT_OPTIONS
from sbpjax.compiler.pricing import boxing_cost
from sbpjax.compiler.propagator import Propagator
from sbpjax.compiler.tables import LatencyBound, Tables, _launches, crossed_axes, least_latency, moves
from sbpjax.compiler.trace import trace

ALL_1D = [sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max]
# a slow axis between nodes and a fast one inside them: groups differ in latency
TWO_TIER = sj.CostModel(alpha={"x": 2e-5, "y": 2e-6}, beta={"x": 8e-11, "y": 4e-12})


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("cost_model", [sj.CostModel(), TWO_TIER], ids=["default", "two_tier"])
@pytest.mark.parametrize("grid", [(2, 4), (4, 2), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(64, 32), (6, 5), (2, 8)])
def test_an_entrys_bound_is_never_above_its_plan(shape, grid, cost_model, ring):
    names = ("x", "y", "z")[: len(grid)]
    if cost_model is TWO_TIER and len(grid) == 3:
        cost_model = sj.CostModel(alpha={**TWO_TIER.alpha, "z": 2e-6}, beta={**TWO_TIER.beta, "z": 4e-12})
    pl = sj.placement(grid, names)
    launch = _launches(cost_model, pl, ring)
    pairs = list(itertools.product(itertools.product(ALL_1D, repeat=len(grid)), repeat=2))
    if len(grid) == 3:  # 15,625 pairs: a fixed sample keeps the test fast
        pairs = [pairs[i] for i in np.random.default_rng(1).choice(len(pairs), 400, replace=False)]
    tighter = crossing = 0
    least = min(lat for ops in launch.values() for lat in ops.values())
    for src, dst in pairs:
        moved = bytes_lower_bound(shape, 4, pl, src, dst)
        if not moves(moved, shape, src, dst, pl.shape):
            continue
        crossing += not moved
        plan = sj.plan_boxing(
            shape, np.float32, pl, src, dst, cost_model=cost_model, launch_priced="ring" if ring else False
        )
        lat = least_latency(launch, src, dst, pl.shape)
        bound = 64 * moved + round(64 * lat)
        cost = boxing_cost(plan, cost_model, DEFAULT_OPTIONS, ring=ring)
        assert bound <= cost, (src, dst, bound, cost, str(plan))
        tighter += lat > least
    if ring and len(set(grid)) > 1:  # a reduction over the larger axis pays more than a permute round
        assert tighter > 0
    if shape == (64, 32):  # partial targets whose bytes bound is 0 but that cross an axis
        assert crossing > 0


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("grid", [(2, 4), (1, 8), (2, 2, 2)])
def test_the_tables_latency_bound_is_least_latency_on_every_pair(grid, ring):
    """One LatencyBound asked for every pair of layouts of 2-D tensors (as
    Tables asks it, its minima kept per crossed set and per summed axis)
    answers each as ``least_latency`` does, which computes the pair alone,
    and says whether the pair crosses an axis. The bound's values are
    checked against plans in ``test_an_entrys_bound_is_never_above_its_plan``
    and by hand below."""
    pl = sj.placement(grid, ("x", "y", "z")[: len(grid)])
    for cost_model in (sj.CostModel(), TWO_TIER if len(grid) == 2 else sj.CostModel()):
        launch = _launches(cost_model, pl, ring)
        fast = LatencyBound(launch, pl.shape)
        for src, dst in itertools.product(itertools.product(ALL_1D, repeat=len(grid)), repeat=2):
            crosses, lat = fast(src, dst)
            assert lat == least_latency(launch, src, dst, pl.shape), (src, dst)
            assert crosses == bool(crossed_axes(src, dst, pl.shape)), (src, dst)
        assert LatencyBound({}, pl.shape)((sj.P,) * len(grid), (sj.B,) * len(grid)) == (True, 0.0)


def test_crossed_axes_by_hand():
    S0, S1, B, P = sj.S(0), sj.S(1), sj.B, sj.P
    grid = (2, 4)
    assert crossed_axes((S0, B), (B, S0), grid) == {0}  # gather over x; y is sliced
    assert crossed_axes((B, P), (B, B), grid) == {1}
    assert crossed_axes((S0, S1), (S1, S0), grid) == {0, 1}
    assert crossed_axes((B, S0), (P, P), grid) == set()  # zero-fills only
    assert crossed_axes((S0, P), (S0, P), (2, 4)) == set()
    assert crossed_axes((P, S0), (B, S0), (1, 8)) == set()  # an axis of one device


def test_a_reduction_over_the_larger_axis_is_bounded_by_its_own_collective():
    """A partial over the 4-device axis of 2x4 is summed by a reducing
    collective over a group with that axis: on the default cost model's ring
    times that is 2.5 MB of latency, where one permute round over any group
    is 0.9 MB (the bound of every entry before)."""
    pl = sj.placement((2, 4), ("x", "y"))
    launch = _launches(sj.CostModel(), pl, ring=True)
    reduce_y = min(launch[frozenset({1})]["reduce_scatter"], launch[frozenset({1})]["all_reduce"])
    assert least_latency(launch, (sj.B, sj.P), (sj.B, sj.S(0)), pl.shape) == reduce_y
    assert reduce_y > launch[frozenset({0})]["permute"]
    plan = sj.plan_boxing((64, 32), np.float32, pl, (sj.B, sj.P), (sj.B, sj.S(0)), launch_priced="ring")
    assert [(s.op, s.axes) for s in plan.steps if s.bytes] == [("reduce_scatter", ("y",))]


def test_a_reduction_into_a_whole_value_also_spreads_the_sum():
    """Summed into a value whole over y, a partial over y pays an all-reduce,
    or a reduce-scatter (which leaves the sum split over y) and one more step
    over a group with y: on the ring times of 2x4, the reduce-scatter over y
    and a permute round, less than the all-reduce over y; and the planner's
    own plan costs at least that."""
    pl = sj.placement((2, 4), ("x", "y"))
    launch = _launches(sj.CostModel(), pl, ring=True)
    y = launch[frozenset({1})]
    spread = min(lat for g, ops in launch.items() if 1 in g for lat in ops.values())
    whole = least_latency(launch, (sj.B, sj.P), (sj.B, sj.B), pl.shape)
    assert whole == min(y["all_reduce"], y["reduce_scatter"] + spread)
    assert whole > least_latency(launch, (sj.B, sj.P), (sj.B, sj.S(0)), pl.shape) == y["reduce_scatter"]
    plan = sj.plan_boxing((64, 32), np.float32, pl, (sj.B, sj.P), (sj.B, sj.B), launch_priced="ring")
    assert boxing_cost(plan, sj.CostModel(), DEFAULT_OPTIONS, ring=True) >= 64 * whole


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("grid", [(2, 4), (2, 2, 2)])
def test_every_tables_entry_is_its_bound_by_the_reference_functions(grid, ring):
    """Tables computes its bounds once per shape class and pair of layout
    ids; each entry must be what the reference functions give that entry on
    its own: 64 times ``Propagator.bound``'s bytes plus 64 times
    ``least_latency`` where ``moves`` says a byte moves, else 0; 0 for a
    zero tensor; exact on the diagonal. Shapes of one class (dims the device
    count divides), uneven ones and two dtypes, over the layouts of a
    rank-2 value."""
    pl = sj.placement(grid, ("x", "y", "z")[: len(grid)])
    program = trace(
        lambda a, b, c, d: (a + 1, b + 1, c + 1, d + 1, jax.numpy.zeros((8, 16))),
        [
            jax.ShapeDtypeStruct(s, t)
            for s, t in (
                ((8, 16), np.float32),
                ((64, 32), np.float32),
                ((6, 5), np.float32),
                ((8, 16), jax.numpy.bfloat16),
            )
        ],
        jax.tree.flatten(((0, 0, 0, 0), {}))[1],
    )
    pr = Propagator(program, pl, sj.CostModel())
    tables = Tables(pr, sj.CostModel(), DEFAULT_OPTIONS, ring=ring)
    launch = _launches(sj.CostModel(), pl, ring)
    layouts = [nd for nd in itertools.product([sj.S(0), sj.S(1), sj.B, sj.P], repeat=len(grid))]
    atoms = list(program.inputs) + [program.outputs[-1]]
    assert id(atoms[-1]) in pr.zeros
    for atom in atoms:
        table = tables.table(atom, layouts[::2], layouts[1::2] + layouts[:3])
        for a, s in enumerate(table.src):
            for c, d in enumerate(table.dst):
                if s == d:
                    assert table.exact[a, c]
                    continue
                moved = pr.bound(atom, s, d)
                if id(atom) in pr.zeros or not moves(moved, atom.shape, s, d, pl.shape):
                    want = 0
                else:
                    want = 64 * moved + round(64 * least_latency(launch, s, d, pl.shape))
                assert table.values[a, c] == want, (atom.shape, atom.dtype, s, d)
