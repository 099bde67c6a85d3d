"""Every schedule, run for real, against the non-pipelined step on one device:
losses, gradients and updated parameters; the bytes B keeps for W counted and
bounded; back-pressure and budgets refused before a step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pipeline_helpers import MB, D, assert_close, batch, host, layer, layer_params, mse, reference_step

import sbpjax as sj
import sbpjax.pipeline as sjp

ONE_CHUNK = ("gpipe", "1f1b", "zb-h1", "zb-h2")
SGD = optax.sgd(0.1)  # one optimizer object: stages compile their programs once per (loss, optimizer)


def remat_layer(p, x):  # the user's own remat: the backward recomputes it, once
    return jax.checkpoint(lambda x: x + layer(p, x))(x)


def _params(rng, n):
    return [layer_params(rng) for _ in range(n)]


def mlp(p, x):
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _mlp_params(rng, n):
    return [
        {
            "w1": (rng.normal(size=(D, 2 * D)) / np.sqrt(D)).astype(np.float32),
            "w2": (rng.normal(size=(2 * D, D)) / np.sqrt(2 * D)).astype(np.float32),
        }
        for _ in range(n)
    ]


def _two_adam_steps(pipe, fns, params, opt, seed):
    """Two steps of ``pipe`` against two whole-batch steps (Adam's state carried over)."""
    want_params, state = params, None
    for step in range(2):
        x, y = batch(4, seed=seed + step)
        want_loss, want_grads, want_params, state = reference_step(fns, want_params, x, y, opt, state)
        result = pipe.step(x, y)
        assert result.loss == pytest.approx(want_loss, rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        assert_close([host(st.params) for st in pipe.stages], want_params)


def _groups(first_device, p, per=1):
    devs = jax.devices()
    return [
        sj.Placement(np.array(devs[first_device + per * d : first_device + per * (d + 1)]), ("tp",))
        for d in range(p)
    ]


@pytest.fixture(scope="module")
def stage_sets():
    """Stages on 2 single-device groups, shared by the schedules that place them
    alike (their programs compile once): 2 stages, 4 round robin, 4 in a V."""
    rng = np.random.default_rng(0)
    params = _params(rng, 4)
    groups = _groups(4, 2)
    return {
        "one": (params[:2], [sjp.Stage(layer, params[s], groups[s]) for s in range(2)]),
        "loop": (params, [sjp.Stage(layer, params[s], groups[s % 2]) for s in range(4)]),
        "v": (params, [sjp.Stage(layer, params[s], groups[(0, 1, 1, 0)[s]]) for s in range(4)]),
    }


def _set_for(name):
    return "one" if name in ONE_CHUNK else "loop" if name == "interleaved" else "v"


@pytest.mark.parametrize("name", tuple(sjp.SCHEDULES))
def test_every_schedule_equals_the_whole_batch_step(stage_sets, name):
    params, stages = stage_sets[_set_for(name)]
    opt = SGD
    for m in (4, 5) if name not in ("interleaved", "dualpipev") else (4,):
        for st, prm in zip(stages, params):  # each step from the same parameters
            st.params = jax.tree_util.tree_map(
                lambda v, t: sj.to_global(v, t.placement, t.sbp), prm, st.params
            )
        x, y = batch(m, seed=m)
        want_loss, want_grads, want_params, _ = reference_step([layer] * len(stages), params, x, y, opt)
        pipe = sjp.Pipeline(stages, mse, opt, microbatches=m, schedule=name)
        result = pipe.step(x, y)
        assert result.loss == pytest.approx(want_loss, rel=2e-6)
        assert_close([host(g) for g in result.grads], want_grads)
        assert_close([host(st.params) for st in stages], want_params)
        kinds = {a.kind for a in result.timeline.actions}
        split = name.startswith("zb") or name == "dualpipev"
        assert ({"backward_input", "backward_weight"} <= kinds) == split and ("backward" in kinds) == (
            not split
        )
        if split:  # what B keeps for W: counted per microbatch, bounded by the kept register
            rest = (y[:MB],) if len(stages) == 2 else ()  # stage 1 is the last of two: it reads the targets
            per_mb = pipe.programs[1].vjp.slot_bytes(params[1], x[:MB], rest)[1]
            held, live = result.timeline.peak_kept_bytes(), result.timeline.peak_live_kept()
            counts = {r.name: r.count for r in pipe.graph.registers}
            assert held[1] == live[1] * per_mb and 1 <= live[1] <= counts["kept1"]


def test_program_costs_report_the_programs_the_runtime_runs(stage_sets):
    """Under ZB-H1 the first stage's B runs its whole backward (its input has no
    cotangent) and its W runs no program; every other stage's B and W split the
    whole backward's FLOPs between them. Before, the first stage's whole
    backward was filed under ``backward_weight``, measured on the W program,
    which never runs there."""
    params, stages = stage_sets["one"]
    pipe = sjp.Pipeline(stages, mse, SGD, microbatches=4, schedule="zb-h1")
    costs = pipe.program_costs(*batch(4, seed=3))
    assert costs[0]["backward_input"] == costs[0]["backward"] and "backward_weight" not in costs[0]
    b, w, whole = (costs[1][k]["flops"] for k in ("backward_input", "backward_weight", "backward"))
    assert min(b, w) > 0 and b + w == pytest.approx(whole, rel=0.02)


def test_tensor_parallel_stages_with_adam_under_zero_bubble():
    """2 groups of 2 devices, Megatron layouts inside each stage, ZB-H1."""
    params = _mlp_params(np.random.default_rng(4), 2)
    layout = {"w1": (sj.S(1),), "w2": (sj.S(0),)}
    stages = [sjp.Stage(mlp, params[s], g, param_sbp=layout) for s, g in enumerate(_groups(0, 2, per=2))]
    opt = optax.adam(1e-2)
    _two_adam_steps(
        sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="zb-h1"), [mlp, mlp], params, opt, 20
    )
    for st in stages:  # the weights keep their tensor-parallel layout
        assert st.params["w1"].sbp == (sj.S(1),) and st.params["w2"].sbp == (sj.S(0),)


def test_remat_stage_under_zb_h1():
    rng = np.random.default_rng(6)
    params = _params(rng, 2)
    stages = [sjp.Stage(remat_layer, params[s], g) for s, g in enumerate(_groups(2, 2))]
    x, y = batch(4, seed=6)
    opt = SGD
    want_loss, want_grads, want_params, _ = reference_step([remat_layer] * 2, params, x, y, opt)
    pipe = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="zb-h1")
    result = pipe.step(x, y)
    assert result.loss == pytest.approx(want_loss, rel=2e-6)
    assert_close([host(g) for g in result.grads], want_grads)
    assert_close([host(st.params) for st in stages], want_params)
    # with remat the forward keeps only the stage input: the checkpointed region's residual
    stash = pipe.programs[0].vjp.slot_bytes(params[0], x[:MB], ())[0]
    assert stash == MB * D * 4  # the checkpointed region's one residual is the stage input itself


def test_budgets_and_counts_are_refused_before_anything_runs(stage_sets):
    params, stages = stage_sets["one"]
    opt = SGD
    ran = []
    x, y = batch(8, seed=1)
    with pytest.raises(sj.SBPError, match="backward_input of stage 1, microbatch 1.*1 kept slot"):
        sjp.Pipeline(stages, mse, opt, microbatches=8, schedule="zb-h1", kept_counts=[1, 1])
    with pytest.raises(sj.SBPError, match="'1f1b'.* keeps none; drop kept_counts"):
        sjp.Pipeline(stages, mse, opt, microbatches=8, schedule="1f1b", kept_counts=[2, 2])
    prog = sjp.Pipeline(stages, mse, opt, microbatches=8).programs
    stash0 = prog[0].vjp.slot_bytes(params[0], x[:MB], ())[0]
    stash1, kept1 = prog[1].vjp.slot_bytes(params[1], x[:MB], (y[:MB],))
    # 1F1B: group 0 holds 2 microbatches' residuals; ZB-H1's stage 1 (last) keeps 2 B's for its W's at most
    need = {"1f1b": 2 * stash0, "zb-h1": max(2 * stash0, stash1 + kept1, 2 * kept1)}
    for name, budget in need.items():
        ran.clear()
        pipe = sjp.Pipeline(
            stages,
            mse,
            opt,
            microbatches=8,
            schedule=name,
            memory_budget=budget - 1,
            before_action=lambda spec, k: ran.append(spec),
        )
        with pytest.raises(
            sj.SBPError, match=f"over (the )?memory_budget={budget - 1}|over the budget of {budget - 1}"
        ):
            pipe.step(x, y)
        assert ran == []  # refused before any action
        pipe.memory_budget = budget
        assert np.isfinite(pipe.step(x, y).loss)
        for st, prm in zip(stages, params):  # put the parameters back for the other tests
            st.params = jax.tree_util.tree_map(
                lambda v, t: sj.to_global(v, t.placement, t.sbp), prm, st.params
            )


def test_v_schedules_need_their_placement(stage_sets):
    _, loop = stage_sets["loop"]
    with pytest.raises(sj.SBPError, match="runs stage 2 on group 1"):
        sjp.Pipeline(loop, mse, SGD, microbatches=4, schedule="zb-v")
    _, one = stage_sets["one"]
    with pytest.raises(sj.SBPError, match="zb-v and dualpipev two"):
        sjp.Pipeline(one, mse, SGD, microbatches=4, schedule="dualpipev")


def test_zero_within_stages_under_zero_bubble():
    """Each stage data parallel over its 2 devices with ZeRO: weights, gradients and
    Adam's state stored split over the data axis, gathered where used. ZB-H1's
    two steps equal the whole-batch steps."""
    params = _mlp_params(np.random.default_rng(8), 2)
    groups = [sj.Placement(np.array(jax.devices()[4 + 2 * d : 6 + 2 * d]), ("dp",)) for d in range(2)]
    stages = [
        sjp.Stage(mlp, params[s], groups[s], in_sbp=sj.S(0), out_sbp=sj.S(0), zero=True) for s in range(2)
    ]
    assert stages[0].stored_sbp == {"w1": (sj.S(0),), "w2": (sj.S(0),)}
    assert stages[0].param_sbp["w1"] == (sj.B,)
    opt = optax.adam(1e-2)
    pipe = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="zb-h1", target_sbp=sj.S(0))
    _two_adam_steps(pipe, [mlp, mlp], params, opt, 30)
    for st, prog in zip(stages, pipe.programs):
        assert st.params["w1"].sbp == (sj.S(0),)
        adam_mu = prog.state[0].mu
        assert adam_mu["w1"].sbp == (sj.S(0),) and adam_mu["w2"].sbp == (sj.S(0),)  # the state is split


def test_restore_of_another_cut_says_the_stages_differ_and_changes_nothing(tmp_path):
    """A checkpoint of 2 stages restored into a pipeline of 3 (another cut,
    as a schedule of two stages per group needs) is refused with an
    SBPError that says the stages differ and what to do; before, the
    message was checkpoint.restore's own, advising a target that
    Pipeline.restore does not take. Nothing changes."""
    rng = np.random.default_rng(10)
    params = _params(rng, 3)
    opt = optax.adam(1e-2)
    two = [sjp.Stage(layer, params[s], g) for s, g in enumerate(_groups(5, 2))]
    saved = sjp.Pipeline(two, mse, opt, microbatches=4, schedule="1f1b")
    saved.step(*batch(4, seed=50))
    saved.save(tmp_path / "two")
    three = sjp.Pipeline(
        [sjp.Stage(layer, params[s], g) for s, g in enumerate(_groups(5, 3))], mse, opt, microbatches=4
    )
    before = [host(st.params) for st in three.stages], [host(p.state) for p in three.programs]
    with pytest.raises(
        sj.SBPError, match=r"saved by a pipeline of other stages than this one's 3.*cut again"
    ):
        three.restore(tmp_path / "two")
    assert_close([host(st.params) for st in three.stages], before[0])
    assert_close([host(p.state) for p in three.programs], before[1])


def test_checkpoint_between_zero_bubble_steps_restores_into_another_schedule(tmp_path):
    """Two ZB-H1 steps equal one ZB-H1 step, a save, a restore into a new 1F1B
    pipeline (fresh optimizer state, parameters put back to the start), and one step."""
    rng = np.random.default_rng(9)
    params = _params(rng, 2)
    opt = optax.adam(1e-2)
    batches = [batch(4, seed=40 + k) for k in range(2)]

    groups = _groups(6, 2)
    straight_stages = [sjp.Stage(layer, params[s], g) for s, g in enumerate(groups)]
    straight = sjp.Pipeline(straight_stages, mse, opt, microbatches=4, schedule="zb-h1")
    for x, y in batches:
        want = straight.step(x, y)
    stages = [sjp.Stage(layer, params[s], g) for s, g in enumerate(groups)]
    first = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="zb-h1")
    first.step(*batches[0])
    first.save(tmp_path / "step1")
    for st, prm in zip(stages, params):  # start again from the initial parameters and a new optimizer state
        st.params = jax.tree_util.tree_map(lambda v, t: sj.to_global(v, t.placement, t.sbp), prm, st.params)
    again = sjp.Pipeline(stages, mse, opt, microbatches=4, schedule="1f1b")
    again.restore(tmp_path / "step1")
    got = again.step(*batches[1])
    assert got.loss == pytest.approx(want.loss, rel=2e-6)
    assert_close([host(st.params) for st in again.stages], [host(st.params) for st in straight.stages])
    assert_close([host(p.state) for p in again.programs], [host(p.state) for p in straight.programs])
