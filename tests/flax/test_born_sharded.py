"""Born-sharded state: Trainer.create makes parameters and optimizer state in their layouts on the
devices, by compiled init programs; no split parameter is ever whole on one device or on the host."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf
import sbpjax.flax.train as train_module
from sbpjax import B, S

# shapes no other array of the test has, so a whole split parameter is recognised by its shape
D, H, N = 24, 40, 16


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, H, rngs=rngs)
        self.fc2 = nnx.Linear(H, D, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(jax.nn.gelu(self.fc1(x))))


RULES = {"fc1.kernel": (B, S(1)), "fc2.kernel": (B, S(0))}
WHOLE = {(D, H), (H, D)}  # the split kernels' logical shapes


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _batches(n=3):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
        for _ in range(n)
    ]


def _whole_shards():
    """(shape, device) of every live per-device buffer that holds a whole split kernel."""
    return [
        (s.data.shape, s.device.id)
        for a in jax.live_arrays()
        if not a.is_deleted()
        for s in a.addressable_shards
        if tuple(s.data.shape) in WHOLE
    ]


def _is_gt(v):
    return isinstance(v, sj.GlobalTensor)


@pytest.mark.parametrize("zero", [False, True], ids=["dp_tp", "zero"])
def test_create_never_holds_a_whole_split_parameter_and_trains_as_the_host_initialized_model(
    zero, monkeypatch
):
    pl = sj.placement((2, 4), ("x", "y"))
    concrete = []  # whether the factory ever ran on concrete values
    whole_during = []

    def factory():
        model = sjf.annotate(MLP(nnx.Rngs(0, dropout=1)), RULES)
        concrete.append(not isinstance(model.fc1.kernel.get_value(), jax.core.Tracer))
        whole_during.extend(_whole_shards())
        return model

    # no parameter goes through the host: nothing but scalars is put on the devices from outside
    # and no global tensor is read back while the state is built
    put, real_put = [], jax.device_put

    def device_put(x, *args, **kwargs):
        put.append(np.shape(x))
        return real_put(x, *args, **kwargs)

    def no_reads(self):
        raise AssertionError(f"a global tensor {self!r} was read back to the host during init")

    # the compiled init programs, to check none builds a whole kernel inside
    programs, real_jit = [], jax.jit

    def jit(fn, **kwargs):
        jitted = real_jit(fn, **kwargs)

        def call(*args):
            programs.append((jitted, args))
            return jitted(*args)

        return call

    assert not _whole_shards()
    with monkeypatch.context() as m:
        m.setattr(jax, "device_put", device_put)
        m.setattr(sj.GlobalTensor, "numpy", no_reads)
        m.setattr(train_module.jax, "jit", jit)
        trainer = sjf.Trainer.create(factory, optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0), B), zero=zero)
    assert concrete and not any(concrete), "the model factory ran eagerly"
    assert not whole_during and not _whole_shards()
    assert all(shape == () for shape in put), put
    assert len(programs) == 2  # the parameters and model state, then the optimizer state
    for jitted, args in programs:  # the partitioned programs: no value, temporary or not, of a whole kernel
        text = jitted.lower(*args).compile().as_text()
        assert f"[{D},{H}]" not in text and f"[{H},{D}]" not in text
        local = trainer.params["fc1"]["kernel"].physical.addressable_shards[0].data.shape
        assert "[{},{}]".format(*local) in text  # the local blocks are there

    # every parameter and optimizer state leaf lives at its layout, one local block per device
    for t in jax.tree.leaves((trainer.params, trainer.opt_state), is_leaf=_is_gt):
        local = {tuple(x.shape) for x in t.local_tensors().flat}
        assert {tuple(s.data.shape) for s in t.physical.addressable_shards} == local
    assert trainer.params["fc1"]["kernel"].sbp == ((S(0), S(1)) if zero else (B, S(1)))
    assert trainer.opt_state[0].mu["fc2"]["kernel"].sbp == trainer.params["fc2"]["kernel"].sbp

    host = sjf.Trainer(factory(), optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0), B), zero=zero)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
        (trainer.params, trainer.opt_state, trainer.state),
        (host.params, host.opt_state, host.state),
        is_leaf=_is_gt,
    )
    batches = _batches()
    losses = [trainer.step(b) for b in batches]
    assert_close(losses, [host.step(b) for b in batches], rtol=1e-6)


def test_train_step_init_makes_the_optimizer_state_on_the_devices(monkeypatch):
    pl = sj.placement((2, 4), ("x", "y"))
    rng = np.random.default_rng(3)
    w = rng.normal(size=(D, H)).astype(np.float32)
    step = sjf.TrainStep(
        lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.adam(1e-2), pl, {"w": (B, S(1))}, (S(0), B)
    )
    gw = sj.to_global(w, pl, (B, S(1)))

    def no_reads(self):
        raise AssertionError("read back to the host")

    with monkeypatch.context() as m:
        m.setattr(sj.GlobalTensor, "numpy", no_reads)
        params, opt_state = step.init({"w": gw})
    assert params["w"] is gw  # at its stored layout already
    mu = opt_state[0].mu["w"]
    assert mu.sbp == (B, S(1)) and {s.data.shape for s in mu.physical.addressable_shards} == {(D, H // 4)}
    x = rng.normal(size=(N, D)).astype(np.float32)
    ref = sjf.TrainStep(
        lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.adam(1e-2), pl, {"w": (B, S(1))}, (S(0), B)
    )
    rp, rs = ref.init({"w": w})
    got, want = step(params, opt_state, x), ref(rp, rs, x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()), got, want, is_leaf=_is_gt)


def test_create_with_uneven_splits():
    """A split that does not divide its dim (10 columns on 4 devices: 3, 3, 2, 2) is padded to the
    physical form inside the init program; the values equal the host-placed ones, and training
    (with a batch of 6 on 4 devices: 2, 2, 1, 1) gives the single-device losses."""
    pl = sj.placement(4, "x")

    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(6, 10, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    factory = lambda: sjf.annotate(Odd(nnx.Rngs(0)), {"fc.kernel": (S(1),)})  # noqa: E731
    born = sjf.Trainer.create(factory, optax.adam(0.1), loss_fn, pl, batch_sbp=(B,))
    host = sjf.Trainer(factory(), optax.adam(0.1), loss_fn, pl, batch_sbp=(B,))
    kernel = born.params["fc"]["kernel"]
    assert [x.shape for x in kernel.local_tensors().flat] == [(6, 3), (6, 3), (6, 2), (6, 2)]
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
        (born.params, born.opt_state),
        (host.params, host.opt_state),
        is_leaf=_is_gt,
    )
    np.testing.assert_array_equal(np.asarray(born.model().fc.kernel.get_value()), kernel.numpy())
    from conftest import nnx_single_device

    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(6, 6)).astype(np.float32), rng.normal(size=(6, 10)).astype(np.float32))]
    batches *= 3
    want, _ = nnx_single_device(factory(), optax.adam(0.1), loss_fn, batches)
    split = sjf.Trainer.create(factory, optax.adam(0.1), loss_fn, pl, batch_sbp=(S(0),))
    for b, w in zip(batches, want):
        assert_close(born.step(b), w, rtol=1e-5)
        assert_close(split.step(b), w, rtol=1e-5)


def test_a_factory_entering_set_mesh_is_told_to_enter_it_around_create():
    """A model annotated with logical names is built under jax.set_mesh and the
    rules, as MaxText does; inside the factory that is JAX's raw 'set_mesh can
    only be used outside of jax.jit'. Around Trainer.create it trains."""
    pl = sj.placement((2, 4), ("data", "model"))
    rules = [("embed", None), ("mlp", "model")]

    class Logical(nnx.Module):
        def __init__(self, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
            self.fc = nnx.Linear(6, 8, kernel_init=init, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    def inside():
        with jax.set_mesh(pl.mesh), nnx.logical_axis_rules(rules):
            return Logical(nnx.Rngs(0))

    with pytest.raises(sj.SBPError, match=r"enters jax.set_mesh.*around Trainer.create"):
        sjf.Trainer.create(inside, optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0), B))

    class Unplaced(nnx.Module):  # JAX's own error mentions set_mesh: it is left as JAX's
        def __init__(self):
            self.w = nnx.Param(jax.device_put(jnp.zeros(8), jax.sharding.PartitionSpec("model")))

        def __call__(self, x):
            return x * self.w[...]

    with pytest.raises(ValueError, match="set_mesh") as e:
        sjf.Trainer.create(Unplaced, optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0), B))
    assert not isinstance(e.value, sj.SBPError)
    with jax.set_mesh(pl.mesh), nnx.logical_axis_rules(rules):
        trainer = sjf.Trainer.create(
            lambda: Logical(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0), B)
        )
    assert trainer.params["fc"]["kernel"].sbp == (B, S(1))
    from conftest import nnx_single_device

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))] * 2
    with jax.set_mesh(pl.mesh), nnx.logical_axis_rules(rules):  # jax.jit's reference, on the same values
        want, _ = nnx_single_device(Logical(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, batches)
    for b, w in zip(batches, want):
        assert_close(trainer.step(b), w, rtol=1e-5)
