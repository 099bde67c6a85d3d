import jax
import numpy as np
import pytest

import sbpjax as sj


def test_placement_first_devices_in_order():
    pl = sj.placement((2, 4), ("x", "y"))
    assert pl.shape == (2, 4) and pl.axis_names == ("x", "y") and pl.size == 8
    assert [d.id for d in pl.devices.flat] == [d.id for d in jax.devices()[:8]]
    assert pl.mesh.shape == {"x": 2, "y": 4}
    assert sj.placement(8, "x").shape == (8,)


def test_any_order_is_kept():
    devs = np.array(jax.devices()[:8])[[7, 2, 5, 0, 1, 6, 3, 4]].reshape(2, 4)
    pl = sj.Placement(devs, ("a", "b"))
    assert [d.id for d in pl.devices.flat] == [7, 2, 5, 0, 1, 6, 3, 4]
    x = np.arange(8.0)
    t = sj.to_global(x, sj.Placement(devs.reshape(8), ("a",)), sj.S(0))
    # piece i lives on the i-th device of the grid, whatever its id
    by_dev = {s.device.id: np.asarray(s.data) for s in t.physical.addressable_shards}
    for i, dev in enumerate(devs.reshape(8)):
        assert by_dev[dev.id].tolist() == [x[i]]


def test_sub_placements():
    pl = sj.placement((2, 4), ("x", "y"))
    row = pl[1]
    assert row.shape == (4,) and row.axis_names == ("y",) and row.device_ids == (4, 5, 6, 7)
    block = pl[:, 2:]
    assert block.shape == (2, 2) and block.device_ids == (2, 3, 6, 7)
    assert pl[0].is_disjoint(pl[1]) and not pl.is_disjoint(row)
    sub = pl.subset(jax.devices()[:3], ("s",))
    assert sub.shape == (3,) and sub.device_ids == (0, 1, 2)
    assert pl == sj.placement((2, 4), ("x", "y")) and hash(pl) == hash(sj.placement((2, 4), ("x", "y")))


def test_placement_errors():
    d = jax.devices()
    with pytest.raises(sj.SBPError, match=r"device 1 appears twice"):
        sj.Placement(np.array([d[0], d[1], d[1], d[2]]), ("x",))
    with pytest.raises(sj.SBPError, match="needs 2 axis names"):
        sj.Placement(np.array(d[:4]).reshape(2, 2), ("x",))
    with pytest.raises(sj.SBPError, match="needs 16 devices but only 8"):
        sj.placement((4, 4), ("x", "y"))
    with pytest.raises(sj.SBPError, match="distinct"):
        sj.placement((2, 2), ("x", "x"))
    with pytest.raises(sj.SBPError, match="not in this placement"):
        sj.placement(2, "x").subset([d[5]])
    pl = sj.placement((2, 4), ("x", "y"))
    with pytest.raises(sj.SBPError, match=r"placement\[5\]: .*grid has shape \(2, 4\)"):
        pl[5]
    with pytest.raises(sj.SBPError, match=r"placement\['x'\]: .*integers and slices"):
        pl["x"]
    with pytest.raises(sj.SBPError, match=r"shape \(4, 2\) holds 8 devices, and 6 were given"):
        pl.subset(d[:6], shape=(4, 2))
    with pytest.raises(sj.SBPError, match=r"device 9 is not in this placement"):
        pl.subset([0, 9])


def test_subset_takes_device_ids():
    pl = sj.placement((2, 4), ("x", "y"))
    assert (
        pl.subset([6, 1]).device_ids == (6, 1) == pl.subset([jax.devices()[6], jax.devices()[1]]).device_ids
    )
