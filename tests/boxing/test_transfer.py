"""Boxing between disjoint placements: values, bytes moved, Table 2 'disjoint'."""

import itertools

import jax
import numpy as np
import pytest

import sbpjax as sj
from sbpjax.boxing.transfer import execute_transfer

SBP = [sj.S(0), sj.S(1), sj.B, sj.P]


@pytest.fixture(scope="module")
def stages():
    d = jax.devices()
    return sj.Placement(np.array(d[:4]).reshape(2, 2), ("a", "b")), sj.Placement(np.array(d[4:7]), ("c",))


@pytest.mark.parametrize("src", list(itertools.product(SBP, repeat=2)), ids=str)
@pytest.mark.parametrize("shape", [(12, 6), (9, 5)], ids=["even", "uneven"])
def test_every_pair_across_disjoint_placements(src, shape, stages):
    pa, pb = stages
    x = np.random.default_rng(0).integers(-9, 9, size=shape).astype(np.float32)
    t = sj.to_global(x, pa, src)
    for dst in SBP + [sj.P_max]:
        plan = sj.plan_boxing(shape, x.dtype, pa, src, (dst,), dst_placement=pb)
        _, moved = execute_transfer(plan, t.physical)
        [move] = [s for s in plan.steps if s.op == "transfer"]
        assert moved == move.bytes  # what crossed is what the plan says
        u = t.to_global(sbp=dst, placement=pb)
        assert u.placement == pb and u.sbp == (dst,)
        np.testing.assert_array_equal(u.numpy(), x)


@pytest.mark.parametrize("p1, p2", [(2, 4), (4, 2), (3, 3), (4, 4)])
def test_table_2_disjoint_column(p1, p2):
    d = jax.devices()
    pa, pb = sj.placement(p1, "a"), sj.placement(p2, "b", devices=d[p1:])
    shape = (48, 24)
    T = 48 * 24 * 4
    expect = {  # OneFlow Table 2, disjoint column
        ("S0", "S0"): T, ("S0", "S1"): T, ("S0", "B"): p2 * T, ("S0", "P"): T,
        ("B", "S0"): T, ("B", "B"): p2 * T, ("B", "P"): T,
        ("P", "S0"): p1 * T, ("P", "B"): (p1 + p2 - 1) * T, ("P", "P"): p1 * T,
    }
    name = {"S0": sj.S(0), "S1": sj.S(1), "B": sj.B, "P": sj.P}
    for (a, b), want in expect.items():
        plan = sj.plan_boxing(shape, np.float32, pa, name[a], name[b], dst_placement=pb)
        assert plan.bytes <= want, (a, b, str(plan))
        assert plan.bytes == want, (a, b, str(plan))


def test_transfer_cannot_be_traced(stages):
    pa, pb = stages
    t = sj.to_global(np.ones((4, 4), np.float32), pa, (sj.S(0), sj.B))
    with pytest.raises(sj.SBPError, match="runs eagerly"):
        jax.jit(lambda g: g.to_global(sbp=sj.B, placement=pb).physical)(t)
