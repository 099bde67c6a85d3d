"""The Flax examples: each model trained on 8 devices equals the single-device
program, and each example runs (small settings) and prints what it claims."""

import os
import re

import jax
import numpy as np
import optax
import pytest
from conftest import assert_close, load_module, nnx_single_device, run_script
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_example(name):
    """An example file as a module (examples/ is not a package)."""
    return load_module(os.path.join(ROOT, "examples", f"{name}.py"), f"examples_{name}")


def assert_same_training(build, optimizer, loss_fn, batches, placement, batch_sbp, **trainer_options):
    """``build()`` twice (same seed): trained by sjf.Trainer on ``placement`` and
    by the single-device program; losses and parameters agree to fp32 rounding.
    Returns the trainer."""
    trainer = sjf.Trainer(build(), optimizer, loss_fn, placement, batch_sbp=batch_sbp, **trainer_options)
    losses = [trainer.step(b) for b in batches]
    ref_losses, ref_params = nnx_single_device(build(), optimizer, loss_fn, batches)
    assert_close(losses, ref_losses, rtol=1e-5)
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model(), nnx.Param)))
    assert jax.tree.structure(got) == jax.tree.structure(ref_params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    return trainer


# -- each example's model equals the single-device run ---------------------------


def test_data_parallel_equals_single_device(pl8):
    ex = load_example("data_parallel")
    (x, y), _ = ex.load_digits()
    data = ex.batches(x, y, batch=64)
    batches = [next(data) for _ in range(3)]
    assert_same_training(
        lambda: ex.build(hidden=32), optax.sgd(0.1, momentum=0.9), ex.loss_fn, batches, pl8, ex.BATCH_SBP
    )
    # the example's step (Adam): parameters B, so each gradient comes out P(sum)
    # and is all-reduced, once; the loss is the only other all-reduce
    trainer = sjf.Trainer(ex.build(hidden=32), optax.adam(3e-3), ex.loss_fn, pl8, batch_sbp=ex.BATCH_SBP)
    boxings = trainer.explain(batches[0]).boxings
    all_reduces = [b for b in boxings if [s.op for s in b.plan.steps] == ["all_reduce"]]
    assert len(all_reduces) == len(jax.tree.leaves(trainer.params)) + 1
    assert all(b.src == (sj.P,) for b in all_reduces)


def test_model_parallel_classifier_equals_single_device(pl8):
    ex = load_example("model_parallel_classifier")
    data = ex.Identities(classes=1024, dim=16, noise=0.5)
    batches = [data.sample(64) for _ in range(3)]
    trainer = assert_same_training(
        lambda: ex.build(16, 32, 32, 1024),
        optax.sgd(0.1, momentum=0.9),
        ex.loss_fn,
        batches,
        pl8,
        ex.BATCH_SBP,
    )
    assert trainer.params["classes"].sbp == (sj.S(1),)


def test_model_parallel_classifier_moves_no_logits(pl8):
    """OneFlow's Fig. 11: the logits stay split by class; what moves is
    batch-sized (the partial max and sum, the features) or backbone-sized."""
    ex = load_example("model_parallel_classifier")
    batch_size, classes = 64, 1024
    data = ex.Identities(classes=classes, dim=16, noise=0.5)
    trainer = sjf.Trainer(
        ex.build(16, 32, 32, classes), optax.adam(1e-2), ex.loss_fn, pl8, batch_sbp=ex.BATCH_SBP
    )
    batch = data.sample(batch_size)
    collectives = ex.step_collectives(trainer, batch)
    logits_bytes = batch_size * classes * 4
    # Any boxing of the logits (all-gather, all-reduce, reduce-scatter) makes
    # some device receive at least 7/8 of them, so bound each collective by one
    # device's share (1/8); the only cheaper move, an all-to-all, must not appear.
    assert max(c.bytes_per_device for c in collectives) < logits_bytes / 8
    assert not [c for c in collectives if c.op == "all-to-all"]
    # the partial max and sum: all-reduces of one number per example (the max
    # travels as int32 keys in IEEE total order, so NaN survives it: s32)
    per_example = [
        c
        for c in collectives
        if c.op == "all-reduce"
        and c.shape.split("{")[0]
        in (f"f32[{batch_size}]", f"s32[{batch_size},1]", f"f32[{batch_size},1]", f"s32[{batch_size}]")
    ]
    assert sorted(c.dtype for c in per_example) == ["f32", "s32"], per_example
    # and the compiled program is the plan
    assert sum(c.bytes for c in collectives) == trainer.explain(batch).bytes


def test_wide_and_deep_equals_single_device(pl8):
    ex = load_example("wide_and_deep")
    data = ex.Clicks(fields=8, vocab_per_field=64)
    batches = [data.sample(64)[:2] for _ in range(3)]
    trainer = assert_same_training(
        lambda: ex.build(8, 64, 16, 32), optax.sgd(0.1, momentum=0.9), ex.loss_fn, batches, pl8, ex.BATCH_SBP
    )
    assert trainer.params["wide"]["embedding"].sbp == (sj.S(0),)
    assert trainer.params["deep"]["embedding"].sbp == (sj.S(1),)


def test_auc_matches_pairwise_count():
    ex = load_example("wide_and_deep")
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=200).astype(np.float32)  # many ties
    labels = (rng.random(200) < 0.4).astype(np.float32)
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert ex.auc(scores, labels) == pytest.approx(pairwise)


@pytest.mark.parametrize("zero", [False, True], ids=["data_parallel", "zero"])
def test_zero_example_equals_single_device(pl8, zero):
    ex = load_example("zero")
    shape = (16, 64, 2, 16)
    teacher = ex.Teacher(*shape)
    batches = [teacher.sample(32) for _ in range(3)]
    trainer = assert_same_training(
        lambda: ex.build(*shape), optax.adam(1e-2), ex.loss_fn, batches, pl8, ex.BATCH_SBP, zero=zero
    )
    if zero:
        dp = sjf.Trainer(ex.build(*shape), optax.adam(1e-2), ex.loss_fn, pl8, batch_sbp=ex.BATCH_SBP)
        z, d = trainer.state_bytes_per_device(), dp.state_bytes_per_device()
        assert z["params"] * 8 == d["params"]  # every dim 0 of this model divides by 8
        assert z["opt_state"] <= d["opt_state"] / 8 + 64  # + Adam's step count, replicated


# -- the examples run ---------------------------------------------------------------


def run_example(name, *args, timeout=600):
    return run_script([f"examples/{name}.py", *args], timeout).stdout


def falling_loss(out):
    first, last = map(
        float, re.search(r"loss: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", out).groups()
    )
    return first, last


@pytest.mark.slow
def test_data_parallel_runs():
    out = run_example("data_parallel", "--steps", "200")
    assert "all_reduce" in out
    first, last = falling_loss(out)
    assert last < first / 5
    assert float(re.search(r"test ([\d.]+)%", out).group(1)) > 90


@pytest.mark.slow
def test_model_parallel_classifier_runs():
    # a backbone small next to the logits, so its gradient all-reduce stays
    # under one device's share of them (the bound below)
    out = run_example(
        "model_parallel_classifier",
        "--classes",
        "2048",
        "--hidden",
        "64",
        "--features",
        "64",
        "--steps",
        "300",
        "--batch",
        "128",
    )
    first, last = falling_loss(out)
    assert last < first / 2
    assert (
        float(re.search(r"largest collective: \d+ B per device, ([\d.]+)% of the logits", out).group(1))
        < 12.5
    )
    assert float(re.search(r"accuracy on fresh examples: ([\d.]+)%", out).group(1)) > 30  # chance: 0.05%


@pytest.mark.slow
def test_wide_and_deep_runs():
    out = run_example("wide_and_deep", "--steps", "200")
    first, last = falling_loss(out)
    assert last < first
    model_auc, true_auc = map(
        float, re.search(r"held-out AUC ([\d.]+) \(true probabilities: ([\d.]+)\)", out).groups()
    )
    assert 0.7 < model_auc <= true_auc + 0.01


@pytest.mark.slow
def test_zero_runs():
    out = run_example("zero", "--steps", "30", "--bf16", "--budget", "0.5")
    ratios = dict(re.findall(r"^  (ZeRO(?: \+ bf16)?|budget 0.5x) +\d+ +\d+ +\d+ +([\d.]+)$", out, re.M))
    assert float(ratios["ZeRO"]) < 0.13 and float(ratios["ZeRO + bf16"]) < 0.13
    assert float(ratios["budget 0.5x"]) <= 0.5  # the solver's layouts fit the budget's state share
    budgeted = float(
        re.search(r"budget 0.5x vs data parallel: largest relative difference ([\d.e+-]+)", out).group(1)
    )
    assert budgeted < 1e-5
    # the same sums in another order (a reduce-scatter where data parallel all-reduces): float32 rounding
    fp32 = float(re.search(r"ZeRO vs data parallel: largest relative difference ([\d.e+-]+)", out).group(1))
    assert fp32 < 1e-5
    bf16 = float(
        re.search(r"ZeRO \+ bf16 vs data parallel: largest relative difference ([\d.e+-]+)", out).group(1)
    )
    assert bf16 < 2e-2  # bf16 keeps 8 bits of mantissa
