"""Trainer and TrainStep with layouts the solver chooses (``auto=True``,
``memory_budget=``, ``sj.AUTO`` parameters), against the single-device
program."""

import jax
import jax.numpy as jnp
import mlp_model
import numpy as np
import optax
import pytest
from conftest import assert_close, nnx_single_device
from flax import nnx
from mlp_model import loss_fn

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S
from sbpjax.compiler import pricing
from sbpjax.tensor import is_global

D, H, N = 16, 64, 16
PL = sj.placement((2, 4), ("x", "y"))
BATCH_SBP = (S(0), B)


def MLP(rngs):
    return mlp_model.MLP(rngs, D, H)


def data(seed=0, steps=3):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
        for _ in range(steps)
    ]


def assert_trains_as_one_device(trainer, optimizer, batches):
    losses = [trainer.step(b) for b in batches]
    want_losses, want_params = nnx_single_device(MLP(nnx.Rngs(0)), optimizer, loss_fn, batches)
    assert_close(losses, want_losses, rtol=1e-5)
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model(), nnx.Param)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(w).max())))


def state_bytes(trainer) -> int:
    return sum(trainer.state_bytes_per_device().values())


def chosen_param_layouts(trainer, batch):
    """The parameters' layouts the step's plan chose, as a tree like ``trainer.params``."""
    leaves, tree = jax.tree_util.tree_flatten(trainer.params, is_leaf=is_global)
    return jax.tree_util.tree_unflatten(tree, trainer.explain(batch).propagation.in_sbp[: len(leaves)])


def test_auto_keeps_the_annotations_and_chooses_the_rest():
    """``auto=True``: the annotated kernel keeps its layout, the solver lays out
    the rest; the step trains as the single-device program does, each step's
    state comes back in the chosen layouts, and the plan costs no more than
    the same model's data-parallel plan (B parameters)."""
    batches = data()
    model = sjf.annotate(MLP(nnx.Rngs(0)), {"fc1.kernel": (B, S(1))})
    auto = sjf.Trainer(model, optax.adamw(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP, auto=True)
    chosen = chosen_param_layouts(auto, batches[0])
    assert chosen["fc1"]["kernel"] == (B, S(1))
    # the solver splits the unannotated kernel too (Megatron's row split), not B as written
    assert chosen["fc2"]["kernel"] == (B, S(0))
    assert_trains_as_one_device(auto, optax.adamw(1e-2), batches)
    assert jax.tree.map(lambda t: t.sbp, auto.params, is_leaf=is_global) == chosen
    mu = auto.opt_state[0].mu
    assert jax.tree.map(lambda t: t.sbp, mu, is_leaf=is_global) == chosen  # mirrors its parameter
    plain = sjf.Trainer(
        sjf.annotate(MLP(nnx.Rngs(0)), {"fc1.kernel": (B, S(1))}),
        optax.adamw(1e-2),
        loss_fn,
        PL,
        batch_sbp=BATCH_SBP,
    )
    assert all(t.sbp == (B, B) for k, t in _named(plain.params) if k != "fc1.kernel")
    assert pricing.price(auto.explain(batches[0]).propagation) <= pricing.price(
        plain.explain(batches[0]).propagation
    )
    compiled = sum(c.bytes for c in sj.collectives(auto.lower(batches[0]).compile()))
    assert compiled == auto.explain(batches[0]).bytes


def _named(params):
    return [(f"{m}.{k}", t) for m, sub in params.items() for k, t in sub.items()]


def test_a_memory_budget_bounds_the_state_each_device_holds():
    """Under half the state data parallelism holds per device, the chosen
    layouts fit the budget and train as the single-device program; a budget
    no layout fits is refused before anything runs, naming the least."""
    batches = data(seed=1)
    dp = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP)
    budget = state_bytes(dp) // 2
    fit = sjf.Trainer(
        MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP, memory_budget=budget
    )
    assert_trains_as_one_device(fit, optax.adam(1e-2), batches)
    assert state_bytes(fit) <= budget < state_bytes(dp)
    tight = sjf.Trainer(
        MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP, memory_budget=64
    )
    with pytest.raises(sj.SBPError, match="least"):
        tight.step(batches[0])
    # refused before the state was consumed: the trainer still holds its parameters as placed
    assert not tight.params["fc1"]["kernel"].physical.is_deleted()
    assert tight.params["fc1"]["kernel"].sbp == sjf.spread_layout((D, H), PL)


def test_train_step_auto_parameters_come_back_in_the_chosen_layouts():
    """``TrainStep(param_sbp=sj.AUTO)`` on a plain pytree: the first step lays
    the B parameters out as chosen, and the next step gets them so (nothing
    re-laid out), with the loss of the plain optax loop."""
    rng = np.random.default_rng(2)
    params = {
        "w1": (rng.normal(size=(D, H)) / 4).astype(np.float32),
        "w2": (rng.normal(size=(H, D)) / 8).astype(np.float32),
    }
    x, y = data(seed=2, steps=1)[0]

    def loss(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    opt = optax.adam(1e-2)
    step = sjf.TrainStep(loss, opt, PL, sj.AUTO, (BATCH_SBP, BATCH_SBP))
    p, s = step.init(params)
    # placed split over both axes until the first step: no device holds more than its share
    assert [p["w1"].sbp, p["w2"].sbp] == [(S(0), S(0)), (S(0), S(0))]
    assert [s[0].mu["w1"].sbp, s[0].mu["w2"].sbp] == [(S(0), S(0)), (S(0), S(0))]
    chosen = step.explain(p, s, (x, y)).propagation.in_sbp[:2]
    want_p, want_s = params, opt.init(params)
    for _ in range(2):
        p, s, got = step(p, s, (x, y))
        assert [p["w1"].sbp, p["w2"].sbp] == chosen
        want, g = jax.value_and_grad(loss)(want_p, (x, y))
        u, want_s = opt.update(g, want_s, want_p)
        want_p = optax.apply_updates(want_p, u)
        assert float(got.numpy()) == pytest.approx(float(want), rel=1e-5)
    for k in params:
        np.testing.assert_allclose(p[k].numpy(), want_p[k], rtol=1e-4, atol=1e-6)


def test_settings_automatic_layouts_cannot_keep_are_refused():
    params = {"w": np.ones((D, D), np.float32)}
    loss = lambda p, b: jnp.mean(b @ p["w"])  # noqa: E731
    with pytest.raises(sj.SBPError, match="donate=True"):
        sjf.TrainStep(loss, optax.sgd(0.1), PL, sj.AUTO, BATCH_SBP, donate=False).init(params)
    with pytest.raises(sj.SBPError, match="Drop zero="):
        sjf.TrainStep(loss, optax.sgd(0.1), PL, None, BATCH_SBP, zero=True, memory_budget=1e6).init(params)
    with pytest.raises(sj.SBPError, match="Trainer: memory_budget"):
        sjf.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, PL, batch_sbp=BATCH_SBP, memory_budget=-1)
    with pytest.raises(sj.SBPError, match="Trainer: auto must be"):
        sjf.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, PL, batch_sbp=BATCH_SBP, auto="yes")


def test_a_born_sharded_trainer_takes_a_budget_too():
    """``Trainer.create`` with a budget: its unannotated parameters are born
    split over the placement (a kernel over both axes, the biases where they
    divide), then laid out under the budget at the first step, with the
    values of a Trainer given the built model."""
    batches = data(seed=3, steps=2)
    dp = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP)
    budget = state_bytes(dp) // 2
    born = sjf.Trainer.create(
        lambda: MLP(nnx.Rngs(0)), optax.adam(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP, memory_budget=budget
    )
    assert all(t.sbp == sjf.spread_layout(t.shape, PL) for _, t in _named(born.params))
    assert born.params["fc1"]["kernel"].sbp == (S(0), S(0))
    assert_trains_as_one_device(born, optax.adam(1e-2), batches)
    assert state_bytes(born) <= budget


def test_the_first_step_runs_with_the_state_held_once(monkeypatch):
    """With automatic layouts the state is born spread over the placement and
    the first step takes it in the layouts the solver chose. The trainer moves
    it leaf by leaf and frees each spread copy before the step runs
    (``Trainer._lay_out_as_chosen``); before, every leaf was re-laid out in the
    step's call while the trainer still held its spread copy: the state twice
    over at the first step. The steps still train as the single-device
    program does."""
    batches = data()
    trainer = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adamw(1e-2), loss_fn, PL, batch_sbp=BATCH_SBP, auto=True)
    born = jax.tree.leaves((trainer.params, trainer.opt_state), is_leaf=is_global)
    chosen = trainer.explain(batches[0]).propagation.in_sbp[: len(born)]
    moving = [t for t, nd in zip(born, chosen) if nd != t.sbp]
    assert len(moving) >= 4  # the kernels and their moments leave the spread layouts
    freed_at_call = []
    real = sjf.TrainStep.__call__

    def spy(self, params, opt_state, batch):
        freed_at_call.append([t.physical.is_deleted() for t in moving])
        return real(self, params, opt_state, batch)

    monkeypatch.setattr(sjf.TrainStep, "__call__", spy)
    assert_trains_as_one_device(trainer, optax.adamw(1e-2), batches)
    assert freed_at_call[0] == [True] * len(moving)
    held = jax.tree.leaves((trainer.params, trainer.opt_state), is_leaf=is_global)
    assert [t.sbp for t in held] == list(chosen)
