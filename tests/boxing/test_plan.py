"""Plans: OneFlow Table 2 bytes, floors, readable text, determinism."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import sbpjax as sj
from sbpjax.boxing.plan import COLLECTIVE_OF, bytes_lower_bound, clear_caches

ALL_1D = [sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max, sj.P_min]


def table2_same(src, dst, p, T):
    """OneFlow Table 2, 'same placement' column; P(max|min) -> S costs like P(sum) -> S."""
    kind = lambda s: "S" if isinstance(s, sj.Split) else ("B" if s == sj.B else "P")  # noqa: E731
    a, b = kind(src), kind(dst)
    if src == dst:
        return 0
    if a == "S" and b == "S":
        return (p - 1) * T // p
    if a == "S" and b == "B":
        return (p - 1) * T
    if a == "P" and b == "S":
        return (p - 1) * T
    if a == "P" and b == "B":
        return 2 * (p - 1) * T
    if a == "P" and b == "P":  # P(op) -> P(other op): reduce-scatter, then a free fill
        return (p - 1) * T
    return 0  # B->S, S->P, B->P


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_table_2_bytes_exactly(p):
    shape = (24 * 7, 48)  # both dims divisible by 2, 3, 4, 8
    T = shape[0] * shape[1] * 4
    pl = sj.placement(p, "x")
    for src, dst in itertools.product(ALL_1D, ALL_1D):
        plan = sj.plan_boxing(shape, np.float32, pl, src, dst)
        assert plan.bytes == table2_same(src, dst, p, T), (src, dst, str(plan))


@pytest.mark.parametrize(
    "cost_model",
    [sj.CostModel(), sj.CostModel(alpha={"x": 2e-5, "y": 2e-6}, beta={"x": 8e-11, "y": 4e-12})],
    ids=["one_bandwidth", "two_tier"],
)
def test_a_plan_does_not_depend_on_the_shapes_planned_before_it(cost_model):
    """Searches are shared by the plans of one shape and itemsize, not by
    every shape whose dims the device count divides: between those, paths
    of equal bytes swap their time ranking with the size. On links of two
    bandwidths a sum to B over 2x4 is one all-reduce for a small tensor and
    hierarchical for a large one; on one bandwidth a permute's time counts
    its busiest device, and ``(P, S(0)) -> (B, S(1))`` reduce-scatters over
    another dim for a large tensor than for a small one (found by review).
    Shared, each shape got the plan of the first one planned. Every order,
    from empty caches, gives each shape (and dtype) the plan it gets alone."""
    pl = sj.placement((2, 4), ("x", "y"))
    cases = [
        ((64, 32), np.float32),
        ((2048, 2048), np.float32),
        ((8, 8), np.float32),
        ((64, 32), jnp.bfloat16),
    ]
    pairs = [
        ((sj.P, sj.P), (sj.B, sj.B)),
        ((sj.S(0), sj.S(0)), (sj.B, sj.B)),
        ((sj.P, sj.S(0)), (sj.B, sj.S(1))),
        ((sj.S(1), sj.P), (sj.S(0), sj.B)),
    ]

    def plans(order):
        clear_caches()
        return {
            (shape, np.dtype(dtype).name, src, dst, priced): str(
                sj.plan_boxing(shape, dtype, pl, src, dst, cost_model=cost_model, launch_priced=priced)
            )
            for shape, dtype in order
            for src, dst in pairs
            for priced in (False, "ring")
        }

    alone = {}
    for case in cases:
        alone.update(plans([case]))
    for order in (cases, cases[::-1], cases[1:] + cases[:1]):
        assert plans(order) == alone, order
    clear_caches()


@pytest.mark.parametrize("src,dst", [((sj.P, sj.P), (sj.B, sj.B)), ((sj.S(0), sj.S(0)), (sj.B, sj.B))])
def test_equal_bytes_go_to_the_plan_with_fewer_launches_unless_links_differ(src, dst):
    """Between plans of equal bytes the planner picks by time with one alpha
    per collective (Step.tie_time), as the layout choice prices latency: on
    even links a reduction (gather) over both axes of 2x4 is one collective
    over (x, y), not three (two) over one axis at a time. Where the x axis is
    a slow network between nodes, the hierarchical plan, which moves only a
    quarter of the bytes over x, is kept for a large tensor (its bytes are
    the same), and the one collective for a small one (latency first)."""
    pl = sj.placement((2, 4), ("x", "y"))
    nodes = sj.CostModel(alpha={"x": 2e-5, "y": 2e-6}, beta={"x": 8e-11, "y": 4e-12})
    flat = sj.plan_boxing((256, 256), np.float32, pl, src, dst)
    assert [(s.op, s.axes) for s in flat.steps if s.bytes] in (
        [("all_reduce", ("x", "y"))],
        [("all_gather", ("x", "y"))],
    )
    big = sj.plan_boxing((256, 256), np.float32, pl, src, dst, cost_model=nodes)
    small = sj.plan_boxing((8,), np.float32, pl, src, dst, cost_model=nodes)
    assert big.bytes == flat.bytes
    assert len([s for s in big.steps if s.bytes]) > 1
    assert all(len(s.axes) == 1 for s in big.steps if s.bytes)
    assert len([s for s in small.steps if s.bytes]) == 1


def test_table_2_collectives():
    pl = sj.placement(8, "x")
    op = lambda a, b: [s.op for s in sj.plan_boxing((64, 64), np.float32, pl, a, b).steps]  # noqa: E731
    assert op(sj.S(0), sj.S(1)) == ["all_to_all"]
    assert op(sj.S(0), sj.B) == ["all_gather"]
    assert op(sj.P, sj.S(0)) == ["reduce_scatter"]
    assert op(sj.P, sj.B) == ["all_reduce"]
    assert op(sj.B, sj.S(1)) == ["local_slice"]
    assert op(sj.S(1), sj.P) == ["zero_fill"] and op(sj.B, sj.P_max) == ["zero_fill"]
    pmax = sj.plan_boxing((64, 64), np.float32, pl, sj.P_max, sj.S(0)).steps[0]
    assert pmax.op == "reduce_scatter" and pmax.reduce == "max" and pmax.collective == "all-to-all"
    assert set(COLLECTIVE_OF) >= {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "local_slice",
        "zero_fill",
        "transfer",
        "permute",
    }


def test_pairs_without_partials_are_at_the_floor():
    pl = sj.placement((2, 4), ("x", "y"))
    vals = [sj.S(0), sj.S(1), sj.B]
    for src, dst in itertools.product(itertools.product(vals, repeat=2), repeat=2):
        plan = sj.plan_boxing((64, 32), np.float32, pl, src, dst)
        assert plan.floor is not None and plan.bytes == plan.floor, str(plan)


@pytest.mark.parametrize("grid", [(2, 4), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(64, 32), (6, 5)])
def test_bytes_lower_bound_never_exceeds_the_plan(shape, grid):
    """The bound the compiler uses to skip candidates without a search: below
    every plan (all pairs, even and uneven), the floor when nothing is partial,
    and the plan itself for most even partial sources."""
    pl = sj.placement(grid, ("x", "y", "z")[: len(grid)])
    pairs = list(itertools.product(itertools.product(ALL_1D, repeat=len(grid)), repeat=2))
    if len(grid) == 3:  # 4096 pairs: a fixed sample of 500 keeps the test fast
        pairs = [pairs[i] for i in np.random.default_rng(0).choice(len(pairs), 500, replace=False)]
    exact = partial_sources = 0
    for src, dst in pairs:
        bound = bytes_lower_bound(shape, 4, pl, src, dst)
        plan = sj.plan_boxing(shape, np.float32, pl, src, dst)
        assert bound <= plan.bytes, (src, dst, bound, str(plan))
        if plan.floor is not None:
            assert bound == plan.floor, (src, dst)
        if any(isinstance(s, sj.sbp.Partial) for s in src) and not any(
            isinstance(s, sj.sbp.Partial) for s in dst
        ):
            partial_sources += 1
            exact += bound == plan.bytes
    if shape == (64, 32):  # all pairs: 53 of 63 on 2x4, 733 of 999 on 2x2x2
        assert exact >= 0.7 * partial_sources


@pytest.mark.parametrize("grid", [(2, 4), (2, 2, 2), (8,)])
def test_bytes_lower_bound_of_a_class_scales_as_computed_directly(grid):
    """``bytes_lower_bound`` computes a bound once per class of shapes (the dims
    that divide by the device count at the device count) and scales it: on
    random shapes, even and uneven, of 1-3 dims, and random layout pairs, the
    scaled bound is the one computed on the shape itself."""
    from sbpjax.boxing.plan import _bytes_lower_bound

    pl = sj.placement(grid, ("x", "y", "z")[: len(grid)])
    r = np.random.default_rng(len(grid))
    for _ in range(300):
        ndim = int(r.integers(1, 4))
        shape = tuple(int(r.choice([8, 16, 24, 40, 64, 3, 5, 12, 1])) for _ in range(ndim))
        layouts = [s for s in ALL_1D if not isinstance(s, sj.sbp.Split) or s.dim < ndim]
        src = tuple(layouts[i] for i in r.integers(0, len(layouts), len(grid)))
        dst = tuple(layouts[i] for i in r.integers(0, len(layouts), len(grid)))
        itemsize = int(r.choice([2, 4]))
        direct = _bytes_lower_bound(shape, itemsize, pl.shape, src, dst)
        assert bytes_lower_bound(shape, itemsize, pl, src, dst) == direct, (shape, src, dst)


def test_bytes_lower_bound_by_hand():
    pl = sj.placement((2, 4), ("x", "y"))
    T = 64 * 32 * 4
    # a reduce-scatter over all 8 devices: (G - 1)|T|; an all-reduce: 2(G - 1)|T|
    assert bytes_lower_bound((64, 32), 4, pl, (sj.P, sj.P), (sj.S(0), sj.S(1))) == 7 * T
    assert bytes_lower_bound((64, 32), 4, pl, (sj.P, sj.P), (sj.B, sj.B)) == 14 * T
    # then a gather over x: each element reaches a second device
    assert bytes_lower_bound((64, 32), 4, pl, (sj.P, sj.P), (sj.B, sj.S(0))) == 8 * T
    # (S(0), P) -> (S(1), S(0)): half the elements land on a device that holds no contribution
    assert bytes_lower_bound((64, 32), 4, pl, (sj.S(0), sj.P), (sj.S(1), sj.S(0))) == 7 * T // 2
    # a partial target is free to reach from S or B (a fill)
    assert bytes_lower_bound((64, 32), 4, pl, (sj.S(0), sj.B), (sj.P, sj.B)) == 0


def test_floor_is_known_and_exact_by_hand():
    pl = sj.placement((2, 4), ("x", "y"))
    T = 64 * 32 * 4
    # (S(0),S(1)) -> (S(1),S(0)): 4 devices already hold one of their two tiles of |T|/16
    plan = sj.plan_boxing((64, 32), np.float32, pl, (sj.S(0), sj.S(1)), (sj.S(1), sj.S(0)))
    assert plan.floor == 12 * T // 16 == plan.bytes
    # with partials there is no floor
    assert sj.plan_boxing((64, 32), np.float32, pl, (sj.P, sj.B), (sj.B, sj.B)).floor is None


def test_multi_axis_group_collectives():
    pl = sj.placement((2, 4), ("x", "y"))
    plan = sj.plan_boxing((64, 64), np.float32, pl, (sj.S(0), sj.S(0)), (sj.S(1), sj.S(1)))
    assert [(s.op, s.axes) for s in plan.steps] == [("all_to_all", ("x", "y"))]
    assert plan.bytes == 7 * 64 * 64 * 4 // 8


def test_plan_text_is_readable():
    pl = sj.placement((2, 4), ("x", "y"))
    text = str(sj.plan_boxing((1024, 1024), np.float32, pl, (sj.P, sj.S(0)), (sj.S(0), sj.S(0))))
    assert "(P, S(0)) -> (S(0), S(0))" in text
    assert "reduce_scatter" in text and "permute" in text and "total" in text
    assert "[dim 0 split y,x]" in text  # the intermediate layout names its split order
    assert "MiB" in text


@pytest.mark.parametrize("n", [64, 8192])
def test_launch_priced_plans_trade_bytes_for_collectives_only_where_it_pays(n):
    """(P, B) -> (B, B) on 4x2 (a gradient partial over the data axis x):
    by bytes alone a slice over y, a reduce-scatter over x and an all-gather
    over all 8 devices (10 |T|), or one all-reduce over x (12 |T|). Priced
    with 100 kB per launch (``launch_priced``, as sj.jit plans where y is
    idle: sbpjax.compiler.propagator.Propagator.plan) the all-reduce
    wins below 50 kB; above, the extra 2 |T| outweigh the launch saved."""
    pl = sj.placement((4, 2), ("x", "y"))
    shape, T = (n, 4), n * 4 * 4
    by_bytes = sj.plan_boxing(shape, np.float32, pl, (sj.P, sj.B), (sj.B, sj.B))
    priced = sj.plan_boxing(shape, np.float32, pl, (sj.P, sj.B), (sj.B, sj.B), launch_priced=True)
    assert [s.op for s in by_bytes.steps if s.bytes] == ["reduce_scatter", "all_gather"]
    assert by_bytes.bytes == 10 * T
    alpha, beta = sj.CostModel().group(("x",))
    launch = alpha / beta  # 100 kB on the default model
    if 2 * T < launch:
        assert [(s.op, s.axes) for s in priced.steps] == [("all_reduce", ("x",))]
        assert priced.bytes == 12 * T
    else:
        assert priced.steps == by_bytes.steps
    # a plan of one collective is final either way (only fewer could cost less)
    one = sj.plan_boxing(shape, np.float32, pl, (sj.P, sj.P), (sj.B, sj.B), launch_priced=True)
    assert (
        one is not by_bytes
        and one.steps == sj.plan_boxing(shape, np.float32, pl, (sj.P, sj.P), (sj.B, sj.B)).steps
    )


@pytest.mark.parametrize("rows", [64, 256, 512, 2048])
def test_ring_priced_plans_take_the_all_reduce_where_the_cost_model_times_it_faster(rows):
    """The same (P, B) -> (B, B) on 4x2 priced with each collective's ring
    latency (``launch_priced="ring"``, sj.jit's second solve): the one
    all-reduce over x is taken exactly where ``CostModel.collective_time``
    (2 (p-1) alpha + ... for an all-reduce, (p-1) alpha + ... for the others)
    times it faster than the slice, reduce-scatter and all-gather, at
    1.6 MB per device on the default model."""
    pl = sj.placement((4, 2), ("x", "y"))
    cm = sj.CostModel()
    shape = (rows, 1024)
    n = rows * 1024 * 4  # bytes of the tensor, each device's partial
    ring = sj.plan_boxing(shape, np.float32, pl, (sj.P, sj.B), (sj.B, sj.B), launch_priced="ring")
    all_reduce = cm.collective_time("all_reduce", ("x",), 4, n)
    # the slice halves each partial; the all-gather over 8 devices gathers n / 8 blocks
    three = cm.collective_time("reduce_scatter", ("x",), 4, n / 2) + cm.collective_time(
        "all_gather", ("x", "y"), 8, n
    )
    ops = [(s.op, s.axes) for s in ring.steps if s.bytes]
    if all_reduce < three:
        assert ops == [("all_reduce", ("x",))]
    else:
        assert [op for op, _ in ops] == ["reduce_scatter", "all_gather"]
    assert (rows <= 256) == (all_reduce < three)  # both sides of the crossing are tried


def test_plans_are_deterministic_and_cached():
    pl = sj.placement((2, 4), ("x", "y"))
    a = sj.plan_boxing((64, 64), np.float32, pl, (sj.P, sj.P), (sj.B, sj.S(1)))
    b = sj.plan_boxing((64, 64), "float32", pl, "P, P", "B, S(1)")
    assert a is b
    assert [str(s) for s in a.steps] == [str(s) for s in b.steps]


def test_time_tie_break_prefers_fast_axes():
    pl = sj.placement((2, 4), ("node", "gpu"))
    slow_node = sj.CostModel(alpha={"node": 1e-4, "gpu": 1e-6}, beta={"node": 1e-9, "gpu": 1e-11})
    plan = sj.plan_boxing((1024, 1024), np.float32, pl, (sj.P, sj.P), (sj.B, sj.B), cost_model=slow_node)
    # equal bytes either way; the model keeps the big messages on the fast axis
    big_on_node = [s for s in plan.steps if s.axes == ("node",)]
    assert all(s.bytes <= min(t.bytes for t in plan.steps if t.axes == ("gpu",)) for s in big_on_node)
    assert plan.time(slow_node) > 0 and plan.time() > 0


def test_plan_errors():
    pl = sj.placement((2, 4), ("x", "y"))
    with pytest.raises(sj.SBPError, match="src_sbp"):
        sj.plan_boxing((4, 4), np.float32, pl, (sj.S(0),), (sj.B, sj.B))
    with pytest.raises(sj.SBPError, match="splits dim 3"):
        sj.plan_boxing((4, 4), np.float32, pl, (sj.B, sj.B), (sj.S(3), sj.B))


def _layout_pairs(grid, ndim, n, seed):
    from sbpjax.boxing.plan import normalized_layout

    atoms = [sj.S(d) for d in range(ndim)] + [sj.B, sj.P, sj.P_max]
    nds = list(itertools.product(atoms, repeat=len(grid)))
    pairs = [(a, b) for a in nds for b in nds if a != b]
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(pairs), size=min(n, len(pairs)), replace=False):
        a, b = pairs[i]
        yield normalized_layout(a, ndim, grid), normalized_layout(b, ndim, grid)


@pytest.mark.parametrize("grid,shape", [((2, 2, 2), (16, 32)), ((2, 4), (8, 16, 32)), ((2, 2, 2), (6, 4))])
def test_one_search_per_source_finds_the_targeted_searchs_paths(grid, shape):
    """Oracle: the path read from a source's search tree (``_search_from``,
    what sj.jit's layout choice asks for thousands of pairs of a class)
    moves the bytes of the search for that one target and is no worse by
    the search's own order (bytes, then time, then steps), and is a path
    from src to dst. It may be better: the targeted search's heap orders
    exact float sums of time, so between times equal within ``_less``'
    tolerance it can stop at a path of more steps (1 pair in a few
    thousand)."""
    from sbpjax.boxing import search as P
    from sbpjax.boxing.cost import DEFAULT_COST_MODEL

    pl = sj.placement(grid, ("x", "y", "z")[: len(grid)])
    trees, contexts = {}, {}
    for src, dst in _layout_pairs(grid, len(shape), 400, seed=sum(shape)):
        fill = tuple(sorted({op for _, op in dst.partial}))
        ctx = contexts.setdefault(fill, P._Ctx(shape, 4, pl, DEFAULT_COST_MODEL, fill))
        want = P._search(ctx, src, dst)
        tree = trees.get((fill, src)) or trees.setdefault((fill, src), P._tree(ctx, src))
        got = P._search_from(ctx, tree, src, dst)

        def cost(path):
            return (sum(s.bytes for s in path), sum(s.tie_time for s in path), len(path))

        assert cost(got)[0] == cost(want)[0], (src, dst, want, got)
        assert not P._less(cost(want), cost(got)), (src, dst, want, got)
        assert [s.src for s in got[:1]] in ([src], []) and [s.dst for s in got[-1:]] in ([dst], [])
        assert all(a.dst == b.src for a, b in zip(got, got[1:]))
