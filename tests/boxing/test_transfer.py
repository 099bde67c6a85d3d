"""Boxing between disjoint placements: values, bytes moved, Table 2 'disjoint'."""

import itertools

import jax
import numpy as np
import pytest

import sbpjax as sj
from sbpjax.boxing import transfer
from sbpjax.boxing.transfer import execute_transfer
from sbpjax.layout import Geometry

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
        ("S0", "S0"): T,
        ("S0", "S1"): T,
        ("S0", "B"): p2 * T,
        ("S0", "P"): T,
        ("B", "S0"): T,
        ("B", "B"): p2 * T,
        ("B", "P"): T,
        ("P", "S0"): p1 * T,
        ("P", "B"): (p1 + p2 - 1) * T,
        ("P", "P"): p1 * T,
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


@pytest.mark.parametrize(
    "sbp", [(sj.S(0), sj.S(1)), (sj.S(1), sj.B), (sj.B, sj.B), (sj.S(0), sj.S(0))], ids=str
)
def test_same_grid_same_layout_is_one_device_put(sbp, monkeypatch):
    # 2x2 -> 2x2 on other devices, an even S/B layout kept: the fast path; its
    # values and bytes must be those of the general per-piece move
    d = jax.devices()
    pa = sj.Placement(np.array(d[:4]).reshape(2, 2), ("a", "b"))
    pb = sj.Placement(np.array([d[7], d[5], d[6], d[4]]).reshape(2, 2), ("c", "d"))  # another device order
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    t = sj.to_global(x, pa, sbp)
    plan = sj.plan_boxing(x.shape, x.dtype, pa, sbp, sbp, dst_placement=pb)
    assert transfer._block_for_block(plan, Geometry(x.shape, pa.shape))
    fast, fast_bytes = execute_transfer(plan, t.physical)
    monkeypatch.setattr(transfer, "_block_for_block", lambda *a: False)
    slow, slow_bytes = execute_transfer(plan, t.physical)
    [move] = [s for s in plan.steps if s.op == "transfer"]
    assert fast_bytes == slow_bytes == move.bytes == plan.bytes
    assert fast.sharding == slow.sharding
    by_device = {s.device: np.asarray(s.data) for s in slow.addressable_shards}
    for s in fast.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), by_device[s.device])
    u = sj.GlobalTensor(fast, x.shape, x.dtype, pb, sbp)
    np.testing.assert_array_equal(u.numpy(), x)
    np.testing.assert_array_equal(t.to_global(placement=pb).numpy(), x)  # the public route
    for c in np.ndindex(2, 2):  # each target device holds the block of the source device at its grid position
        np.testing.assert_array_equal(u.local_tensors()[c], t.local_tensors()[c])


def test_uneven_changed_or_partial_layouts_take_the_general_path(stages):
    d = jax.devices()
    pa, pb = sj.placement(2, "a"), sj.Placement(np.array(d[4:6]), ("b",))
    plans = [
        sj.plan_boxing((9, 4), np.float32, pa, sj.S(0), sj.S(0), dst_placement=pb),  # uneven
        sj.plan_boxing((8, 4), np.float32, pa, sj.S(0), sj.S(1), dst_placement=pb),  # changed
        sj.plan_boxing((8, 4), np.float32, pa, sj.P, sj.P, dst_placement=pb),
    ]  # partial
    plans.append(
        sj.plan_boxing(
            (8, 4),
            np.float32,
            stages[0],
            (sj.B, sj.B),
            sj.B,  # 2x2 -> 3
            dst_placement=stages[1],
        )
    )
    for plan in plans:
        assert not transfer._block_for_block(plan, Geometry(plan.shape, plan.placement.shape))
