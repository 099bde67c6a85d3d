"""SBP annotations on NNX and Linen modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from flax import linen as nn
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, P, S


class MLP(nnx.Module):
    def __init__(self, d, h, rngs, kernel_init=nnx.initializers.lecun_normal()):
        self.fc1 = nnx.Linear(d, h, kernel_init=kernel_init, rngs=rngs)
        self.fc2 = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


class Stack(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([MLP(8, 16, rngs) for _ in range(2)])


def test_with_sbp_is_metadata_read_by_get_sbp():
    m = MLP(8, 16, nnx.Rngs(0), kernel_init=sjf.with_sbp(nnx.initializers.lecun_normal(), "B, S(1)"))
    assert m.fc1.kernel.get_metadata()["sbp"] == (B, S(1))
    raw = sjf.get_sbp(m)
    assert raw == {"fc1": {"kernel": (B, S(1)), "bias": None}, "fc2": {"kernel": None, "bias": None}}
    pl = sj.placement((2, 4), ("x", "y"))
    full = sjf.get_sbp(m, pl)
    assert full["fc1"]["kernel"] == (B, S(1)) and full["fc2"]["bias"] == (B, B)
    # the tree has the parameters' structure
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    assert jax.tree.structure(params) == jax.tree.structure(full, is_leaf=lambda v: isinstance(v, tuple))


def test_annotate_patterns_first_match_wins():
    m = Stack(nnx.Rngs(0))
    sjf.annotate(
        m,
        [
            ("blocks.0.fc1.kernel", (S(0), B)),
            ("blocks.*.fc1.kernel", (B, S(1))),
            ("blocks.*.fc2.kernel", "B, S(0)"),
        ],
    )
    got = sjf.get_sbp(m)
    assert got["blocks"][0]["fc1"]["kernel"] == (S(0), B)
    assert got["blocks"][1]["fc1"]["kernel"] == (B, S(1))
    assert got["blocks"][1]["fc2"]["kernel"] == (B, S(0))
    assert got["blocks"][1]["fc2"]["bias"] is None


def test_annotate_errors_name_the_rule_and_the_paths():
    m = Stack(nnx.Rngs(0))
    with pytest.raises(sj.SBPError, match=r"match no parameter of Stack.*blocks\.0\.fc1\.bias"):
        sjf.annotate(m, {"block.*.fc1.kernel": (B, S(1))})
    with pytest.raises(sj.SBPError, match=r"splits dim 1 but the parameter has 1 dims"):
        sjf.annotate(m, {"blocks.0.fc1.bias": (B, S(1))})
    with pytest.raises(sj.SBPError, match="not an SBP"):
        sjf.annotate(m, {"blocks.0.fc1.kernel": (0, 1)})
    assert sjf.get_sbp(m)["blocks"][0]["fc1"]["kernel"] is None  # nothing half-applied by the bad rules
    pl = sj.placement(8, "x")
    sjf.annotate(m, {"blocks.0.fc1.kernel": (B, S(1))})
    with pytest.raises(sj.SBPError, match="has 2 entries but the placement has 1 axes"):
        sjf.get_sbp(m, pl)


def test_place_and_unplace():
    pl = sj.placement((2, 4), ("x", "y"))
    m = MLP(8, 16, nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(m, nnx.Param)))
    sjf.annotate(m, {"fc1.kernel": (B, S(1)), "fc2.kernel": (S(0), S(0))})
    sjf.place(m, pl)
    k = m.fc1.kernel.get_value()
    assert isinstance(k, sj.GlobalTensor) and k.sbp == (B, S(1)) and k.placement == pl
    assert m.fc2.bias.get_value().sbp == (B, B)
    np.testing.assert_array_equal(m.fc2.kernel.get_value().numpy(), before["fc2"]["kernel"])
    # the local tensor of device (1, 2) is the third column block of fc1's kernel
    np.testing.assert_array_equal(k.local_tensors()[1, 2], before["fc1"]["kernel"][:, 8:12])
    sjf.unplace(m)
    x = np.ones((3, 8), np.float32)
    ref = MLP(8, 16, nnx.Rngs(0))
    assert_close(np.asarray(m(x)), np.asarray(ref(x)), rtol=1e-6)


def test_sbp_module_annotates_an_existing_class_and_its_call():
    pl = sj.placement(8, "x")
    Column = sjf.sbp_module(
        nnx.Linear, params={"kernel": (S(1),), "bias": (S(0),)}, inputs=(B,), outputs=(S(1),)
    )
    assert Column.__name__ == "Linear" and Column is not nnx.Linear
    layer = Column(16, 32, rngs=nnx.Rngs(0))
    assert sjf.get_sbp(layer) == {"kernel": (S(1),), "bias": (S(0),)}
    assert nnx.Linear(4, 4, rngs=nnx.Rngs(0)).kernel.get_metadata().get("sbp") is None  # original untouched
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    # outside sj.jit nothing changes
    assert_close(
        np.asarray(layer(x)), x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...]), rtol=1e-5
    )

    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)

    def fwd(p, x):
        s = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(s, p)
        return nnx.merge(graphdef, s)(x)

    f = sj.jit(fwd, placement=pl, in_sbp=(sjf.get_sbp(layer, pl), (S(0),)))
    y = f(params, x)
    assert y.sbp == (S(1),)  # the declared output layout
    assert_close(y.numpy(), x @ params["kernel"] + params["bias"], rtol=1e-5)
    # the declared input layout B forces x (given split by rows) to be gathered first
    assert any(b.src == (S(0),) and b.dst == (B,) for b in f.explain(params, x).boxings)


def test_sbp_module_as_decorator_with_patterns():
    @sjf.sbp_module(params={"fc1.kernel": (B, S(1)), "fc2.kernel": (B, S(0))})
    class Block(MLP):
        pass

    blk = Block(8, 16, nnx.Rngs(0))
    assert sjf.get_sbp(blk)["fc1"]["kernel"] == (B, S(1))
    with pytest.raises(sj.SBPError, match="not an nnx.Module class"):
        sjf.sbp_module(int)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (B, S(1))))(x)
        return nn.Dense(8, kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (B, S(0))))(
            jax.nn.relu(x)
        )


def test_linen_boxes_and_get_sbp():
    pl = sj.placement((2, 4), ("x", "y"))
    x = jnp.ones((4, 8))
    variables = LinenMLP().init(jax.random.key(0), x)
    sbps = sjf.linen.get_sbp(variables["params"], pl)
    assert sbps["Dense_0"]["kernel"] == (B, S(1)) and sbps["Dense_1"]["kernel"] == (B, S(0))
    assert sbps["Dense_0"]["bias"] == (B, B)
    plain = sjf.linen.unbox(variables["params"])
    assert isinstance(plain["Dense_0"]["kernel"], jax.Array)
    # apply works on the boxed variables as on plain ones
    assert_close(
        np.asarray(LinenMLP().apply(variables, x)),
        np.asarray(LinenMLP().apply({"params": plain}, x)),
        rtol=1e-6,
    )
    assert sjf.linen.get_sbp(variables["params"])["Dense_0"]["bias"] is None
    assert P  # imported names used across this module's tests
