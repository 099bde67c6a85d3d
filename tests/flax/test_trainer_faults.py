"""Trainer.step is all or nothing: a step that fails leaves the trainer as it was."""

import jax
import jax.numpy as jnp
import mlp_model
import numpy as np
import optax
import pytest
from conftest import assert_close
from flax import nnx
from mlp_model import loss_fn

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S

D, H, N = 8, 16, 8


def MLP(rngs):
    return mlp_model.MLP(rngs, D, H)


def _trainer():
    model = sjf.annotate(MLP(nnx.Rngs(0)), {"fc1.kernel": (B, S(1)), "fc2.kernel": (B, S(0))})
    return sjf.Trainer(
        model, optax.adam(1e-2), loss_fn, sj.placement((2, 4), ("x", "y")), batch_sbp=(S(0), B)
    )


def _host(trainer):
    return jax.tree.map(
        lambda t: np.array(t.numpy()),
        (trainer.params, trainer.opt_state, trainer.state),
        is_leaf=lambda v: isinstance(v, sj.GlobalTensor),
    )


def test_a_step_whose_loss_cannot_be_read_changes_nothing(monkeypatch):
    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
    trainer, reference = _trainer(), _trainer()
    before = _host(trainer)
    read = sj.GlobalTensor.numpy

    def fail_on_the_loss(self):
        if self.shape == ():  # the loss (as a process that cannot see every device fails)
            raise sj.SBPError("numpy(): some devices of this placement belong to another process")
        return read(self)

    monkeypatch.setattr(sj.GlobalTensor, "numpy", fail_on_the_loss)
    with pytest.raises(sj.SBPError, match="another process"):
        trainer.step(batch)
    monkeypatch.setattr(sj.GlobalTensor, "numpy", read)
    jax.tree.map(np.testing.assert_array_equal, _host(trainer), before)
    # the retry is the first step, not the second
    assert trainer.step(batch) == reference.step(batch)
    jax.tree.map(np.testing.assert_array_equal, _host(trainer), _host(reference))


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            lambda m, b: (loss_fn(m, b), {"acc": 1.0}),
            r"returned a tuple of 2 values.*TrainStep\(\.\.\., has_aux=True\)",
        ),
        (lambda m, b: (m(b[0]) > 0).sum(), r"shape \(\) and dtype int32.*no gradient"),
        (lambda m, b: (m(b[0]) - b[1]) ** 2, r"shape \(8, 8\).*jnp.mean"),
    ],
    ids=["metrics", "integer", "per-element"],
)
def test_a_loss_that_is_not_one_float_is_refused_and_changes_nothing(bad, match):
    """Not a raw AttributeError, and not an integer loss cast to float and
    trained on zero gradients: an SBPError naming what loss_fn returned; the
    trainer keeps its state and trains with a good loss after it."""
    rng = np.random.default_rng(1)
    batch = (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
    pl = sj.placement((2, 4), ("x", "y"))
    model = sjf.annotate(MLP(nnx.Rngs(0)), {"fc1.kernel": (B, S(1)), "fc2.kernel": (B, S(0))})
    trainer = sjf.Trainer(model, optax.adam(1e-2), bad, pl, batch_sbp=(S(0), B), donate=False)
    before = _host(trainer)
    with pytest.raises(sj.SBPError, match=match):
        trainer.step(batch)
    jax.tree.map(np.testing.assert_array_equal, _host(trainer), before)
    step = sjf.TrainStep(lambda p, b: (jnp.sum(p["w"] * b), 1.0), optax.sgd(0.1), pl, None, (S(0), B))
    p, s = step.init({"w": np.ones((8, 8), np.float32)})
    with pytest.raises(sj.SBPError, match=r"tuple of 2 values.*pass has_aux=True"):
        step(p, s, batch[0])


def test_a_partial_parameter_layout_and_a_device_list_are_refused_by_name():
    pl = sj.placement((2, 4), ("x", "y"))
    layer = nnx.Linear(
        8, 6, kernel_init=sjf.with_sbp(nnx.initializers.lecun_normal(), (sj.P, B)), rngs=nnx.Rngs(0)
    )
    with pytest.raises(sj.SBPError, match=r"parameter \['kernel'\] is given the partial layout \(P, B\)"):
        sjf.Trainer(layer, optax.sgd(0.1), lambda m, b: (m(b) ** 2).mean(), pl, batch_sbp=(S(0), B))
    for make in (sjf.Trainer, lambda *a, **k: sjf.TrainStep(a[2], a[1], a[3], None, (S(0), B))):
        with pytest.raises(sj.SBPError, match="placement must be an sj.Placement, got list"):
            make(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, jax.devices(), batch_sbp=(S(0), B))


@pytest.mark.parametrize(
    "batch_sbp, match",
    [
        ((S(3), B), r"Trainer batch_sbp for batch\[0\] \(8, 8\): S\(3\) on placement axis 0 splits dim 3"),
    ],
    ids=["dim"],
)
def test_a_bad_batch_sbp_is_named_as_the_trainer_was_given_it(batch_sbp, match):
    """Named ``batch_sbp`` and ``batch[0]``, not the step's internal argument
    (``in_sbp of argument args[2][0][0]``); a layout that fits no batch (the
    wrong number of entries) is refused when the Trainer is built."""
    rng = np.random.default_rng(2)
    batch = (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
    pl = sj.placement((2, 4), ("x", "y"))
    trainer = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, pl, batch_sbp=batch_sbp)
    for call in (trainer.step, trainer.explain, trainer.lower):
        with pytest.raises(sj.SBPError, match=match):
            call(batch)
    with pytest.raises(sj.SBPError, match=r"Trainer batch_sbp: .* has 1 entries .* e\.g\. \(S\(0\), B\)"):
        sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, pl, batch_sbp=(S(0),))


def test_a_batch_the_loss_cannot_take_is_an_sbperror_and_changes_nothing():
    """A batch of the wrong width, rows or structure: the loss's own error
    (a TypeError or ValueError from tracing) as an SBPError naming the batch's
    shapes, its cause kept; the trainer then trains on a good batch as if
    nothing had happened."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32)
    trainer, reference = _trainer(), _trainer()
    before = _host(trainer)
    for bad, cause in (
        ((x[:, :6], y), TypeError),
        ((x, y[:4]), TypeError),
        ((x,), ValueError),
    ):  # x, y = batch
        with pytest.raises(sj.SBPError, match=r"loss_fn 'loss_fn' raised .* on a batch of shapes") as info:
            trainer.step(bad)
        assert isinstance(info.value.__cause__, cause)
        assert str(tuple(np.shape(bad[-1]))) in str(info.value)
    jax.tree.map(np.testing.assert_array_equal, _host(trainer), before)
    assert trainer.step((x, y)) == reference.step((x, y))


def test_an_auto_batch_trains_and_a_tracing_error_in_the_loss_stays_jaxs():
    """``batch_sbp=sj.AUTO`` leaves the batch's layout to the step (the batch
    check passes it by); a loss that branches on a traced value raises JAX's
    own error, not a batch-shaped SBPError."""
    rng = np.random.default_rng(4)
    batch = (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
    pl = sj.placement((2, 4), ("x", "y"))
    auto = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, pl, batch_sbp=sj.AUTO)
    given = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, pl, batch_sbp=(S(0), B))
    assert_close(auto.step(batch), given.step(batch), rtol=1e-6)

    def branching(model, b):
        return loss_fn(model, b) if b[0].sum() > 0 else 0.0

    bad = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), branching, pl, batch_sbp=(S(0), B))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        bad.step(batch)
