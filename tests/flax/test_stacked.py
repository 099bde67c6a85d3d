"""Layouts of stacked layers: nnx.vmap / nnx.scan and Linen nn.scan / nn.vmap
add a leading layer dim; a layout written for one layer shifts past it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes
from flax import linen as nn
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S
from sbpjax.compiler.api import is_nd_sbp
from sbpjax.flax.annotate import shift_stacked

L, D, H = 3, 16, 32
WANT = {"fc1": {"kernel": (B, S(2)), "bias": (B, S(1))}, "fc2": {"kernel": (B, S(1)), "bias": (B, B)}}


class Block(nnx.Module):
    def __init__(self, rngs, annotated=True):
        init = sjf.with_sbp if annotated else (lambda f, _: f)
        self.fc1 = nnx.Linear(
            D,
            H,
            kernel_init=init(nnx.initializers.lecun_normal(), (B, S(1))),
            bias_init=init(nnx.initializers.normal(0.1), (B, S(0))),
            rngs=rngs,
        )
        self.fc2 = nnx.Linear(H, D, kernel_init=init(nnx.initializers.lecun_normal(), (B, S(0))), rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(x)))


MegatronBlock = sjf.sbp_module(
    Block, params={"fc1.kernel": (B, S(1)), "fc1.bias": (B, S(0)), "fc2.kernel": (B, S(0))}
)


def stack(cls, **kw):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return cls(rngs, **kw)

    return make(nnx.Rngs(0))


def scan_forward(graphdef, state, x):
    model = nnx.merge(graphdef, state)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
        return block(h)

    return run(x, model)


@pytest.mark.parametrize("how", ["with_sbp", "sbp_module", "annotate_stacked"])
def test_nnx_stacked_layouts_shift_past_the_layer_dim(how):
    pl = sj.placement((2, 4), ("x", "y"))
    if how == "with_sbp":
        model = stack(Block)
    elif how == "sbp_module":
        model = stack(MegatronBlock, annotated=False)
    else:
        model = stack(Block, annotated=False)
        sjf.annotate(
            model, {"fc1.kernel": (B, S(1)), "fc1.bias": (B, S(0)), "fc2.kernel": (B, S(0))}, stacked=1
        )
    assert model.fc1.kernel.get_value().shape == (L, D, H)
    assert sjf.get_sbp(model, pl) == WANT

    graphdef, state = nnx.split(model)
    x = np.random.default_rng(0).normal(size=(8, D)).astype(np.float32)
    want = scan_forward(graphdef, state, x)
    f = sj.jit(
        lambda st, v: scan_forward(graphdef, st, v),
        placement=pl,
        in_sbp=(jax.tree.map(lambda s: s, sjf.get_sbp(model, pl)), (S(0), B)),
    )
    params = nnx.to_pure_dict(state)
    got = f(params, x)  # the scan is written out layer by layer: no SBPWarning (pytest makes one an error)
    assert_close(got.numpy(), np.asarray(want), rtol=1e-5)
    e = f.explain(params, x)
    assert sum(c.bytes for c in sj.collectives(f.lower(params, x).compile())) == e.bytes


def test_annotate_stacked_checks_its_arguments():
    model = stack(Block, annotated=False)
    with pytest.raises(sj.SBPError, match="stacked="):
        sjf.annotate(model, {"fc1.kernel": (B, S(1))}, stacked=-1)
    with pytest.raises(sj.SBPError, match="splits dim 2 but the parameter has 2 dims"):
        sjf.annotate(model, {"fc1.kernel": (B, S(2))}, stacked=1)  # written for the stack, not one layer


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(
            H,
            kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (S(1),)),
            bias_init=sjf.linen.with_sbp(nn.initializers.normal(0.1), (S(0),)),
        )(x)
        out = nn.Dense(D, kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (S(0),)))(nn.gelu(h))
        return x + out, None


def test_linen_scan_shifts_splits_and_runs_like_one_device():
    """The reported bug: under nn.scan the column split (B, S(1)) became a row
    split and the bias's S(0) landed on the layer dim ("dim 0 of size 3 is split 4 ways")."""
    pl = sj.placement(4, "y")
    Stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
    x = np.random.default_rng(1).normal(size=(8, D)).astype(np.float32)
    variables = Stack().init(jax.random.key(0), jnp.asarray(x), None)
    sbp = sjf.linen.get_sbp(variables["params"], pl)
    assert sbp["Dense_0"] == {"kernel": (S(2),), "bias": (S(1),)}
    assert sbp["Dense_1"] == {"kernel": (S(1),), "bias": (B,)}
    params = sjf.linen.unbox(variables["params"])
    want, _ = Stack().apply({"params": params}, jnp.asarray(x), None)
    f = sj.jit(lambda p, v: Stack().apply({"params": p}, v, None)[0], placement=pl, in_sbp=(sbp, (B,)))
    got = f(params, x)  # the scan is written out layer by layer: no SBPWarning (pytest makes one an error)
    assert_close(got.numpy(), np.asarray(want), rtol=1e-5)
    e = f.explain(params, x)
    assert sum(c.bytes for c in sj.collectives(f.lower(params, x).compile())) == e.bytes


def test_linen_vmap_inserts_its_axis_where_it_says():
    Stacked = nn.vmap(
        LinenBlock,
        variable_axes={"params": 1},
        split_rngs={"params": True},
        in_axes=(0, None),
        out_axes=0,
        axis_size=2,
    )
    variables = Stacked().init(jax.random.key(0), jnp.ones((2, 4, D)), None)
    sbp = sjf.linen.get_sbp(variables["params"])
    assert jax.tree.map(jnp.shape, sjf.linen.unbox(variables["params"]))["Dense_0"]["kernel"] == (D, 2, H)
    assert jax.tree.map(jnp.shape, sjf.linen.unbox(variables["params"]))["Dense_0"]["bias"] == (H, 2)
    assert sbp["Dense_0"] == {
        "kernel": (S(2),),
        "bias": (S(0),),
    }  # kernel dim 1 -> 2; the bias's dim 0 is before it


def test_shift_stacked_refuses_a_split_of_the_removed_dim():
    assert shift_stacked((B, S(2)), -1, "p", 0) == (B, S(1))
    with pytest.raises(sj.SBPError, match="never split along its layers"):
        shift_stacked((S(0), B), -1, "p", 0)


def test_a_wrong_layout_in_a_stack_is_named_as_written_for_one_layer():
    """A one-entry layout on a 2-axis placement, written for one layer: the
    message's example is what to write in with_sbp, not the stack's shifted
    layout (it said ``e.g. (S(2), B)``, which written there became S(3))."""

    class Short(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(
                D, H, kernel_init=sjf.with_sbp(nnx.initializers.lecun_normal(), (S(1),)), rngs=rngs
            )

    pl = sj.placement((2, 4), ("data", "model"))
    with pytest.raises(sj.SBPError, match=r"one layer of a stack.*e\.g\. \(S\(1\), B\)"):
        sjf.get_sbp(stack(Short), pl)
    # the same layout on a model that stacks nothing says nothing of a stack
    with pytest.raises(sj.SBPError, match=r"parameter 'fc\.kernel'.*e\.g\. \(S\(1\), B\)") as err:
        sjf.get_sbp(Short(nnx.Rngs(0)), pl)
    assert "stack" not in str(err.value)


def _sgd_step(apply):
    def step(params, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((apply(p, x) - jnp.tanh(x)) ** 2))(params)
        return loss, jax.tree.map(lambda p, d: p - 0.1 * d, params, g)

    return step


@pytest.mark.parametrize("flavour", ["nnx_scan", "linen_scan"])
def test_stacked_megatron_train_step_equals_one_device_and_moves_no_more_than_gspmd(flavour):
    """Stacked layers with Megatron layouts on 2x4 (data x tensor): three SGD
    steps equal one device's, and the step moves no more than GSPMD's."""
    pl = sj.placement((2, 4), ("x", "y"))
    x = np.random.default_rng(0).normal(size=(8, D)).astype(np.float32)
    if flavour == "nnx_scan":
        model = stack(Block)
        graphdef, state = nnx.split(model)
        params, sbp = nnx.to_pure_dict(state), sjf.get_sbp(model, pl)

        def apply(p, v):
            return scan_forward(graphdef, p, v)

    else:
        Stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
        variables = Stack().init(jax.random.key(0), jnp.asarray(x), None)
        # the block's annotations are for one axis (the tensor axis 'y'); B over 'x'
        one_axis = sjf.linen.get_sbp(variables["params"], sj.placement(4, "y"))
        sbp = jax.tree.map(lambda s: (B, *s), one_axis, is_leaf=is_nd_sbp)
        params = sjf.linen.unbox(variables["params"])

        def apply(p, v):
            return Stack().apply({"params": p}, v, None)[0]

    step = _sgd_step(apply)
    f = sj.jit(step, placement=pl, in_sbp=(sbp, (S(0), B)), out_sbp=(None, sbp))
    p_sj, p_ref = params, params
    for _ in range(3):
        loss, p_sj = f(p_sj, x)
        want, p_ref = jax.jit(step)(p_ref, x)
        assert_close(loss.numpy(), np.asarray(want), rtol=1e-5)
    jax.tree.map(
        lambda a, b: assert_close(a.numpy(), np.asarray(b), rtol=1e-4),
        p_sj,
        p_ref,
        is_leaf=lambda t: isinstance(t, sj.GlobalTensor),
    )
    ours = f.explain(params, x).bytes
    assert ours == sum(c.bytes for c in sj.collectives(f.lower(params, x).compile()))
    gspmd = gspmd_bytes(step, pl, (sbp, (S(0), B)), ((B, B), sbp), (params, x))
    print(f"{flavour}: sbpjax {ours} B, GSPMD {gspmd} B")
    assert ours <= gspmd
