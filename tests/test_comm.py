"""The collective reader on real compiled programs and on HLO text forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as PS

import sbpjax as sj
from sbpjax.comm import total_bytes

HLO = """HloModule m, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[2,8])) -> (s32[], f32[2,8]) {
  %p = (s32[], f32[2,8]{1,0}) parameter(0)
  %x = f32[2,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[2,8]{1,0} collective-permute(%x), channel_id=5, source_target_pairs={{0,1},{1,0},{2,2}}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[2,8]{1,0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[2,8])) -> pred[] {
  %p = (s32[], f32[2,8]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,8]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %ar = f32[8,8]{1,0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %ag = f32[8,8]{1,0} all-gather(%x), channel_id=2, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true
  %rs = f32[1,8]{1,0} reduce-scatter(%x), channel_id=3, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %a2a = (f32[2,2]{1,0}, f32[2,2]{1,0}, /*index=2*/f32[2,2]{1,0}, f32[2,2]{1,0}) all-to-all(%x, %x, %x, %x), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}
  %init = (s32[], f32[2,8]{1,0}) tuple(%x, %x)
  %w = (s32[], f32[2,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[8,8]{1,0} add(%ar, %ag)
}
"""


def test_reader_on_hlo_text_forms():
    found = {c.op: c for c in sj.collectives(HLO)}
    ar = found["all-reduce"]
    assert (ar.group_size, ar.num_groups) == (4, 2)
    assert ar.bytes_per_device == 2 * 3 / 4 * 256 and ar.bytes == 2 * 3 * 256 * 2
    ag = found["all-gather"]  # iota groups [4,2]<=[8]: 4 groups of 2
    assert (ag.group_size, ag.num_groups) == (2, 4) and ag.bytes == 8 * (1 / 2) * 256
    rs = found["reduce-scatter"]  # transposed iota: 2 groups of 4
    assert (rs.group_size, rs.num_groups) == (4, 2) and rs.bytes_per_device == 3 * 32
    a2a = found["all-to-all"]  # tuple form with /*index=N*/ comments
    assert a2a.bytes_per_device == 3 / 4 * 64 and a2a.bytes == 8 * 48
    cp = found["collective-permute"]  # inside a loop of 3; the {2,2} pair moves nothing
    assert cp.count == 3 and cp.num_groups == 2 and cp.bytes == 3 * 2 * 64
    assert total_bytes(HLO) == sum(c.bytes for c in found.values())


def test_reader_on_a_compiled_loop(pl8):
    mesh = pl8.mesh

    def body(x):
        def step(c, _):
            return lax.ppermute(c, "x", [(i, (i + 1) % 8) for i in range(8)]), None

        y, _ = lax.scan(step, x, None, length=5)
        return lax.psum(y, "x")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PS("x"), out_specs=PS(), check_vma=False))
    x = jnp.ones((8, 16), jnp.float32)
    found = sj.collectives(f.lower(x).compile())
    perm = [c for c in found if c.op == "collective-permute"]
    assert perm and sum(c.bytes for c in perm) == 5 * 8 * 64  # 5 iterations, 8 pairs, 64 B each
    [ar] = [c for c in found if c.op == "all-reduce"]
    assert ar.group_size == 8 and ar.bytes == 2 * 7 * 64


def test_reader_takes_lowered_and_compiled(pl8):
    f = jax.jit(
        jax.shard_map(
            lambda x: lax.all_gather(x, "x", tiled=True),
            mesh=pl8.mesh,
            in_specs=PS("x"),
            out_specs=PS(),
            check_vma=False,
        )
    )
    x = np.zeros((16, 4), np.float32)
    lowered = f.lower(x)
    a, b = sj.collectives(lowered), sj.collectives(lowered.compile())
    assert a == b and a[0].op == "all-gather" and a[0].bytes == 7 * 16 * 4 * 4


# The same shard_map collectives as printed by jax 0.10.2 (explicit lists) and by
# jax 0.12.0.1 (mesh form), captured from real compiles on a 2x4 / 2x2x2 mesh;
# the last pairs come from GSPMD programs (sub-axes) and hand-written forms.
GROUP_FORMS = [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", "replica_groups=mesh['x'=2,'y'=4] {'y'}"),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", "replica_groups=mesh['x'=2,'y'=4] {'x'}"),
    ("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=mesh['x'=2,'y'=4] {'x','y'}"),
    ("replica_groups={{0,4,1,5,2,6,3,7}}", "replica_groups=mesh['x'=2,'y'=4] {'y','x'}"),
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'c'}"),
    ("replica_groups={{0,1,4,5},{2,3,6,7}}", "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}"),
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", "replica_groups=mesh['a'=2,'b'=2,'c'=2] {'b','c'}"),
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", "replica_groups=mesh['x'=2,'y'=4] {'y':(2)2}"),
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}", "replica_groups=mesh['x'=2,'y'=4] {'y':(1)2}"),
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}", "replica_groups=[4,2]<=[2,2,2]T(0,2,1)"),
    (
        "replica_groups={{0,4,1,5},{2,6,3,7}}",
        "replica_groups=mesh[x=2,y=4], device_ids=(0,4,1,5,2,6,3,7) {'y'}",
    ),
    (
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}",
        "replica_groups=mesh[x=2,y=4], device_ids=([2,4]<=[4,2]T(1,0)) {'x'}",
    ),
    ("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=mesh['d'=8] {'d'}"),
    # GSPMD on jax 0.10.2, a 2x4 mesh seen as 4x1x1x2 with a transposed device order
    (
        "replica_groups={{0,1,2,3},{4,5,6,7}}",
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
    ),
    (
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_3'}",
    ),
    ("replica_groups={{3}}", "replica_groups=maximal_mesh[device_id=3] {}"),
]


@pytest.mark.parametrize("explicit,other", GROUP_FORMS)
def test_every_group_form_reads_as_its_explicit_list(explicit, other):
    from sbpjax.comm import _parse_groups

    line = "  %ar = f32[32,16]{1,0} all-reduce(%p), channel_id=1, GROUPS, use_global_device_ids=true"
    want = _parse_groups(line.replace("GROUPS", explicit), 8)
    assert _parse_groups(line.replace("GROUPS", other), 8) == want
    # and the bytes of a whole instruction agree too
    hlo = HLO.replace(
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
        other + ", use_global_device_ids=true, to_apply=%add",
    )
    ref = HLO.replace(
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add",
        explicit + ", use_global_device_ids=true, to_apply=%add",
    )
    assert total_bytes(hlo) == total_bytes(ref)


def test_mesh_form_all_to_all_over_one_axis_is_groups_of_that_axis():
    # jax 0.12 printed this all-to-all over y as one group of 8 before (448 B, not 384 B).
    line = (
        "  %all-to-all = (f32[8,16]{1,0}, f32[8,16]{1,0}, f32[8,16]{1,0}, f32[8,16]{1,0}) "
        "all-to-all(%a, %b, %c, %d), channel_id=1, replica_groups=mesh['x'=2,'y'=4] {'y'}, "
        'metadata={op_name="jit(f)/shard_map/all_to_all"}'
    )
    hlo = "HloModule m, num_partitions=8\n\nENTRY %main () -> f32[] {\n" + line + "\n}\n"
    [c] = sj.collectives(hlo)
    assert (c.group_size, c.num_groups) == (4, 2)
    assert c.bytes_per_device == 3 / 4 * 4 * 8 * 16 * 4


@pytest.mark.parametrize("axes", [("x",), ("y",), ("x", "y"), ("y", "x")])
@pytest.mark.parametrize("op", ["psum", "all_gather", "psum_scatter", "all_to_all"])
def test_compiled_collectives_match_their_formula_on_this_jax(pl24, op, axes):
    """Whatever form this JAX prints, each collective over ``axes`` reads as
    groups of that size, and its bytes follow the module's formulas."""
    mesh = pl24.mesh
    g = int(np.prod([mesh.shape[a] for a in axes]))
    x = jnp.ones((64, 64), jnp.float32)
    local = 64 * 64 * 4 // 8  # bytes of one local block of a (x, y) split

    def body(a):
        if op == "psum":
            return lax.psum(a, axes)
        if op == "all_gather":
            return lax.all_gather(a, axes, axis=0, tiled=True)
        if op == "psum_scatter":
            return lax.psum_scatter(a, axes, scatter_dimension=0, tiled=True)
        return lax.all_to_all(a, axes, 0, 1, tiled=True)

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=PS("x", "y"), out_specs=PS("x", "y"), check_vma=False)
    )
    found = [c for c in sj.collectives(f.lower(x).compile()) if c.group_size > 1]
    assert len(found) == 1, found
    [c] = found
    assert (c.group_size, c.num_groups) == (g, 8 // g)
    per = {
        "psum": 2 * (g - 1) / g * local,
        "all_gather": (g - 1) * local,
        "psum_scatter": (g - 1) * local / g,
        "all_to_all": (g - 1) / g * local,
    }[op]
    assert c.bytes_per_device == per and c.bytes == per * 8
