"""Training with sbpjax.flax equals the single-device program; ZeRO and bf16 compute."""

import jax
import jax.numpy as jnp
import mlp_model
import numpy as np
import optax
import pytest
from conftest import assert_close, nnx_single_device
from flax import linen as nn
from flax import nnx
from mlp_model import loss_fn

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S
from sbpjax.compiler import pricing

D, H, N = 16, 64, 16


def MLP(rngs):
    return mlp_model.MLP(rngs, D, H)


def data(seed=0, steps=3, n=N):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(n, D)).astype(np.float32), rng.normal(size=(n, D)).astype(np.float32))
        for _ in range(steps)
    ]


def reference(optimizer, batches):
    """The single-device NNX program: losses and final parameters."""
    return nnx_single_device(MLP(nnx.Rngs(0)), optimizer, loss_fn, batches)


def trained(trainer):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model(), nnx.Param)))


def assert_same_training(trainer, optimizer, batches):
    losses = [trainer.step(b) for b in batches]
    ref_losses, ref_params = reference(optimizer, batches)
    assert_close(losses, ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(trained(trainer)), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


LAYOUTS = {
    # name: (placement shape, axis names, parameter rules, batch layout)
    "data": ((8,), ("x",), {}, (S(0),)),
    "tensor": ((8,), ("x",), {"fc1.kernel": (S(1),), "fc1.bias": (S(0),), "fc2.kernel": (S(0),)}, (B,)),
    "2d": (
        (2, 4),
        ("x", "y"),
        {"fc1.kernel": (B, S(1)), "fc1.bias": (B, S(0)), "fc2.kernel": (B, S(0))},
        (S(0), B),
    ),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "make_opt", [lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adamw(1e-2)], ids=["sgd", "adamw"]
)
def test_training_equals_single_device(name, make_opt):
    shape, names, rules, batch_sbp = LAYOUTS[name]
    pl = sj.placement(shape, names)
    model = MLP(nnx.Rngs(0))
    sjf.annotate(model, rules)
    trainer = sjf.Trainer(model, make_opt(), loss_fn, pl, batch_sbp=batch_sbp)
    # optimizer state takes its parameter's layout
    mu = trainer.opt_state[0].trace if hasattr(trainer.opt_state[0], "trace") else trainer.opt_state[0].mu
    for k, rule in rules.items():
        mod, leaf = k.split(".")
        assert trainer.params[mod][leaf].sbp == rule
        assert mu[mod][leaf].sbp == rule
    assert_same_training(trainer, make_opt(), data())


class NormDropNet(nnx.Module):
    """State the forward pass updates: BatchNorm statistics and a dropout RNG."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(D, H, rngs=rngs)
        self.bn = nnx.BatchNorm(H, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.fc2 = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(jax.nn.relu(self.bn(self.fc1(x)))))


@pytest.mark.parametrize("name", ["data", "2d"])
def test_batchnorm_statistics_and_dropout_keys_follow_the_single_device_program(name):
    shape, names, rules, batch_sbp = LAYOUTS[name]
    pl = sj.placement(shape, names)
    trainer = sjf.Trainer(
        sjf.annotate(NormDropNet(nnx.Rngs(0)), rules), optax.sgd(0.1), loss_fn, pl, batch_sbp=batch_sbp
    )
    batches = data(n=64)
    reference = NormDropNet(nnx.Rngs(0))
    ref_losses, ref_params = nnx_single_device(reference, optax.sgd(0.1), loss_fn, batches)
    assert_close([trainer.step(b) for b in batches], ref_losses, rtol=1e-5)
    trained = trainer.model()
    for got, want in zip(
        jax.tree.leaves(nnx.to_pure_dict(nnx.state(trained, nnx.Param))), jax.tree.leaves(ref_params)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    # the running statistics moved (3 updates of momentum 0.8) and equal the reference's
    got_stats = nnx.to_pure_dict(nnx.state(trained, nnx.BatchStat))
    want_stats = nnx.to_pure_dict(nnx.state(reference, nnx.BatchStat))
    assert np.abs(np.asarray(got_stats["bn"]["mean"])).max() > 1e-3
    for k in ("mean", "var"):
        np.testing.assert_allclose(got_stats["bn"][k], want_stats["bn"][k], rtol=1e-5, atol=1e-6)
    # the dropout stream advanced once per step, from the same key
    assert int(trained.drop.rngs.count[...]) == int(reference.drop.rngs.count[...]) == 3
    assert trainer.state["bn"]["mean"].sbp == (B,) * pl.ndim


def test_measured_bytes_equal_the_plan():
    pl = sj.placement((2, 4), ("x", "y"))
    model = MLP(nnx.Rngs(0))
    sjf.annotate(model, LAYOUTS["2d"][2])
    trainer = sjf.Trainer(model, optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0), B))
    batch = data(steps=1)[0]
    compiled = trainer.lower(batch).compile()
    assert sum(c.bytes for c in sj.collectives(compiled)) == trainer.explain(batch).bytes > 0


def test_zero_splits_master_weights_and_state_and_trains_the_same(monkeypatch):
    pl = sj.placement(8, "x")
    # 256 rows: activations outweigh the weights, so reduce-scattering gradients
    # (OneFlow Fig. 14) is the cheapest plan; with 16 rows gathering the
    # (16, 64) activations moves fewer bytes, in more collectives
    batches = data(n=256)
    dp = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0),))
    zero = sjf.Trainer(MLP(nnx.Rngs(0)), optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0),), zero=True)
    # OneFlow Fig. 14: master weights and optimizer state S(0) over the data axis
    for mod in ("fc1", "fc2"):
        for leaf in ("kernel", "bias"):
            assert zero.params[mod][leaf].sbp == (S(0),)
            assert zero.opt_state[0].mu[mod][leaf].sbp == (S(0),)
            assert zero.opt_state[0].nu[mod][leaf].sbp == (S(0),)
    assert zero.opt_state[0].count.sbp == (B,)
    ref_losses, _ = reference(optax.adamw(1e-2), batches)
    assert_close([zero.step(b) for b in batches], ref_losses, rtol=1e-5)
    assert_close([dp.step(b) for b in batches], ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(trained(zero)), jax.tree.leaves(trained(dp))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    z, d = zero.state_bytes_per_device(), dp.state_bytes_per_device()
    n_params = 2 * D * H + H + D
    assert d["params"] == 4 * n_params and z["params"] == d["params"] // 8
    assert z["opt_state"] <= d["opt_state"] / 8 + 64  # + the step count, replicated
    # gradients are reduce-scattered, never all-reduced whole; weights all-gathered
    ops = {}
    for c in sj.collectives(zero.lower(batches[0]).compile()):
        ops[c.op] = ops.get(c.op, 0) + c.bytes
    assert ops.get("reduce-scatter", 0) == 7 * 4 * n_params and ops.get("all-gather", 0) == 7 * 4 * n_params
    assert ops.get("all-reduce", 0) <= 2 * 7 * 4 * 8  # only the scalar loss (and nothing parameter-sized)
    # With 16 rows, priced by bytes alone, the compiler gathers the activations
    # (fewer bytes than Fig. 14's plan); with each collective's latency priced
    # too (the default, CompileOptions.latency), Fig. 14's two
    # collectives per parameter cost less than the gathers' extra ones.
    small = data()[0]
    fig14 = 2 * 7 * 4 * n_params  # a reduce-scatter and an all-gather of every parameter
    measured = sum(c.bytes for c in sj.collectives(zero.lower(small).compile()))
    kept = zero.explain(small)
    assert measured == kept.bytes <= fig14 + 2 * 7 * 4 * 8  # + the loss's all-reduce
    by_bytes = sjf.Trainer(
        MLP(nnx.Rngs(0)),
        optax.adamw(1e-2),
        loss_fn,
        pl,
        batch_sbp=(S(0),),
        zero=True,
        options=sj.CompileOptions(latency=False),
    )
    gathered = by_bytes.explain(small)
    assert sum(c.bytes for c in sj.collectives(by_bytes.lower(small).compile())) == gathered.bytes < fig14
    assert pricing.price(kept.propagation) <= pricing.price(gathered.propagation)


def test_bf16_compute_keeps_fp32_master_and_gathers_bf16():
    pl = sj.placement(8, "x")
    batch = data(steps=1)[0]
    trainer = sjf.Trainer(
        MLP(nnx.Rngs(0)),
        optax.sgd(0.1),
        loss_fn,
        pl,
        batch_sbp=(S(0),),
        zero=True,
        compute_dtype=jnp.bfloat16,
    )
    gathers = [b for b in trainer.explain(batch).boxings if b.src == (S(0),) and b.dst == (B,)]
    assert gathers and all(np.dtype(b.plan.dtype) == jnp.bfloat16 for b in gathers)
    loss = trainer.step(batch)
    assert all(
        t.dtype == np.float32
        for t in jax.tree.leaves(trainer.params, is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
    )

    # the single-device program with the same casts
    model = MLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def ref_loss(p):
        s = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(s, jax.tree.map(lambda v: v.astype(jnp.bfloat16), p))
        return loss_fn(nnx.merge(graphdef, s), batch).astype(jnp.float32)

    params = nnx.to_pure_dict(state)
    want, grads = jax.jit(jax.value_and_grad(ref_loss))(params)
    # bf16 keeps 8 bits of mantissa: sums in another order differ in the third digit
    assert_close(loss, float(want), rtol=2e-2)
    new = trained(trainer)
    for got, p, g in zip(jax.tree.leaves(new), jax.tree.leaves(params), jax.tree.leaves(grads)):
        step = np.asarray(p) - 0.1 * np.asarray(g)
        np.testing.assert_allclose(got, step, atol=0.1 * 2e-2 * np.abs(np.asarray(g)).max() + 1e-7)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(H, kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (B, S(1))))(x)
        return nn.Dense(D, kernel_init=sjf.linen.with_sbp(nn.initializers.lecun_normal(), (B, S(0))))(
            jax.nn.gelu(x)
        )


def test_linen_train_step_equals_single_device():
    pl = sj.placement((2, 4), ("x", "y"))
    batches = data()
    variables = LinenMLP().init(jax.random.key(0), batches[0][0])
    params = sjf.linen.unbox(variables["params"])

    def loss(p, batch):
        x, y = batch
        return jnp.mean((LinenMLP().apply({"params": p}, x) - y) ** 2)

    step = sjf.TrainStep(loss, optax.adamw(1e-2), pl, sjf.linen.get_sbp(variables["params"], pl), (S(0), B))
    gp, gs = step.init(params)
    assert gp["Dense_0"]["kernel"].sbp == (B, S(1))
    losses = []
    for b in batches:
        gp, gs, value = step(gp, gs, b)
        losses.append(float(value.numpy()))
    opt = optax.adamw(1e-2)
    p, s = params, opt.init(params)
    ref = []
    for b in batches:
        value, g = jax.value_and_grad(loss)(p, b)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
        ref.append(float(value))
    assert_close(losses, ref, rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(gp, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)), jax.tree.leaves(p)
    ):
        np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "grid, batch_sbp, stored",
    [
        (8, S(0), (S(0),)),
        (8, "S(0)", (S(0),)),
        (8, (S(0), S(0)), (S(0),)),
        (8, ((S(0),), "S(0)"), (S(0),)),
        ((2, 4), "B, S(0)", (B, S(0))),
        ((2, 4), ((B, S(0)), "B, S(0)"), (B, S(0))),
    ],
)
def test_zero_finds_the_data_axis_in_each_way_batch_sbp_is_written(grid, batch_sbp, stored):
    """A bare SBP, its text, or one per batch leaf (a bare SBP on a 1-D
    placement, as sj.jit's in_sbp reads them): each names the batch's axis."""
    pl = sj.placement(grid, ("x",) if grid == 8 else ("x", "y"))
    trainer = sjf.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, pl, batch_sbp=batch_sbp, zero=True)
    assert trainer.params["fc1"]["kernel"].sbp == stored


def test_errors():
    pl = sj.placement(8, "x")
    step = sjf.TrainStep(lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), pl, None, (S(0),))
    with pytest.raises(sj.SBPError, match=r"call step.init\(params\) first"):
        step({"w": 1.0}, None, np.ones(8, np.float32))
    with pytest.raises(sj.SBPError, match="zero=True needs a data axis"):
        sjf.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, pl, batch_sbp=(B,), zero=True)
    with pytest.raises(sj.SBPError, match="the placement's axes are"):
        sjf.Trainer(MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0),), zero="data")
    with pytest.raises(sj.SBPError, match=r"zero_layout: axis 5 is out of range .* give 0..0"):
        sjf.zero_layout((B,), (8, 6), pl, 5)
    pl24 = sj.placement((2, 4), ("x", "y"))
    assert sjf.zero_layout((B, B), (8, 8), pl24, -1) == sjf.zero_layout((B, B), (8, 8), pl24, 1) == (B, S(0))
    # a bad solve_time_limit is refused before the optimizer state is built
    inits = []
    sgd = optax.sgd(0.1)
    counted = optax.GradientTransformation(lambda p: inits.append(1) or sgd.init(p), sgd.update)
    with pytest.raises(
        sj.SBPError, match="TrainStep: solve_time_limit must be a positive number of seconds, got 0"
    ):
        sjf.Trainer(MLP(nnx.Rngs(0)), counted, loss_fn, pl, batch_sbp=(S(0),), solve_time_limit=0)
    with pytest.raises(sj.SBPError, match="solve_time_limit must be a positive number of seconds, got -1"):
        sjf.Trainer.create(
            lambda: MLP(nnx.Rngs(0)), counted, loss_fn, pl, batch_sbp=(S(0),), solve_time_limit=-1
        )
    with pytest.raises(sj.SBPError, match="solve_time_limit must be a positive number of seconds, got '10'"):
        sjf.TrainStep(lambda p, b: p["w"].sum(), sgd, pl, None, (B,), solve_time_limit="10")
    # and so is a bad regather; a good one reaches the step's sj.jit
    with pytest.raises(sj.SBPError, match="TrainStep: regather must be True, False or 'auto', got 'no'"):
        sjf.Trainer(MLP(nnx.Rngs(0)), counted, loss_fn, pl, batch_sbp=(S(0),), regather="no")
    with pytest.raises(sj.SBPError, match="regather must be True, False or 'auto', got None"):
        sjf.Trainer.create(lambda: MLP(nnx.Rngs(0)), counted, loss_fn, pl, batch_sbp=(S(0),), regather=None)
    assert inits == []
    held = sjf.TrainStep(lambda p, b: jnp.sum(p["w"] * b), sgd, pl, None, (S(0),), regather=False)
    held.init({"w": np.ones(8, np.float32)})
    assert held._fn.regather is False
    with pytest.raises(sj.SBPError, match="param_sbp does not match"):
        sjf.TrainStep(lambda p, b: p["w"].sum(), optax.sgd(0.1), pl, {"v": (B,)}, (B,)).init(
            {"w": np.ones(8, np.float32)}
        )


@pytest.mark.parametrize("layout", ["same", "2d_to_data", "zero_to_tensor"])
def test_checkpoint_resume_gives_the_same_losses(tmp_path, layout):
    """Save after two steps, restore into a fresh Trainer (same or another
    placement and layout), and the next steps' losses are those of the run
    that never stopped: bit-identical on the same layout, equal to fp32
    rounding on another (sums run in another order)."""
    batches = data(steps=4)
    src_name, dst_name = {
        "same": ("2d", "2d"),
        "2d_to_data": ("2d", "data"),
        "zero_to_tensor": ("data", "tensor"),
    }[layout]

    def make(name, zero=False):
        shape, names, rules, batch_sbp = LAYOUTS[name]
        model = MLP(nnx.Rngs(0))
        sjf.annotate(model, rules)
        return sjf.Trainer(
            model, optax.adamw(1e-2), loss_fn, sj.placement(shape, names), batch_sbp=batch_sbp, zero=zero
        )

    run = make(src_name, zero=layout == "zero_to_tensor")
    for b in batches[:2]:
        run.step(b)
    run.save(tmp_path / "ckpt")
    continued = [run.step(b) for b in batches[2:]]
    resumed = make(dst_name)
    resumed.restore(tmp_path / "ckpt")
    assert resumed.params["fc1"]["kernel"].sbp == LAYOUTS[dst_name][2].get(
        "fc1.kernel", (B,) * len(LAYOUTS[dst_name][0])
    )
    again = [resumed.step(b) for b in batches[2:]]
    if layout == "same":
        assert again == continued
    else:
        assert_close(again, continued, rtol=1e-6)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.adafactor(1e-2),
        lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    ],
    ids=["adafactor", "clipped_adamw"],
)
def test_factored_and_clipped_optimizers_equal_single_device(make_opt):
    """Adafactor's factored second moments (one dim fewer than their kernel,
    or a one-element placeholder) take what they have of its layout (they
    took the kernel's whole nd-SBP before, an SBPError); a global-norm clip
    sums partial squared norms across every parameter."""
    shape, names, rules, batch_sbp = LAYOUTS["2d"]
    pl = sj.placement(shape, names)
    model = MLP(nnx.Rngs(0))
    sjf.annotate(model, rules)
    trainer = sjf.Trainer(model, make_opt(), loss_fn, pl, batch_sbp=batch_sbp)
    assert_same_training(trainer, make_opt(), data())


class _Sowing(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.fc1(x))
        self.sow(nnx.Intermediate, "hidden_norm", jnp.sqrt((h**2).mean()))
        return self.fc2(h)


def _sowing_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("build", ["model", "create"])
@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside:DeprecationWarning")  # flax 0.12's
def test_values_a_model_sows_are_dropped_between_steps(build):
    """``sow`` adds an nnx.Intermediate on the first call and appends to it
    after. Before, the first step's state gained it, and every later step and
    ``model()`` raised a pytree-structure ValueError. Losses are those of
    plain SGD on one device."""
    pl = sj.placement(8, "x")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 16)).astype(np.float32)
    opt = optax.sgd(0.1)
    if build == "model":
        model = _Sowing(nnx.Rngs(0))
        model(x)  # an intermediate sown before the trainer sees the model
        trainer = sjf.Trainer(model, opt, _sowing_loss, pl, batch_sbp=(S(0), S(0)))
    else:
        trainer = sjf.Trainer.create(
            lambda: _Sowing(nnx.Rngs(0)), opt, _sowing_loss, pl, batch_sbp=(S(0), S(0))
        )
    ref = _Sowing(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, opt, wrt=nnx.Param)

    @nnx.jit
    def ref_step(m, o):
        def loss(m):
            value = _sowing_loss(m, (x, y))
            nnx.pop(m, nnx.Intermediate)
            return value

        value, grads = nnx.value_and_grad(loss)(m)
        o.update(m, grads)
        return value

    for _ in range(3):
        assert_close(trainer.step((x, y)), float(ref_step(ref, ref_opt)), rtol=1e-5)
    assert not jax.tree.leaves(nnx.state(trainer.model(), nnx.Intermediate))


def test_an_integer_param_is_named():
    class Counting(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 16, rngs=rngs)
            self.steps = nnx.Param(jnp.zeros((), jnp.int32))  # a counter kept as a Param by mistake

        def __call__(self, x):
            return self.fc(x) + self.steps[...].astype(jnp.float32)

    with pytest.raises(
        sj.SBPError, match=r"parameter \['steps'\] of Counting is an nnx.Param of dtype int32"
    ):
        sjf.Trainer(
            Counting(nnx.Rngs(0)), optax.sgd(0.1), _sowing_loss, sj.placement(8, "x"), batch_sbp=(S(0), S(0))
        )


def test_a_batch_leaf_that_is_not_numbers_is_named_as_the_trainers_batch():
    """Before, the step's own check named its internal argument (``args[2][0][0]``)
    and offered ``static_argnames``, which a Trainer user cannot pass."""
    trainer = sjf.Trainer(
        MLP(nnx.Rngs(0)), optax.sgd(0.1), loss_fn, sj.placement(8, "x"), batch_sbp=(S(0), S(0))
    )
    x, y = data(steps=1)[0]
    with pytest.raises(sj.SBPError, match=r"Trainer: batch\[0\] is a ndarray of dtype <U"):
        trainer.step((x.astype(str), y))
    assert np.isfinite(trainer.step((x, y)))  # nothing was half-done
