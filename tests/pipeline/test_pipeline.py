"""Pipelined training steps against the non-pipelined step on the whole batch."""

import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pipeline_helpers import MB, D, assert_close, batch, host, layer, layer_params, mse, reference_step

import sbpjax as sj
import sbpjax.flax as sjf
import sbpjax.pipeline as sjp
from sbpjax.dtypes import is_key


def mlp(p, x):  # Megatron's MLP: column-parallel w1, row-parallel w2 under 2-way TP
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


@pytest.fixture(scope="module")
def one_device_stages():
    rng = np.random.default_rng(0)
    devs = jax.devices()
    return {
        n: [
            sjp.Stage(layer, layer_params(rng), sj.Placement(np.array([devs[i]]), ("d",)), name=f"layer{i}")
            for i in range(n)
        ]
        for n in (2, 4)
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("n", [2, 4])
def test_step_equals_the_whole_batch_step(one_device_stages, n, schedule):
    stages = one_device_stages[n]
    opt = optax.sgd(0.1)
    for m in range(1, 9):  # m < p included: gradient accumulation over fewer microbatches than stages
        x, y = batch(m, seed=m)
        before = [host(st.params) for st in stages]
        want_loss, want_grads, want_params, _ = reference_step([layer] * n, before, x, y, opt)
        pipe = sjp.Pipeline(stages, mse, opt, microbatches=m, schedule=schedule)
        result = pipe.step(x, y)
        assert result.loss == pytest.approx(want_loss, rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        assert_close([host(st.params) for st in stages], want_params)
        peaks = result.timeline.peak_live_activations()
        if schedule == "gpipe":  # the flush holds every microbatch on every stage, whatever the timing
            assert peaks == {i: m for i in range(n)}
        else:  # the register count bounds each stage; the last one's backward follows its forward at once
            assert all(1 <= peaks[i] <= min(n - i, m) for i in range(n)) and peaks[n - 1] == 1
        # the stash holds the stage input and the VJP's residuals (one device: physical = logical bytes)
        per_microbatch = pipe.programs[0].vjp.slot_bytes(host(stages[0].params), x[:MB], ())[0]
        assert per_microbatch > MB * D * 4  # more than the input: the residuals too, nothing recomputed
        assert result.timeline.peak_activation_bytes()[0] == peaks[0] * per_microbatch


@pytest.mark.parametrize(
    "schedule",
    ["1f1b", sjp.Interleaved1F1B(2), "zb-h1", sjp.ZeroBubbleV()],
    ids=["1f1b", "interleaved", "zb-h1", "zb-v"],
)
def test_lockstep_order_gives_the_threaded_runtimes_values(schedule):
    """The lockstep runtime (stages in several processes) performs the actions
    in the simulated order; forced on in one process it gives the threaded
    runtime's losses, gradients and parameters bit for bit, and records every
    action once."""
    rng = np.random.default_rng(5)
    devs = jax.devices()
    p = 2
    groups = [sj.Placement(np.array([devs[6 + d]]), ("d",)) for d in range(p)]
    schedule = sjp.as_schedule(schedule)
    n = schedule.stages(p)
    params = [layer_params(rng) for _ in range(n)]
    opt = optax.sgd(0.1)
    runs = []
    for lockstep in (False, True):
        stages = [sjp.Stage(layer, params[s], groups[schedule.device_of(s, p)]) for s in range(n)]
        pipe = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule=schedule)
        assert pipe.lockstep is False  # one process: the threaded runtime unless forced
        pipe.lockstep = lockstep
        results = [pipe.step(*batch(4, seed=20 + k)) for k in range(2)]
        runs.append(([r.microbatch_losses for r in results], [host(st.params) for st in stages], results[-1]))
    (losses_t, params_t, last_t), (losses_l, params_l, last_l) = runs
    assert losses_l == losses_t
    jax.tree_util.tree_map(np.testing.assert_array_equal, params_l, params_t)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, [host(g) for g in last_l.grads], [host(g) for g in last_t.grads]
    )
    done = sorted((r.actor, r.microbatch) for r in last_l.timeline.actions)
    assert done == sorted((r.actor, r.microbatch) for r in last_t.timeline.actions)


def test_interleaved_step_equals_the_whole_batch_step(one_device_stages):
    # 4 stages on 2 device groups, 2 chunks each: stage s on group s % 2
    rng = np.random.default_rng(3)
    devs = jax.devices()
    groups = [sj.Placement(np.array([devs[4 + d]]), ("d",)) for d in range(2)]
    stages = [sjp.Stage(layer, layer_params(rng), groups[s % 2]) for s in range(4)]
    opt = optax.sgd(0.1)
    for m in (2, 4):
        x, y = batch(m, seed=10 + m)
        before = [host(st.params) for st in stages]
        want_loss, want_grads, want_params, _ = reference_step([layer] * 4, before, x, y, opt)
        result = sjp.Pipeline(stages, mse, opt, microbatches=m, schedule=sjp.Interleaved1F1B(2)).step(x, y)
        assert result.loss == pytest.approx(want_loss, rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        assert_close([host(st.params) for st in stages], want_params)
        assert set(result.timeline.threads) >= {"group0", "group1"}


def tensor_parallel_stages(seed: int, hidden: int):
    """Two Megatron MLP stages, each on 2 devices (w1 split by columns, w2 by
    rows over tp): their parameters (plain arrays) and stages."""
    rng = np.random.default_rng(seed)
    devs = jax.devices()
    layout = {"w1": (sj.S(1),), "w2": (sj.S(0),)}
    params = [
        {
            "w1": (rng.normal(size=(D, hidden)) / np.sqrt(D)).astype(np.float32),
            "w2": (rng.normal(size=(hidden, D)) / np.sqrt(hidden)).astype(np.float32),
        }
        for _ in range(2)
    ]
    stages = [
        sjp.Stage(mlp, params[i], sj.Placement(np.array(devs[2 * i : 2 * i + 2]), ("tp",)), param_sbp=layout)
        for i in range(2)
    ]
    return params, stages


def test_tensor_parallel_stages_with_adam():
    params, stages = tensor_parallel_stages(seed=4, hidden=2 * D)
    opt = optax.adam(1e-2)
    pipe = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="1f1b")
    state = [opt.init(p) for p in params]
    for step in range(2):  # the second step checks the optimizer state carried between steps
        x, y = batch(4, seed=20 + step)
        before = [host(st.params) for st in stages]
        want_loss, want_grads, _, _ = reference_step([mlp, mlp], before, x, y, opt)
        want_params = []
        for i in range(2):
            u, state[i] = opt.update(want_grads[i], state[i], before[i])
            want_params.append(optax.apply_updates(before[i], u))
        result = pipe.step(x, y)
        assert result.loss == pytest.approx(want_loss, rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        assert_close([host(st.params) for st in stages], want_params)
        for st in stages:  # the weights keep their tensor-parallel layout
            assert st.params["w1"].sbp == (sj.S(1),) and st.params["w2"].sbp == (sj.S(0),)


@pytest.mark.parametrize("zero", [False, True], ids=["layout", "zero"])
def test_a_stage_takes_another_stages_global_parameters_by_value(zero):
    """A stage built from global tensors (another stage's or a pipeline's
    parameters, a restored checkpoint's) lays their values out on its own
    placement and layouts; it raised a raw pytree error, or an
    AttributeError for a replicated layout."""
    devices = np.array(jax.devices())
    first = sjp.Stage(
        layer,
        layer_params(np.random.default_rng(0)),
        sj.Placement(devices[:2], ("t",)),
        param_sbp={"w": (sj.S(1),), "b": (sj.S(0),)},
    )
    for pl, sbp in (
        (first.placement, None),
        (sj.Placement(devices[2:6], ("d",)), {"w": (sj.S(0),), "b": (sj.B,)}),
    ):
        second = sjp.Stage(
            layer, first.params, pl, param_sbp=sbp, zero=zero, in_sbp=sj.S(0) if zero else None
        )
        assert second.placement == pl
        for k in ("w", "b"):
            np.testing.assert_array_equal(second.params[k].numpy(), first.params[k].numpy())


def test_zero_on_a_data_axis_of_one_device_stores_the_state_whole():
    """``zero=True`` with the batch split over an axis of one device (code
    written for N devices run on one) stores everything whole, as
    ``zero='dp'`` does; it was refused with a message saying the input was
    not split, next to ``in_sbp is (S(0),)``. The Trainer reads it alike."""
    one = sj.Placement(np.array(jax.devices()[:1]), ("dp",))
    x, y = batch(4, seed=3)
    params = layer_params(np.random.default_rng(0))
    for zero in (True, "dp"):
        st = sjp.Stage(layer, params, one, in_sbp=sj.S(0), zero=zero)
        assert st.stored_sbp == {"w": (sj.B,), "b": (sj.B,)}
        r = sjp.Pipeline([st], mse, optax.sgd(0.1), microbatches=2).step(x, y)
        want_loss, _, _, _ = reference_step([layer], [params], x, y, optax.sgd(0.1))
        assert r.loss == pytest.approx(want_loss, rel=1e-6)
    step = sjf.TrainStep(lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), one, None, (sj.S(0),), zero=True)
    p, s = step.init({"w": np.ones(4, np.float32)})
    assert p["w"].sbp == (sj.B,)


def test_memory_is_counted_per_device_in_the_budgets_unit():
    """Under 2-way TP a stage's residuals are the replicated input and the
    hidden activation split over tp: one device holds the input and half the
    hidden, less than the logical bytes the budget counts and more than half
    of them. A budget of exactly the logical bytes the schedule holds runs,
    and the timeline's per-device peaks stay under it."""
    params, stages = tensor_parallel_stages(seed=5, hidden=4 * D)
    x, y = batch(4, seed=30)
    logical = [
        sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=4)
        .programs[i]
        .vjp.slot_bytes(params[i], x[:MB], (y[:MB],) if i else ())[0]
        for i in range(2)
    ]
    budget = 2 * max(logical)  # 1F1B on 2 stages: at most 2 microbatches' residuals per stage
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=4, schedule="1f1b", memory_budget=budget)
    timeline = pipe.step(x, y).timeline
    live, held = timeline.peak_live_activations(), timeline.peak_activation_bytes()
    for i in range(2):
        assert live[i] * logical[i] / 2 < held[i] < live[i] * logical[i]
    assert max(timeline.peak_held_bytes().values()) <= budget


def test_random_delays_give_the_same_numbers(one_device_stages):
    stages = one_device_stages[4]
    opt = optax.sgd(0.1)
    x, y = batch(6, seed=30)
    start = [st.params for st in stages]
    results = []
    for delays in (False, True, True):
        for st, p in zip(stages, start):
            st.params = p

        def before(spec, k, rng=random.Random(len(results)), lock=threading.Lock()):
            with lock:  # actors on several threads draw from one generator
                d = rng.choice([0, 0.0005, 0.003])
            time.sleep(d)

        r = sjp.Pipeline(
            stages, mse, opt, microbatches=6, schedule="1f1b", before_action=before if delays else None
        ).step(x, y)
        results.append((r.microbatch_losses, [host(g) for g in r.grads], [host(st.params) for st in stages]))
    for other in results[1:]:
        assert other[0] == results[0][0]
        jax.tree_util.tree_map(np.testing.assert_array_equal, other[1:], results[0][1:])


def test_loader_fault_is_reraised_with_its_microbatch(one_device_stages):
    before = set(threading.enumerate())
    x, y = batch(4, seed=40)

    def inputs(k):
        if k == 2:
            raise OSError("shard 2 is unreadable")
        return x[k * MB : (k + 1) * MB]

    pipe = sjp.Pipeline(one_device_stages[2], mse, optax.sgd(0.1), microbatches=4)
    with pytest.raises(sjp.PipelineError, match="microbatch 2") as e:
        pipe.step(inputs, y)
    assert (e.value.kind, e.value.microbatch, e.value.stage) == ("load", 2, None)
    assert isinstance(e.value.__cause__, OSError)
    assert set(threading.enumerate()) == before


def test_stage_fault_names_the_stage(one_device_stages):
    stages = one_device_stages[2]
    bad = sjp.Stage(
        lambda p, x: jnp.tanh(x @ p["w"][:3]),
        layer_params(np.random.default_rng(5)),
        stages[1].placement,
        name="bad",
    )
    x, y = batch(2, seed=41)
    with pytest.raises(sjp.PipelineError) as e:
        sjp.Pipeline([stages[0], bad], mse, optax.sgd(0.1), microbatches=2).step(x, y)
    assert (e.value.kind, e.value.stage, e.value.microbatch) == ("forward", 1, 0)
    assert "stage 1, microbatch 0" in str(e.value)


def test_bad_input_raises_sbperror(one_device_stages):
    stages = one_device_stages[2]
    opt = optax.sgd(0.1)
    with pytest.raises(sj.SBPError, match="do not split into 3 equal microbatches"):
        sjp.Pipeline(stages, mse, opt, microbatches=3).step(*batch(2, seed=0))
    x, y = batch(2, seed=0)
    with pytest.raises(sj.SBPError, match=r"inputs have \d+ rows but targets \d+"):
        sjp.Pipeline(stages, mse, opt, microbatches=2).step(x, np.concatenate([y, y]))
    with pytest.raises(sj.SBPError, match="shares devices"):
        overlapping = sj.Placement(np.array(jax.devices()[0:2]), ("d",))
        sjp.Pipeline(
            [stages[0], sjp.Stage(layer, layer_params(np.random.default_rng(0)), overlapping)],
            mse,
            opt,
            microbatches=2,
        )
    with pytest.raises(
        sj.SBPError, match=r"v stages per group, zb-v and dualpipev two, other schedules one\.$"
    ):
        sjp.Pipeline(stages, mse, opt, microbatches=2, schedule=sjp.Interleaved1F1B(2))
    same = sjp.Stage(layer, layer_params(np.random.default_rng(0)), stages[0].placement)
    with pytest.raises(sj.SBPError, match=r"stages 0, 1 share the placement .* its own placement\.$"):
        sjp.Pipeline([stages[0], same], mse, opt, microbatches=2)
    with pytest.raises(sj.SBPError, match="must be an sj.Placement"):
        sjp.Stage(layer, layer_params(np.random.default_rng(0)), jax.devices()[0])
    with pytest.raises(sj.SBPError, match="param_sbp"):
        sjp.Stage(
            layer, layer_params(np.random.default_rng(0)), stages[0].placement, param_sbp={"w": (sj.B,)}
        )
    with pytest.raises(sj.SBPError, match="microbatches must be an int"):
        sjp.Pipeline(stages, mse, opt, microbatches=0)


def test_targets_may_be_a_tuple_or_dict_of_arrays(one_device_stages):
    """Labels with per-example weights: the loss reads a pytree of targets,
    split into microbatches leaf by leaf, given as arrays or by a function."""
    stages = one_device_stages[2]
    opt = optax.sgd(0.1)
    x, y = batch(4, seed=3)
    w = np.random.default_rng(3).uniform(0.5, 2.0, size=(len(x),)).astype(np.float32)

    def weighted(out, t):
        return jnp.mean(t["w"][:, None] * (out - t["y"]) ** 2)

    def whole(ps):
        h = x
        for p in ps:
            h = layer(p, h)
        return weighted(h, {"y": y, "w": w})

    before = [host(st.params) for st in stages]
    want_loss, want_grads = jax.jit(jax.value_and_grad(whole))(before)
    pipe = sjp.Pipeline(stages, weighted, opt, microbatches=4, schedule="1f1b")
    try:
        result = pipe.step(x, {"y": y, "w": w})
        assert result.loss == pytest.approx(float(want_loss), rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        rows, updated = len(x) // 4, [host(st.params) for st in stages]
        by_function = pipe.step(
            x, lambda k: {"y": y[k * rows : (k + 1) * rows], "w": w[k * rows : (k + 1) * rows]}
        )
        assert by_function.loss == pytest.approx(float(whole(updated)), rel=2e-6)
    finally:  # the module's stages go back to their parameters for the other tests
        for st, p in zip(stages, before):
            st.params = jax.tree_util.tree_map(lambda a, t: sj.to_global(a, t.placement, t.sbp), p, st.params)
    with pytest.raises(sj.SBPError, match=r"arrays of targets have shapes \[\(8, 8\), \(4,\)\]"):
        pipe.step(x, (y, w[:4]))
    with pytest.raises(sj.SBPError, match=r"inputs is a tuple of 2; give an array .* go in targets"):
        pipe.step((x, x), y)


def test_a_global_tensor_batch_and_nested_list_targets_feed_a_step():
    """The batch as a global tensor (split on the host, each microbatch placed
    on its stage) and targets as nested Python lists (one array, as numpy
    reads it), under a memory budget that prices their shapes."""
    devs, rng = jax.devices(), np.random.default_rng(6)
    stages = [
        sjp.Stage(layer, layer_params(rng), sj.Placement(np.array([devs[i]]), ("d",))) for i in range(2)
    ]
    x, y = batch(2, seed=6)
    want_loss = reference_step([layer] * 2, [host(st.params) for st in stages], x, y, optax.sgd(0.1))[0]
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2, memory_budget=1e9)
    result = pipe.step(sj.to_global(x, sj.placement(8, "d"), sj.S(0)), y.tolist())
    assert result.loss == pytest.approx(want_loss, rel=2e-6)


def test_bfloat16_parameters_train():
    """bfloat16 is floating point (ml_dtypes' type, no numpy float): a stage
    with bf16 parameters computing in float32 equals the whole-batch step up
    to one bf16 rounding of each gradient."""
    devs = jax.devices()
    rng = np.random.default_rng(5)

    def mixed(p, x):
        return layer(jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p), x)

    params = [
        jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), layer_params(rng)) for _ in range(2)
    ]
    stages = [sjp.Stage(mixed, p, sj.Placement(np.array([devs[i]]), ("d",))) for i, p in enumerate(params)]
    x, y = batch(2, seed=5)
    want_loss, want_grads, _, _ = reference_step([mixed] * 2, params, x, y, optax.sgd(0.1))
    result = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2).step(x, y)
    assert result.loss == pytest.approx(want_loss, rel=2e-6)
    for got, want in zip(
        jax.tree_util.tree_leaves(host(result.grads)), jax.tree_util.tree_leaves(want_grads)
    ):
        assert got.dtype == jnp.bfloat16
        want = np.asarray(want, np.float32)
        ulp = 2.0**-7  # bf16 keeps 8 significant bits: one rounding apart at most
        np.testing.assert_allclose(got.astype(np.float32), want, rtol=ulp, atol=ulp * np.abs(want).max())


def test_a_stage_used_twice_or_a_loss_that_is_no_function_is_refused(one_device_stages):
    a, b = one_device_stages[2]
    with pytest.raises(sj.SBPError, match=r"stages 0 and 2 are the same Stage object \('layer0'\)"):
        sjp.Pipeline([a, b, a, b], mse, optax.sgd(0.1), microbatches=2, schedule=sjp.Interleaved1F1B(2))
    with pytest.raises(sj.SBPError, match=r"loss_fn='mse' is not a function"):
        sjp.Pipeline([a, b], "mse", optax.sgd(0.1), microbatches=2)


def test_pipeline_simulates_its_own_graph(one_device_stages):
    pipe = sjp.Pipeline(one_device_stages[4], mse, optax.sgd(0.1), microbatches=8, schedule="1f1b")
    tl = pipe.simulate({"forward": 1.0, "backward": 2.0})
    assert tl.makespan == (8 + 4 - 1) * 3.0
    assert tl.peak_live_activations() == {0: 4, 1: 3, 2: 2, 3: 1}


def test_flax_modules_as_stages():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.tanh(nn.Dense(D)(x))

    modules = [Block(), Block()]
    x, y = batch(4, seed=50)
    variables = [m.init(jax.random.key(i), x[:MB]) for i, m in enumerate(modules)]
    devs = jax.devices()
    stages = [
        sjp.Stage(m.apply, v, sj.Placement(np.array([devs[6 + i]]), ("d",)))
        for i, (m, v) in enumerate(zip(modules, variables))
    ]
    opt = optax.sgd(0.1)
    want_loss, want_grads, want_params, _ = reference_step([m.apply for m in modules], variables, x, y, opt)
    result = sjp.Pipeline(stages, mse, opt, microbatches=4).step(x, y)
    assert result.loss == pytest.approx(want_loss, rel=2e-6)
    assert_close([host(g) for g in result.grads], want_grads)
    assert_close([host(st.params) for st in stages], want_params)


@pytest.mark.parametrize(
    "opt, stagewise",
    [
        (optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0)), False),
        (optax.apply_if_finite(optax.adam(1e-2), 3), False),
        (optax.chain(optax.clip(0.1), optax.adamw(1e-2)), True),
        (optax.MultiSteps(optax.adam(1e-2), 2), True),
        (optax.lamb(1e-2), True),
        (optax.adafactor(1e-2), True),
    ],
    ids=["clip_by_global_norm", "apply_if_finite", "clip", "multisteps", "lamb", "adafactor"],
)
def test_an_optimizer_of_the_whole_model_is_refused_not_run_per_stage(one_device_stages, opt, stagewise):
    """An optimizer whose update of one stage reads another stage's gradients
    (a global norm) would see each stage's alone: it is refused, and runs per
    stage only when asked. Optimizers that treat each parameter on its own run
    as they would on one device."""
    stages = one_device_stages[2]
    if not stagewise:
        with pytest.raises(
            sj.SBPError, match=r"stage 0 \('layer0'\) is computed from stage 1.*stagewise_optimizer"
        ):
            sjp.Pipeline(stages, mse, opt, microbatches=2)
        sjp.Pipeline(stages, mse, opt, microbatches=2, stagewise_optimizer=True)  # accepted when asked
        return
    pipe = sjp.Pipeline(stages, mse, opt, microbatches=2)
    x, y = batch(2, seed=7)
    before = [host(st.params) for st in stages]
    _, want_grads, _, _ = reference_step([layer, layer], before, x, y, opt)
    whole = list(before)  # the single-device update of the whole model
    updates, _ = opt.update(want_grads, opt.init(whole), whole)
    pipe.step(x, y)
    assert_close([host(st.params) for st in stages], optax.apply_updates(whole, updates))


def test_an_optimizer_state_with_a_typed_key_draws_its_own_noise_per_stage(one_device_stages):
    """optax.add_noise keeps a typed PRNG key in its state: each stage keeps
    it as a key (no raw TypeError), folded with the stage's index so the
    stages do not draw the same noise; each stage's update is the optimizer's
    on that stage alone with that key, as the docstring of _placed_state says."""
    stages = one_device_stages[2]
    opt = optax.chain(optax.add_noise(0.01, 0.55, key=jax.random.key(0)), optax.sgd(0.1))
    pipe = sjp.Pipeline(stages, mse, opt, microbatches=2)
    x, y = batch(2, seed=9)
    before = [host(st.params) for st in stages]
    _, want_grads, _, _ = reference_step([layer, layer], before, x, y, opt)
    pipe.step(x, y)
    noise = []
    for s, (p, g, st) in enumerate(zip(before, want_grads, stages)):
        state = jax.tree.map(
            lambda v, s=s: jax.random.fold_in(v, s) if is_key(v) else v,
            opt.init(p),
        )
        updates, _ = opt.update(g, state, p)
        want = optax.apply_updates(p, updates)
        assert_close(host(st.params), want)
        noise.append(jax.tree.map(lambda a, b, c: np.asarray(a - b + 0.1 * c), want, p, g))
    assert not np.allclose(noise[0]["w"], noise[1]["w"])  # the stages' noise differs
    assert any(is_key(v) for v in jax.tree.leaves(pipe.programs[1].state))  # kept as a typed key


def _ema_of_the_global_norm(decay=0.9):
    """Scales the updates by an average of past global gradient norms kept in
    the state: the update reads no other stage now, the state carries it."""

    def init(params):
        return jnp.zeros((), jnp.float32)

    def update(updates, state, params=None):
        scale = 1.0 / (1.0 + state)
        norm = optax.tree.norm(updates)
        return jax.tree.map(lambda u: u * scale, updates), decay * state + (1 - decay) * norm

    return optax.GradientTransformation(init, update)


def test_an_optimizer_that_carries_or_hides_a_whole_model_statistic_is_refused(one_device_stages):
    """Two ways a per-stage optimizer differs from one device without any
    stage's update reading another stage's gradients: its state carries a
    norm of the whole model to the next step, or it cannot be traced on the
    whole model (a mask written for one stage's tree) so the check cannot
    run. Both are SBPErrors, and both are accepted with stagewise_optimizer=True."""
    stages = one_device_stages[2]
    carried = optax.chain(_ema_of_the_global_norm(), optax.sgd(0.1))
    with pytest.raises(sj.SBPError, match=r"state carries a statistic of several stages \(\[0, 1\]"):
        sjp.Pipeline(stages, mse, carried, microbatches=2)
    masked = optax.chain(
        optax.masked(optax.clip_by_global_norm(0.1), {"w": True, "b": False}), optax.sgd(0.1)
    )
    with pytest.raises(sj.SBPError, match=r"cannot be traced on the whole model.*stagewise_optimizer=True"):
        sjp.Pipeline(stages, mse, masked, microbatches=2)
    for opt in (carried, masked):
        pipe = sjp.Pipeline(stages, mse, opt, microbatches=2, stagewise_optimizer=True)
        assert np.isfinite(pipe.step(*batch(2, seed=3)).loss)
