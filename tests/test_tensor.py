import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import reference_assemble, reference_local

import sbpjax as sj

ALL_1D = [sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max, sj.P_min]


@pytest.mark.parametrize("sbp", ALL_1D, ids=str)
@pytest.mark.parametrize("p", [2, 3, 8])
@pytest.mark.parametrize("shape", [(8, 6), (7, 5), (2, 3)])
def test_to_global_local_tensors_follow_semantics(sbp, p, shape):
    pl = sj.placement(p, "x")
    x = np.random.default_rng(1).integers(-9, 9, size=shape).astype(np.float32)
    t = sj.to_global(x, pl, sbp)
    assert t.sbp == (sbp,) and t.shape == shape and t.dtype == np.float32 and t.ndim == 2
    assert t.placement == pl
    locs = t.local_tensors()
    assert locs.shape == (p,)
    for i in range(p):
        want = reference_local(x, (p,), (sbp,), (i,))
        if want is not None:
            np.testing.assert_array_equal(locs[i], want)
        elif sbp == sj.P:  # B -> P(sum): value on the first device, zeros elsewhere
            np.testing.assert_array_equal(locs[i], x if i == 0 else np.zeros_like(x))
        else:  # B -> P(max|min): the value everywhere
            np.testing.assert_array_equal(locs[i], x)
    np.testing.assert_array_equal(reference_assemble(locs, (sbp,)), x)
    np.testing.assert_array_equal(t.numpy(), x)
    np.testing.assert_array_equal(np.asarray(t), x)


def test_balanced_split_sizes():
    t = sj.to_global(np.arange(10.0), sj.placement(4, "x"), sj.S(0))
    assert [len(v) for v in t.local_tensors()] == [3, 3, 2, 2]
    t2 = sj.to_global(np.arange(10.0), sj.placement((2, 4), ("x", "y")), (sj.S(0), sj.S(0)))
    # 10 -> 5, 5; each 5 -> 2, 1, 1, 1 (axis 0 first, then each piece)
    assert [len(v) for v in t2.local_tensors().flat] == [2, 1, 1, 1, 2, 1, 1, 1]
    assert t2.local_tensors()[1, 0].tolist() == [5.0, 6.0]


def test_oneflow_figure_4():
    """The 2x2 tensor [[1,2],[3,4]] on two devices under S(0), S(1), B and P(sum)."""
    pl = sj.placement(2, "d")
    x = np.array([[1, 2], [3, 4]], np.float32)
    s0, s1, b = (sj.to_global(x, pl, s).local_tensors() for s in (sj.S(0), sj.S(1), sj.B))
    assert s0[0].tolist() == [[1, 2]] and s0[1].tolist() == [[3, 4]]
    assert s1[0].tolist() == [[1], [3]] and s1[1].tolist() == [[2], [4]]
    assert b[0].tolist() == b[1].tolist() == [[1, 2], [3, 4]]
    # the paper's partial-sum example: these two local tensors sum to x
    p = sj.from_local_tensors(
        [np.array([[1, 1], [1, 0]], np.float32), np.array([[0, 1], [2, 4]], np.float32)], pl, sj.P, (2, 2)
    )
    np.testing.assert_array_equal(p.numpy(), x)
    assert p.local_tensors()[1].tolist() == [[0, 1], [2, 4]]
    # and boxing it to each of the other layouts gives the figure's columns
    assert p.to_global(sbp=sj.S(0)).local_tensors()[1].tolist() == [[3, 4]]
    assert p.to_global(sbp=sj.S(1)).local_tensors()[0].tolist() == [[1], [3]]
    assert p.to_global(sbp=sj.B).local_tensors()[1].tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    "sbp", list(itertools.product([sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max], repeat=2)), ids=str
)
def test_from_local_tensors_round_trip_2d(sbp, pl24):
    x = np.random.default_rng(2).integers(-9, 9, size=(5, 9)).astype(np.int32)
    t = sj.to_global(x, pl24, sbp)
    u = sj.from_local_tensors(t.local_tensors(), pl24, sbp, x.shape)
    np.testing.assert_array_equal(u.numpy(), x)
    for a, b in zip(t.local_tensors().flat, u.local_tensors().flat):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(reference_assemble(u.local_tensors(), sbp), x)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_dtypes(dtype, pl24):
    x = np.arange(-20, 20).reshape(5, 8).astype(dtype)
    for sbp in [(sj.S(0), sj.S(1)), (sj.P, sj.B), (sj.P_max, sj.S(0)), (sj.P_min, sj.P_min)]:
        t = sj.to_global(x, pl24, sbp)
        assert t.dtype == np.dtype(dtype)
        got = t.to_global(sbp=(sj.B, sj.S(1))).numpy()
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.astype(np.float32), x.astype(np.float32))


def test_zero_size_dims(pl24):
    x = np.zeros((0, 6), np.float32)
    for sbp in [(sj.S(0), sj.S(1)), (sj.P, sj.S(0)), (sj.B, sj.P_max)]:
        t = sj.to_global(x, pl24, sbp)
        assert t.numpy().shape == (0, 6)
        assert t.to_global(sbp=(sj.S(1), sj.B)).numpy().shape == (0, 6)


def test_scalar(pl8):
    t = sj.to_global(np.float32(3.0), pl8, sj.P)
    assert t.shape == () and float(t.numpy()) == 3.0
    assert float(t.to_global(sbp=sj.B).to_jax()) == 3.0


def test_to_jax_is_the_same_buffers(pl24):
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    t = sj.to_global(x, pl24, (sj.S(0), sj.S(1)))
    a = t.to_jax()
    assert isinstance(a, jax.Array)
    assert a.sharding.spec == jax.sharding.PartitionSpec("x", "y")
    ptrs = {s.device.id: s.data.unsafe_buffer_pointer() for s in t.physical.addressable_shards}
    assert all(ptrs[s.device.id] == s.data.unsafe_buffer_pointer() for s in a.addressable_shards)
    # and back: a jax.Array with the equivalent NamedSharding is taken as it is
    u = sj.to_global(a, pl24, (sj.S(0), sj.S(1)))
    assert all(ptrs[s.device.id] == s.data.unsafe_buffer_pointer() for s in u.physical.addressable_shards)
    np.testing.assert_array_equal(np.asarray(a), x)


def test_uneven_to_jax_is_exact(pl24):
    x = np.arange(35.0, dtype=np.float32).reshape(5, 7)
    a = sj.to_global(x, pl24, (sj.S(1), sj.S(0))).to_jax()
    np.testing.assert_array_equal(np.asarray(a), x)


def test_partial_is_never_handed_out_as_a_plain_array(pl24):
    t = sj.to_global(np.ones((4, 4), np.float32), pl24, (sj.P, sj.S(0)))
    with pytest.raises(sj.SBPError, match=r"partial over x: P\(sum\).*to_global\(sbp=\(B, S\(0\)\)\)"):
        t.to_jax()
    with pytest.raises(sj.SBPError):
        jnp.asarray(t)


@pytest.mark.parametrize("sbp", [(sj.S(0), sj.B), (sj.B, sj.S(1)), (sj.S(0), sj.S(1))], ids=str)
def test_tree_map_of_an_elementwise_function_is_exact_on_split_and_whole_layouts(pl24, sbp):
    """A global tensor's pytree leaf is its physical array: an elementwise
    function mapped over it (uneven shape: padded pieces) gives the logical
    result on S and B layouts; jax.jit passes it through alike."""
    x = np.arange(13 * 6, dtype=np.float32).reshape(13, 6) / 7
    t = sj.to_global(x, pl24, sbp)
    for got in (
        jax.tree.map(lambda a: jnp.tanh(a) + 1, t),
        jax.jit(lambda g: jax.tree.map(lambda a: a * 3, g))(t),
    ):
        assert isinstance(got, sj.GlobalTensor) and got.sbp == t.sbp
    want = np.tanh(x) + 1
    got = jax.tree.map(lambda a: jnp.tanh(a) + 1, t).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("sbp", [(sj.P, sj.B), (sj.S(0), sj.B), (sj.P_max, sj.S(0))], ids=str)
def test_tree_map_that_changes_the_physical_shape_is_an_sbp_error(pl24, sbp):
    """A function that changes the shape (a sum, a reshape) mapped over a
    global tensor's leaf made a tensor its layout could not describe, which
    failed later with a raw IndexError; it is refused where it is made."""
    t = sj.to_global(np.ones((13, 6), np.float32), pl24, sbp)
    with pytest.raises(sj.SBPError, match=r"GlobalTensor \(13, 6\).*returned shape \(\).*t.to_jax\(\)"):
        jax.tree.map(jnp.sum, t)
    assert t.numpy().shape == (13, 6)  # the tensor itself untouched


def test_same_layout_returns_itself(pl24):
    t = sj.to_global(np.ones((4, 4), np.float32), pl24, (sj.S(0), sj.B))
    assert t.to_global(sbp=(sj.S(0), sj.B)) is t
    assert t.to_global() is t
    # S over an axis of size 1 is B: relabelled, same buffers
    pl = sj.placement((1, 8), ("a", "b"))
    u = sj.to_global(np.ones((8, 8), np.float32), pl, (sj.S(1), sj.S(0)))
    v = u.to_global(sbp=(sj.B, sj.S(0)))
    assert v.sbp == (sj.B, sj.S(0)) and v.physical is u.physical


def test_pytree_and_jit(pl24):
    x = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    t = sj.to_global(x, pl24, (sj.S(0), sj.P))
    leaves, tree = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 1
    u = jax.tree_util.tree_unflatten(tree, leaves)
    np.testing.assert_array_equal(u.numpy(), x)
    doubled = jax.jit(lambda g: jax.tree.map(lambda a: 2 * a, g))(t)
    assert isinstance(doubled, sj.GlobalTensor) and doubled.sbp == t.sbp
    np.testing.assert_array_equal(doubled.numpy(), 2 * x)
    boxed = jax.jit(lambda g: g.to_global(sbp=(sj.B, sj.B)).to_jax())(t)
    np.testing.assert_array_equal(np.asarray(boxed), x)


def test_from_local_tensors_errors(pl8, pl24):
    x = np.zeros((10, 4), np.float32)
    locs = sj.to_global(x, pl8, sj.S(0)).local_tensors()
    with pytest.raises(
        sj.SBPError,
        match=r"grid position \(2,\) holds a local tensor of shape \(1, 4\), but logical "
        r"shape \(11, 4\).*gives it shape \(2, 4\).*dim 0 split 8 ways",
    ):
        sj.from_local_tensors(locs, pl8, sj.S(0), (11, 4))
    with pytest.raises(sj.SBPError, match="one local tensor per device"):
        sj.from_local_tensors([np.zeros(2)] * 3, pl8, sj.B, (2,))
    bad = [np.full((2,), float(i)) for i in range(8)]
    with pytest.raises(sj.SBPError, match="must hold equal local tensors"):
        sj.from_local_tensors(bad, pl8, sj.B, (2,))
    with pytest.raises(sj.SBPError, match="placement has 2 axes"):
        sj.to_global(x, pl24, sj.S(0))
    with pytest.raises(sj.SBPError, match="splits dim 2"):
        sj.to_global(x, pl8, sj.S(2))
    with pytest.raises(sj.SBPError, match="must be an sj.Placement"):
        sj.to_global(x, "x", sj.S(0))


def test_bad_input_to_the_eager_api_is_an_sbp_error(pl8, pl24):
    """Found by a held-out sweep: each was a raw AttributeError / TypeError, or
    (extra local tensors) accepted with the extras silently dropped."""
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = sj.to_global(x, pl24, (sj.S(0), sj.S(1)))
    for bad in ("xy", pl24.mesh):
        with pytest.raises(sj.SBPError, match=r"to_global: placement must be an sj.Placement"):
            t.to_global(sbp=(sj.B, sj.B), placement=bad)
    assert t.sbp == (sj.S(0), sj.S(1))  # untouched by the refusals
    np.testing.assert_array_equal(t.numpy(), x)
    with pytest.raises(sj.SBPError, match=r"from_local_tensors: placement must be an sj.Placement"):
        sj.from_local_tensors([x] * 8, "d", sj.B, x.shape)
    for shape in (4, None):
        with pytest.raises(sj.SBPError, match=r"shape must be the logical shape as a tuple of ints"):
            sj.from_local_tensors([x] * 8, pl8, sj.B, shape)
    with pytest.raises(sj.SBPError, match=r"plan_boxing: placement must be an sj.Placement"):
        sj.plan_boxing(x.shape, x.dtype, "pl", (sj.S(0), sj.B), (sj.B, sj.B))
    with pytest.raises(sj.SBPError, match=r"dtype <U1 is not one a JAX array holds.*np.asarray"):
        sj.to_global(np.array(["a", "b"]), pl8, sj.B)
    # one local tensor per device: 9 on 8 devices, or a 3x5 grid on 2x4, are refused
    pieces = [np.full((2,), i, np.float32) for i in range(9)]
    with pytest.raises(
        sj.SBPError, match=r"the list has 9 local tensors where the placement's axis 'x' has 8"
    ):
        sj.from_local_tensors(pieces, pl8, sj.P, (2,))
    rows = [[np.zeros(2, np.float32)] * 5] * 3
    with pytest.raises(
        sj.SBPError, match=r"the list has 3 local tensors where the placement's axis 'x' has 2"
    ):
        sj.from_local_tensors(rows, pl24, (sj.P, sj.P), (2,))
    rows = [[np.zeros(2, np.float32)] * 5] * 2
    with pytest.raises(
        sj.SBPError, match=r"the list\[0\] has 5 local tensors where the placement's axis 'y' has 4"
    ):
        sj.from_local_tensors(rows, pl24, (sj.P, sj.P), (2,))
    grid = np.empty((3, 5), object)
    with pytest.raises(sj.SBPError, match=r"grid of shape \(3, 5\).*placement has shape \(2, 4\)"):
        sj.from_local_tensors(grid, pl24, (sj.P, sj.P), (2,))


def test_process_local_in_one_process_is_the_whole_array(pl24):
    """With one process, this process's part is the whole array (the
    multi-process behaviour is tested in tests/test_multihost.py)."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    t = sj.to_global(x, pl24, (sj.S(0), sj.B), process_local=True)
    assert t.shape == (8, 8) and t.sbp == (sj.S(0), sj.B)
    np.testing.assert_array_equal(t.numpy(), x)
    with pytest.raises(sj.SBPError, match="partial"):
        sj.to_global(x, pl24, (sj.P, sj.B), process_local=True)
    with pytest.raises(sj.SBPError, match="process_local=True"):
        sj.to_global(x[:5], pl24, (sj.S(0), sj.S(1)), process_local=True)  # 5 rows over 2
