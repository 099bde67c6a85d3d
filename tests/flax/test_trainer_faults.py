"""Trainer.step is all or nothing: a step that fails leaves the trainer as it was."""

import jax
import mlp_model
import numpy as np
import optax
import pytest
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
