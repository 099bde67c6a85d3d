"""sbpjax.checkpoint: save global tensors, restore them bit-exact into other layouts.

Values are checked against the numpy array they were made from, and local
tensors against ``reference_local`` (nested np.array_split, apart from sbpjax).
"""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import reference_assemble, reference_local
from jax.sharding import NamedSharding, PartitionSpec

import sbpjax as sj
from sbpjax import checkpoint
from sbpjax.sbp import Partial

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # orbax's notices

RNG = np.random.default_rng(0)

# name -> logical value: even and uneven (over 2, 4 and 8 pieces), bf16, int32
LEAVES = {
    "even_f32": RNG.standard_normal((8, 16)).astype(np.float32),
    "uneven_f32": RNG.standard_normal((7, 10)).astype(np.float32),
    "bf16": RNG.standard_normal((6, 12)).astype(jnp.bfloat16),
    "int32": RNG.integers(-(2**31), 2**31 - 1, size=(9, 5), dtype=np.int32),
}


def _saved_from_s0_b(tmp_path):
    """Every leaf saved from (S(0), B) on 2x4, with a Python int and an int32 count."""
    pl = sj.placement((2, 4), ("x", "y"))
    tree = {
        "params": {k: sj.to_global(v, pl, (sj.S(0), sj.B)) for k, v in LEAVES.items()},
        "step": 12,
        "count": jnp.int32(12),
    }
    path = tmp_path / "ckpt"
    checkpoint.save(path, tree)
    return path


def _placement(kind):
    devs = jax.devices()
    if kind == "2x4":
        return sj.placement((2, 4), ("x", "y"))
    if kind == "1d8":
        return sj.placement(8, "x")
    if kind == "sub4":  # the second row of 2x4: devices that saved other pieces
        return sj.placement((2, 4), ("x", "y"))[1]
    # a 2x4 grid in an order of the user's own
    return sj.Placement(
        np.array([devs[i] for i in [5, 2, 7, 0, 3, 6, 1, 4]], dtype=object).reshape(2, 4), ("a", "b")
    )


TARGETS = [  # (placement, nd-SBP)
    ("2x4", (sj.B, sj.S(1))),
    ("2x4", (sj.S(1), sj.S(0))),
    ("2x4", (sj.S(0), sj.S(0))),
    ("1d8", (sj.S(1),)),
    ("1d8", (sj.S(0),)),
    ("sub4", (sj.S(0),)),
    ("sub4", (sj.B,)),
    ("perm", (sj.S(1), sj.S(0))),
    ("2x4", (sj.P, sj.S(1))),  # partial target: restored reduced, then B -> P (free)
    ("1d8", (sj.P_max,)),
]


def _target_id(target):
    return f"{target[0]}-{sj.format_sbp(target[1])}"


def _check_restored(t, x, pl, sbp):
    assert isinstance(t, sj.GlobalTensor)
    assert t.placement == pl and t.sbp == sbp and t.shape == x.shape and t.dtype == x.dtype
    np.testing.assert_array_equal(t.numpy(), x)
    if not any(isinstance(s, Partial) for s in sbp):
        locs = t.local_tensors()
        for coord in np.ndindex(*pl.shape):
            np.testing.assert_array_equal(locs[coord], reference_local(x, pl.shape, sbp, coord))


@pytest.mark.parametrize("target", TARGETS, ids=_target_id)
def test_restore_into_another_layout_is_bit_exact(tmp_path, target):
    path = _saved_from_s0_b(tmp_path)
    pl, sbp = _placement(target[0]), target[1]
    out = checkpoint.restore(
        path, {"params": {k: checkpoint.layout(pl, sbp) for k in LEAVES}, "step": 0, "count": jnp.int32(0)}
    )
    for k, x in LEAVES.items():
        _check_restored(out["params"][k], x, pl, sbp)
    assert out["step"] == 12 and type(out["step"]) is int
    assert out["count"].dtype == jnp.int32 and int(out["count"]) == 12


def test_even_layouts_are_read_straight_into_their_sharding(tmp_path):
    path = _saved_from_s0_b(tmp_path)
    pl = sj.placement((2, 4), ("x", "y"))
    out = checkpoint.restore(
        path, {"params": {k: checkpoint.layout(pl, (sj.B, sj.S(1))) for k in LEAVES}, "step": 0, "count": 0}
    )
    t = out["params"]["even_f32"]  # 16 columns divide by 4: orbax reads shards onto devices
    assert t.physical.sharding == NamedSharding(pl.mesh, PartitionSpec(None, "y"))
    x = LEAVES["even_f32"]
    for shard in t.physical.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_restore_into_a_global_tensor_target_uses_its_layout(tmp_path):
    path = _saved_from_s0_b(tmp_path)
    pl = sj.placement(8, "x")
    target = {
        "params": {k: sj.to_global(np.zeros_like(v), pl, sj.S(0)) for k, v in LEAVES.items()},
        "step": 0,
        "count": jnp.int32(0),
    }
    out = checkpoint.restore(path, target)
    for k, x in LEAVES.items():
        _check_restored(out["params"][k], x, pl, (sj.S(0),))


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_partials_are_reduced_when_saved(tmp_path, op):
    pl = sj.placement((2, 4), ("x", "y"))
    sbp = (sj.S(0), sj.Partial(op))
    # distinct terms per device, so the saved value is the reduction and not any one term
    terms = np.empty(pl.shape, dtype=object)
    for coord in np.ndindex(*pl.shape):
        terms[coord] = RNG.integers(-50, 50, size=(3 if coord[0] == 0 else 2, 6)).astype(np.int32)
    t = sj.from_local_tensors(terms, pl, sbp, (5, 6))
    want = reference_assemble(terms, sbp)
    checkpoint.save(tmp_path / "p", {"t": t})
    back = checkpoint.restore(tmp_path / "p", {"t": checkpoint.layout(pl, (sj.B, sj.B))})["t"]
    _check_restored(back, want, pl, (sj.B, sj.B))
    again = checkpoint.restore(tmp_path / "p", {"t": t})["t"]  # the partial layout itself
    _check_restored(again, want, pl, sbp)


def test_plain_leaves_and_an_optax_state_round_trip(tmp_path):
    params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4, jnp.bfloat16)}
    opt = optax.adam(1e-3).init(params)
    tree = {"opt": opt, "np": np.arange(5, dtype=np.int64), "scalar": np.float32(2.5), "lr": 0.125, "step": 3}
    checkpoint.save(tmp_path / "c", tree)
    out = checkpoint.restore(tmp_path / "c", jax.tree.map(lambda v: v, tree))
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert isinstance(got, jax.Array) if isinstance(want, jax.Array) else type(got) is type(want)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.asarray(got).dtype == np.asarray(want).dtype


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_round_trip_as_keys(tmp_path, impl):
    """A typed key (optax.noisy_sgd's state, a dropout key) is saved as its key
    data and comes back as a typed key of the same implementation, split over
    the devices as the target is."""
    mesh = jax.make_mesh((8,), ("x",))
    keys = jax.device_put(
        jax.random.split(jax.random.key(5, impl=impl), 8), NamedSharding(mesh, PartitionSpec("x"))
    )
    tree = {"one": jax.random.key(9, impl=impl), "rows": keys}
    checkpoint.save(tmp_path / "k", tree)
    out = checkpoint.restore(tmp_path / "k", tree)
    for name in tree:
        assert jax.dtypes.issubdtype(out[name].dtype, jax.dtypes.prng_key)
        assert str(jax.random.key_impl(out[name])) == impl
        np.testing.assert_array_equal(jax.random.key_data(out[name]), jax.random.key_data(tree[name]))
    assert out["rows"].sharding.is_equivalent_to(keys.sharding, keys.ndim)


def test_save_is_atomic_and_leaves_nothing_when_it_fails(tmp_path, monkeypatch):
    pl = sj.placement(8, "x")
    t = sj.to_global(np.arange(16.0, dtype=np.float32), pl, sj.S(0))
    checkpoint.save(tmp_path / "ok", {"t": t})
    assert os.listdir(tmp_path) == ["ok"]  # renamed from orbax's temporary folder when done

    # a leaf that cannot be saved is refused before anything is written
    with pytest.raises(sj.SBPError, match=r"leaf 'bad' is a str; a checkpoint leaf must be"):
        checkpoint.save(tmp_path / "refused", {"t": t, "bad": "text"})
    assert os.listdir(tmp_path) == ["ok"]
    # so is an empty tensor (orbax refused it midway, leaving its temporary folder)
    empty = sj.to_global(np.zeros((0, 5), np.float32), pl, sj.S(0))
    with pytest.raises(sj.SBPError, match=r"leaf 'w' has no elements \(shape \(0, 5\)\).*leave it out"):
        checkpoint.save(tmp_path / "empty", {"w": empty, "step": 1, "b": np.ones(3, np.float32)})
    assert os.listdir(tmp_path) == ["ok"]

    # orbax failing in the middle of writing arrays leaves neither the path nor its tmp folder
    async def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ocp.type_handlers.ArrayHandler, "serialize", fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path / "broken", {"t": t})
    assert os.listdir(tmp_path) == ["ok"]


def test_save_refuses_an_existing_path(tmp_path):
    t = sj.to_global(np.zeros(4, np.float32), sj.placement(8, "x"), sj.B)
    checkpoint.save(tmp_path / "c", {"t": t})
    with pytest.raises(sj.SBPError, match=r"already exists; save each checkpoint to a new folder"):
        checkpoint.save(tmp_path / "c", {"t": t})
    # a tree without leaves: refused before anything is written (orbax raised a raw ValueError)
    for empty in ({}, [], {"a": {}, "b": None}):
        with pytest.raises(sj.SBPError, match="has no leaves"):
            checkpoint.save(tmp_path / "empty", empty)
        assert not os.path.exists(tmp_path / "empty")


def test_restore_errors_say_what_where_and_how_to_fix(tmp_path):
    pl = sj.placement((2, 4), ("x", "y"))
    t = sj.to_global(np.arange(24, dtype=np.float32).reshape(4, 6), pl, (sj.S(0), sj.B))
    checkpoint.save(tmp_path / "c", {"a": {"w": t}, "step": 1})
    lay = checkpoint.layout(pl, (sj.B, sj.B))

    with pytest.raises(sj.SBPError, match=r"no checkpoint at .*missing.*Check the path"):
        checkpoint.restore(tmp_path / "missing", {"a": {"w": lay}, "step": 0})
    (tmp_path / "killed.orbax-checkpoint-tmp-1700000000").mkdir()  # as a process killed mid-save leaves
    with pytest.raises(
        sj.SBPError,
        match=r"checkpoint at .*killed is incomplete: a save to it did not finish "
        r"\(it left .*killed\.orbax-checkpoint-tmp-1700000000\)",
    ):
        checkpoint.restore(tmp_path / "killed", {"a": {"w": lay}, "step": 0})
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        sj.SBPError, match=r"checkpoint at .*empty is incomplete: .*empty/_METADATA is missing"
    ):
        checkpoint.restore(tmp_path / "empty", {"a": {"w": lay}, "step": 0})
    with pytest.raises(
        sj.SBPError,
        match=r"target has 1 leaf the checkpoint lacks: a\.v.*"
        r"checkpoint has 1 leaf the target lacks: a\.w",
    ):
        checkpoint.restore(tmp_path / "c", {"a": {"v": lay}, "step": 0})
    with pytest.raises(sj.SBPError, match=r"checkpoint has 1 leaf the target lacks: step"):
        checkpoint.restore(tmp_path / "c", {"a": {"w": lay}})
    many = {f"w{i:02d}": lay for i in range(20)}  # a model's hundreds of leaves: the first few and a count
    with pytest.raises(
        sj.SBPError, match=r"target has 20 leaves the checkpoint lacks: w00, .*, w07, \.\.\. and 12 more"
    ):
        checkpoint.restore(tmp_path / "c", {"a": {"w": lay}, "step": 0, **many})
    wrong_shape = sj.to_global(np.zeros((4, 5), np.float32), pl, (sj.S(0), sj.B))
    with pytest.raises(
        sj.SBPError,
        match=r"leaf 'a\.w' was saved with shape \(4, 6\) and dtype float32, "
        r"but the target asks for shape \(4, 5\)",
    ):
        checkpoint.restore(tmp_path / "c", {"a": {"w": wrong_shape}, "step": 0})
    wrong_dtype = sj.to_global(np.zeros((4, 6), np.int32), pl, (sj.S(0), sj.B))
    with pytest.raises(sj.SBPError, match=r"and dtype int32\. Restore into a target of the saved"):
        checkpoint.restore(tmp_path / "c", {"a": {"w": wrong_dtype}, "step": 0})
    with pytest.raises(
        sj.SBPError,
        match=r"leaf 'step' was saved with shape \(\) and dtype int64, "
        r"but the target is a Python float",
    ):
        checkpoint.restore(tmp_path / "c", {"a": {"w": lay}, "step": 0.0})
    with pytest.raises(sj.SBPError, match=r"leaf 'a\.w'.*splits dim 2, but the tensor has 2 dims"):
        checkpoint.restore(tmp_path / "c", {"a": {"w": checkpoint.layout(pl, (sj.S(2), sj.B))}, "step": 0})
    mask = sj.to_global(np.ones(8, bool), sj.placement(8, "d"), sj.S(0))
    checkpoint.save(tmp_path / "m", {"mask": mask})
    with pytest.raises(sj.SBPError, match=r"restore\(.*m\): leaf 'mask': P .* not supported for dtype bool"):
        checkpoint.restore(tmp_path / "m", {"mask": checkpoint.layout(sj.placement(8, "d"), sj.P)})
    with pytest.raises(sj.SBPError, match=r"target leaf 'a\.w' is a str"):
        checkpoint.restore(tmp_path / "c", {"a": {"w": "B"}, "step": 0})
    with pytest.raises(sj.SBPError, match=r"nd-SBP \(B\) has 1 entries but the placement has 2 axes"):
        checkpoint.layout(pl, sj.B)
    with pytest.raises(sj.SBPError, match=r"placement must be an sj.Placement"):
        checkpoint.layout((2, 4), (sj.B, sj.B))


def _damage(file, how):
    data = open(file, "rb").read()
    if how == "delete":
        os.remove(file)
    elif how == "truncate":
        open(file, "wb").write(data[: len(data) // 2])
    else:  # same size, other bytes
        open(file, "wb").write(bytes(b ^ 0x5A for b in data) if data else b"")


def test_an_optimizer_state_of_another_chain_is_a_structure_mismatch_not_corruption(tmp_path):
    """optax.adamw's state is adam's plus an EmptyState: the same leaves, another
    tree. Reported as corrupted, a user could delete a good checkpoint."""
    import optax

    w = {"w": np.arange(4, dtype=np.float32)}
    checkpoint.save(tmp_path / "c", {"params": w, "opt": optax.adam(1e-3).init(w)})
    with pytest.raises(
        sj.SBPError, match=r"another tree structure.*EmptyState.*checkpoint itself is intact"
    ) as e:
        checkpoint.restore(tmp_path / "c", {"params": w, "opt": optax.adamw(1e-3).init(w)})
    assert not isinstance(e.value, checkpoint.CheckpointError)
    back = checkpoint.restore(tmp_path / "c", {"params": w, "opt": optax.adam(1e-3).init(w)})
    np.testing.assert_array_equal(back["params"]["w"], w["w"])


@pytest.mark.parametrize(
    "how,kind", [("delete", "incomplete"), ("truncate", "corrupted"), ("garble", "corrupted")]
)
def test_damaged_checkpoints_name_the_file(tmp_path, how, kind):
    pl = sj.placement((2, 4), ("x", "y"))
    tree = {
        "w": sj.to_global(np.arange(48, dtype=np.float32).reshape(8, 6), pl, (sj.S(0), sj.B)),
        "b": np.ones(3, np.float32),
        "step": 7,
    }
    checkpoint.save(tmp_path / "orig", tree)
    files = sorted(
        str(p.relative_to(tmp_path / "orig")) for p in (tmp_path / "orig").rglob("*") if p.is_file()
    )
    assert "sbpjax_manifest.json" in files and "_METADATA" in files
    for rel in files:
        if rel == "sbpjax_manifest.json" or (
            how == "garble" and os.path.getsize(tmp_path / "orig" / rel) == 0
        ):
            continue
        copy = tmp_path / f"{how}-{rel.replace('/', '_')}"
        shutil.copytree(tmp_path / "orig", copy)
        _damage(copy / rel, how)
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.restore(copy, tree)
        assert e.value.kind == kind and e.value.file == str(copy / rel), str(e.value)
        assert f"is {kind}: " in str(e.value) and str(copy / rel) in str(e.value)
    restored = checkpoint.restore(tmp_path / "orig", tree)  # the original is untouched and whole
    np.testing.assert_array_equal(restored["w"].numpy(), tree["w"].numpy())


def test_missing_file_and_foreign_checkpoints(tmp_path):
    pl = sj.placement(8, "x")
    tree = {"w": sj.to_global(np.arange(16, dtype=np.float32), pl, sj.S(0))}
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at") as e:
        checkpoint.restore(tmp_path / "nothing", tree)
    assert e.value.kind == "missing"
    (tmp_path / "afile").write_text("not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="is a file, not a checkpoint folder") as e:
        checkpoint.restore(tmp_path / "afile", tree)
    assert e.value.kind == "corrupted" and e.value.file == str(tmp_path / "afile")
    # a checkpoint without sbpjax's file list (another tool's): orbax's own failures are "corrupted"
    checkpoint.save(tmp_path / "c", tree)
    os.remove(tmp_path / "c" / "sbpjax_manifest.json")
    np.testing.assert_array_equal(checkpoint.restore(tmp_path / "c", tree)["w"].numpy(), np.arange(16))
    _damage(tmp_path / "c" / "_METADATA", "garble")
    with pytest.raises(
        checkpoint.CheckpointError, match=r"is corrupted: orbax cannot read its metadata"
    ) as e:
        checkpoint.restore(tmp_path / "c", tree)
    assert e.value.kind == "corrupted" and e.value.file.endswith("_METADATA")
    # an unreadable file list is itself named
    checkpoint.save(tmp_path / "d", tree)
    (tmp_path / "d" / "sbpjax_manifest.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="its file list .* cannot be read") as e:
        checkpoint.restore(tmp_path / "d", tree)
    assert e.value.kind == "corrupted"
