"""Every boxing pair: exact values and local tensors, measured bytes == plan."""

import itertools

import numpy as np
import pytest
from helpers import check_boxing

import sbpjax as sj

ALL_1D = [sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max, sj.P_min]
SBP_2D = [sj.S(0), sj.S(1), sj.B, sj.P]
PAIRS_1D = list(itertools.product(ALL_1D, ALL_1D))


def _data(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).integers(-40, 40, size=shape).astype(dtype)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(24, 16), (7, 5)], ids=["even", "uneven"])
@pytest.mark.parametrize("src, dst", PAIRS_1D, ids=[f"{a}->{b}" for a, b in PAIRS_1D])
def test_every_1d_pair(p, shape, src, dst):
    check_boxing(sj.placement(p, "x"), _data(shape), (src,), (dst,))


PAIRS_2D = list(itertools.product(itertools.product(SBP_2D, repeat=2), repeat=2))
IDS_2D = [f"{sj.format_sbp(a)}->{sj.format_sbp(b)}" for a, b in PAIRS_2D]


@pytest.mark.parametrize("src, dst", PAIRS_2D, ids=IDS_2D)
def test_every_2d_pair_2x4(src, dst, pl24):
    check_boxing(pl24, _data((16, 8)), src, dst)


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", PAIRS_2D, ids=IDS_2D)
def test_every_2d_pair_2x4_uneven(src, dst, pl24):
    check_boxing(pl24, _data((13, 6)), src, dst)


@pytest.mark.parametrize("shape", [(8, 4), (5, 3)], ids=["even", "uneven"])
@pytest.mark.parametrize("src, dst", PAIRS_2D, ids=IDS_2D)
def test_every_2d_pair_2x2(src, dst, shape):
    check_boxing(sj.placement((2, 2), ("x", "y")), _data(shape), src, dst)


def _sample_3d(n=120, seed=0):
    rng = np.random.default_rng(seed)
    layouts = list(itertools.product(SBP_2D + [sj.P_max], repeat=3))
    picks = rng.choice(len(layouts), size=(n, 2))
    return [(layouts[i], layouts[j]) for i, j in picks]


SAMPLE_3D = _sample_3d()


@pytest.mark.parametrize(
    "src, dst", SAMPLE_3D, ids=[f"{sj.format_sbp(a)}->{sj.format_sbp(b)}" for a, b in SAMPLE_3D]
)
def test_sample_3d_pairs(src, dst):
    pl = sj.placement((2, 2, 2), ("x", "y", "z"))
    shape = (8, 4) if hash((src, dst)) % 2 else (9, 6)
    check_boxing(pl, _data(shape), src, dst)


@pytest.mark.parametrize("dtype", [np.int32, "bfloat16"])
@pytest.mark.parametrize(
    "src, dst",
    [
        ((sj.P_max, sj.S(0)), (sj.B, sj.B)),
        ((sj.P, sj.P), (sj.S(1), sj.S(0))),
        ((sj.S(0), sj.S(1)), (sj.P_min, sj.S(0))),
    ],
    ids=str,
)
def test_other_dtypes(dtype, src, dst, pl24):
    import jax.numpy as jnp

    dt = jnp.bfloat16 if dtype == "bfloat16" else dtype
    check_boxing(pl24, _data((12, 8), dtype=dt), src, dst)


def test_conflicting_nested_splits_are_at_the_floor(pl24):
    x = _data((16, 8))
    for src, dst in [
        ((sj.S(0), sj.S(0)), (sj.B, sj.S(0))),
        ((sj.S(0), sj.S(1)), (sj.S(1), sj.S(0))),
        ((sj.S(0), sj.S(0)), (sj.S(1), sj.S(1))),
        ((sj.B, sj.S(0)), (sj.S(0), sj.S(0))),
    ]:
        plan = check_boxing(pl24, x, src, dst)
        assert plan.bytes == plan.floor, str(plan)


@pytest.mark.parametrize("shape", [(16, 8), (13, 6)], ids=["even", "uneven"])
@pytest.mark.parametrize("src, dst", PAIRS_2D, ids=IDS_2D)
def test_a_zero_tensor_is_made_afresh_in_any_layout(src, dst, shape, pl24):
    """plan_zeros: the target blocks of an all-zero tensor, made on each device,
    have the target layout's physical shape, hold zeros and move no byte (a
    pair whose ordinary plan is already free keeps that plan)."""
    from sbpjax.boxing.lower import boxing_fn
    from sbpjax.boxing.plan import plan_zeros

    zeros = np.zeros(shape, np.float32)
    plan = plan_zeros(shape, np.float32, pl24, src, dst)
    assert plan.bytes == 0
    want = sj.to_global(zeros, pl24, dst).physical
    if sj.plan_boxing(shape, np.float32, pl24, src, dst).bytes == 0:
        assert plan == sj.plan_boxing(shape, np.float32, pl24, src, dst)  # already free: kept
        return
    assert [s.op for s in plan.steps] == ["zeros"]
    f = boxing_fn(plan)
    x = sj.to_global(zeros, pl24, src).physical
    y = f(x)
    assert y.shape == want.shape and y.sharding.is_equivalent_to(want.sharding, y.ndim)
    np.testing.assert_array_equal(np.asarray(y), 0)
    assert sj.collectives(f.lower(x).compile()) == []


def test_a_zero_tensor_is_planned_as_any_other_into_a_partial_max(pl24):
    from sbpjax.boxing.plan import plan_zeros

    plan = plan_zeros((16, 8), np.float32, pl24, (sj.S(0), sj.S(1)), (sj.P_max, sj.B))
    assert plan == sj.plan_boxing((16, 8), np.float32, pl24, (sj.S(0), sj.S(1)), (sj.P_max, sj.B))
