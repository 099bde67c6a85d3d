"""Donation: sj.jit(donate_argnums=...) and the train steps that donate parameters and optimizer state."""

import jax
import jax.numpy as jnp
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


RULES = {"fc1.kernel": (B, S(1)), "fc2.kernel": (B, S(0))}


def _pl():
    return sj.placement((2, 4), ("x", "y"))


def _batches(n=3):
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(N, D)).astype(np.float32), rng.normal(size=(N, D)).astype(np.float32))
        for _ in range(n)
    ]


def _is_gt(v):
    return isinstance(v, sj.GlobalTensor)


def test_jit_donate_argnums_aliases_the_donated_buffers_and_invalidates_them():
    pl = _pl()
    rng = np.random.default_rng(1)
    w0, x0 = rng.normal(size=(D, H)).astype(np.float32), rng.normal(size=(4, D)).astype(np.float32)

    def f(w, x):
        return w - 0.1 * jnp.sum(x @ w), jnp.sum(x @ w)

    kw = dict(placement=pl, out_sbp=((B, S(1)), (B, B)))
    plain, donating = sj.jit(f, **kw), sj.jit(f, **kw, donate_argnums=0)
    w, x = sj.to_global(w0, pl, (B, S(1))), sj.to_global(x0, pl, (S(0), B))
    compiled = donating.lower(w, x).compile()
    assert compiled.memory_analysis().alias_size_in_bytes == sjf.bytes_per_device(w) == D * H // 4 * 4
    assert plain.lower(w, x).compile().memory_analysis().alias_size_in_bytes == 0
    want = plain(w, x)
    got = donating(w, x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()), got, want, is_leaf=_is_gt)
    # the donated tensor is gone, the other argument is not
    np.testing.assert_array_equal(x.numpy(), x0)
    with pytest.raises(sj.SBPError, match="deleted"):
        w.numpy()
    with pytest.raises(sj.SBPError, match="deleted"):
        w.to_jax()
    with pytest.raises(sj.SBPError, match=r"args\[0\] .*donated to an earlier call"):
        donating(w, x)
    # an argument re-laid out before the call donates the copy: the tensor passed in stays valid
    w_b = sj.to_global(w0, pl, (B, B))
    donating(w_b, x)
    np.testing.assert_array_equal(w_b.numpy(), w0)


def test_jit_donate_argnums_errors():
    pl = _pl()
    with pytest.raises(sj.SBPError, match="non-negative ints"):
        sj.jit(lambda a: a, placement=pl, donate_argnums=(-1,))
    f = sj.jit(lambda a: a + 1, placement=pl, donate_argnums=(0, 2))
    with pytest.raises(sj.SBPError, match="names argument 2"):
        f(np.ones(4, np.float32))
    # one tensor passed as a donated and as a kept argument: refused (XLA would free
    # the buffer the call still reads; jax.jit crashes the process on CPU), and kept
    x = sj.to_global(np.arange(4, dtype=np.float32), pl, (S(0),) + (B,) * (pl.ndim - 1))
    g = sj.jit(lambda a, b: a + b, placement=pl, donate_argnums=(0,))
    with pytest.raises(sj.SBPError, match=r"args\[0\], which is donated.*and as args\[1\]"):
        g(x, x)
    np.testing.assert_array_equal(x.numpy(), np.arange(4))
    np.testing.assert_array_equal(
        g(x, sj.to_global(np.ones(4, np.float32), pl, x.sbp)).numpy(), np.arange(4) + 1
    )


def _trainer(donate, **options):
    model = sjf.annotate(MLP(nnx.Rngs(0)), RULES)
    return sjf.Trainer(model, optax.adam(1e-2), loss_fn, _pl(), batch_sbp=(S(0), B), donate=donate, **options)


@pytest.mark.parametrize("zero", [False, True], ids=["dp_tp", "zero"])
def test_trainer_donates_parameters_and_optimizer_state(zero):
    trainer, plain = _trainer(True, zero=zero), _trainer(False, zero=zero)
    batches = _batches()
    g = lambda b: tuple(sj.to_global(v, _pl(), (S(0), B)) for v in b)  # noqa: E731
    state_bytes = sjf.bytes_per_device(trainer.params) + sjf.bytes_per_device(trainer.opt_state)
    memory = trainer.lower(g(batches[0])).compile().memory_analysis()
    assert memory.alias_size_in_bytes == state_bytes
    assert plain.lower(g(batches[0])).compile().memory_analysis().alias_size_in_bytes == 0
    before = (trainer.params, trainer.opt_state)
    losses = [trainer.step(b) for b in batches]
    assert losses == [plain.step(b) for b in batches]  # the same program but for the aliasing
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
        (trainer.params, trainer.opt_state, trainer.state),
        (plain.params, plain.opt_state, plain.state),
        is_leaf=_is_gt,
    )
    # what the first step was given is consumed
    for t in jax.tree.leaves(before, is_leaf=_is_gt):
        with pytest.raises(sj.SBPError, match="donated"):
            t.numpy()


def test_a_bad_batch_leaves_a_donating_trainer_as_it_was():
    trainer, reference = _trainer(True), _trainer(True)
    batch = _batches(1)[0]
    for bad in [(batch[0][:, :3], batch[1]), (batch[0], batch[1][:, :3])]:  # wrong input, wrong target
        with pytest.raises(Exception):  # noqa: B017 (a trace or layout error, before the step runs)
            trainer.step(bad)
    assert trainer.step(batch) == reference.step(batch)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a.numpy(), b.numpy()),
        (trainer.params, trainer.opt_state),
        (reference.params, reference.opt_state),
        is_leaf=_is_gt,
    )


def test_train_step_donation_and_opting_out():
    pl = _pl()
    params = {"w": np.ones((D, H), np.float32)}

    def loss(p, b):
        return jnp.mean((b @ p["w"]) ** 2)

    x = np.random.default_rng(2).normal(size=(N, D)).astype(np.float32)
    step = sjf.TrainStep(loss, optax.sgd(0.1), pl, {"w": (B, S(1))}, (S(0), B))
    gp, gs = step.init(params)
    new_p, new_s, _ = step(gp, gs, x)
    with pytest.raises(sj.SBPError, match="donated"):
        step(gp, gs, x)
    step(new_p, new_s, x)
    keep = sjf.TrainStep(loss, optax.sgd(0.1), pl, {"w": (B, S(1))}, (S(0), B), donate=False)
    kp, ks = keep.init(params)
    first = keep(kp, ks, x)
    again = keep(kp, ks, x)  # the same state twice: allowed without donation
    np.testing.assert_array_equal(first[2].numpy(), again[2].numpy())
