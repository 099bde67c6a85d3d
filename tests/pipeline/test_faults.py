"""Pipeline faults: a blocking stage, Ctrl-C, NaN, a failing update; each stops
the step, names where, and leaves every stage's parameters as before the step."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sbpjax as sj
import sbpjax.pipeline as sjp

D, MB = 8, 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": (rng.normal(size=(D, D)) / np.sqrt(D)).astype(np.float32),
        "b": (0.1 * rng.normal(size=(D,))).astype(np.float32),
    }


def _stages(fns, names=None):
    devs = jax.devices()
    return [
        sjp.Stage(
            fn,
            _params(i),
            sj.Placement(np.array([devs[i]]), ("d",)),
            name=(names[i] if names else f"layer{i}"),
        )
        for i, fn in enumerate(fns)
    ]


def _batch(m, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(m * MB, D)).astype(np.float32), rng.normal(size=(m * MB, D)).astype(np.float32))


def _snapshot(pipe):
    """Every stage's parameters and optimizer state, as host arrays."""

    def host(tree):
        return jax.tree_util.tree_map(
            lambda t: np.array(t.numpy()), tree, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
        )

    return [host(st.params) for st in pipe.stages], [host(prog.state) for prog in pipe.programs]


def _assert_unchanged(before, after):
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, after)


def test_blocking_stage_raises_within_the_deadline(no_leftover_threads_after_release):
    release = no_leftover_threads_after_release
    pipe = sjp.Pipeline(_stages([layer, layer, layer]), mse, optax.sgd(0.1), microbatches=4)
    x, y = _batch(4)
    pipe.step(x, y)  # compiles; later steps get the deadline
    before = _snapshot(pipe)

    def block(spec, k):
        if spec.name == "forward1" and k == 2:
            release.wait()  # a stage that never returns (a hung collective, a dead peer)

    pipe.before_action = block
    pipe.action_timeout = 1.5
    t0 = time.perf_counter()
    with pytest.raises(sjp.PipelineTimeout) as e:
        pipe.step(x, y)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.5 + 5.0, elapsed
    assert (e.value.stage, e.value.microbatch, e.value.kind, e.value.actor) == (1, 2, "forward", "forward1")
    assert "stage 1, microbatch 2" in str(e.value) and "deadline of 1.5 s" in str(e.value)
    assert "Left behind" in str(e.value) and "forward1" in str(e.value)
    _assert_unchanged(before, _snapshot(pipe))
    # only the stuck thread is still alive, and only until what it waits on returns
    alive = [t.name for t in threading.enumerate() if t.name.startswith("sbpjax-pipeline:")]
    assert alive == ["sbpjax-pipeline:group1"], alive


@pytest.fixture
def no_leftover_threads_after_release():
    release = threading.Event()
    before = set(threading.enumerate())
    yield release
    release.set()
    deadline = time.time() + 10
    while set(threading.enumerate()) - before and time.time() < deadline:
        time.sleep(0.05)
    assert set(threading.enumerate()) == before


def test_default_deadline_follows_the_last_step():
    """After a step, the deadline follows its slowest actions, but for a step
    on microbatch shapes no step ran (a new batch size compiles the programs
    again): it gets the first step's deadline."""
    from sbpjax.pipeline.feeds import microbatch_shapes

    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=2)
    spec = pipe.graph.actors[0]
    batch, larger = _batch(2), _batch(4)
    ran, new = microbatch_shapes(batch, 2), microbatch_shapes(larger, 2)
    assert pipe._deadline(ran)(spec) == pipe.FIRST_STEP_TIMEOUT_S
    result = pipe.step(*batch)
    slowest = max(r.end - r.start for r in result.timeline.actions if r.kind == spec.kind)
    steady = max(pipe.MIN_TIMEOUT_S, pipe.TIMEOUT_FACTOR * slowest)
    assert pipe._deadline(ran)(spec) == steady
    assert new != ran and pipe._deadline(new)(spec) == pipe.FIRST_STEP_TIMEOUT_S
    assert pipe._deadline(None)(spec) == steady  # fed by functions: shapes unknown before the call
    pipe.step(*larger)
    assert pipe._deadline(new)(spec) < pipe.FIRST_STEP_TIMEOUT_S
    pipe.action_timeout = None
    assert pipe._deadline(ran) is None
    with pytest.raises(sj.SBPError, match="action_timeout"):
        sjp.Pipeline(pipe.stages, mse, optax.sgd(0.1), microbatches=2, action_timeout=-1)


SIGINT_SCRIPT = textwrap.dedent("""
    import faulthandler, os, signal, sys, threading, time
    # Ctrl-C's meaning whatever this process inherited: a child started while SIGINT
    # is ignored (SIG_IGN survives exec) never raises KeyboardInterrupt. A full suite
    # run once left its pytest process with SIGINT ignored (/proc SigIgn), and this
    # step then waited out its 45 s below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, os.path.join({root!r}, "tests", "pipeline"))
    import numpy as np, optax
    import sbpjax.pipeline as sjp
    from test_faults import _batch, _snapshot, _stages, layer, mse, _assert_unchanged

    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=4, action_timeout=None)
    x, y = _batch(4)
    pipe.step(x, y)
    before = _snapshot(pipe)
    never = threading.Event()

    def block(spec, k):
        if spec.name == "backward1" and k == 1:
            # a hang from here on ends the script with every thread's stack in its output
            # (that dump showed the inherited SIG_IGN above: no thread had been interrupted)
            faulthandler.dump_traceback_later(45, exit=True, file=sys.stdout)
            print("BLOCKED", flush=True)
            never.wait()

    pipe.before_action = block
    t0 = None
    try:
        pipe.step(x, y)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    _assert_unchanged(before, _snapshot(pipe))
    print("UNCHANGED", flush=True)
    pipe.before_action = None
    pipe.step(x, y)  # the pipeline still works after the interrupted step
    print("STEPPED AGAIN", flush=True)
    faulthandler.cancel_dump_traceback_later()
""")


def test_one_sigint_stops_a_step(tmp_path):
    script = tmp_path / "sigint_step.py"
    script.write_text(SIGINT_SCRIPT.format(root=ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ),
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BLOCKED"):
                break
        assert lines and lines[-1].startswith("BLOCKED"), "".join(lines)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGINT)  # once
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert proc.returncode == 0, text
    assert "INTERRUPTED" in text and "UNCHANGED" in text and "STEPPED AGAIN" in text, text
    assert time.perf_counter() - t0 < 30


LEFT_INSIDE_XLA = """
import os, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp, numpy as np, optax
import sbpjax as sj, sbpjax.pipeline as sjp

slow = [False]
def host(x):
    if slow[0]:
        time.sleep(4)  # a slow host callback inside a stage's program on 2 devices
    return x

@jax.custom_vjp
def tap(x):
    return x
tap.defvjp(lambda x: (x, None), lambda _, g: (jax.pure_callback(host, jax.ShapeDtypeStruct(g.shape, g.dtype), g),))
devs = jax.devices()
rng = np.random.default_rng(0)
stages = [
    sjp.Stage(lambda p, x: jnp.tanh(tap(x) @ p), rng.normal(size=(4, 4)).astype(np.float32),
              sj.Placement(np.array(devs[2 * i:2 * i + 2]), ("d",)), name=f"s{{i}}")
    for i in range(2)
]
pipe = sjp.Pipeline(stages, lambda y, t: jnp.mean((y - t) ** 2), optax.sgd(0.1), microbatches=2)
x = rng.normal(size=(4, 4)).astype(np.float32)
pipe.step(x, x)
pipe.action_timeout = 1.0
slow[0] = True
try:
    pipe.step(x, x)
except sjp.PipelineTimeout as e:
    print("TIMED OUT", "Left behind" in str(e), flush=True)
"""


def test_an_exit_waits_for_a_thread_left_inside_an_xla_program(tmp_path):
    """A daemon thread still inside a program on 2 devices when the interpreter
    finalizes aborted the process (exit code 134) after the script had ended."""
    script = tmp_path / "left_inside.py"
    script.write_text(LEFT_INSIDE_XLA.format(root=ROOT))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "TIMED OUT True" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize(
    "loss_fn,says",
    [
        (lambda y, t: (y - t) ** 2, r"an array of shape \(2, 8\)"),
        (lambda y, t: jnp.mean((y - t) ** 2, axis=1), r"an array of shape \(2,\)"),
        (lambda y, t: (mse(y, t), jnp.max(y)), "a tuple of 2 values"),
        (lambda y, t: jnp.sum(y > t), "dtype int32"),
    ],
    ids=["elementwise", "per row", "with aux", "integer"],
)
def test_a_loss_that_is_not_one_float_scalar_is_refused_by_name(loss_fn, says):
    pipe = sjp.Pipeline(_stages([layer, layer]), loss_fn, optax.sgd(0.1), microbatches=2)
    before = _snapshot(pipe)
    with pytest.raises(sj.SBPError, match=says + ".*must return one float scalar"):
        pipe.step(*_batch(2))
    _assert_unchanged(before, _snapshot(pipe))
    assert threading.active_count() == 1 or all(t.daemon for t in threading.enumerate()[1:])


def test_a_stage_that_returns_several_arrays_is_refused_by_name():
    """Not the transfer actor's AttributeError: the stage and what it returns,
    with every actor stopped and nothing updated."""
    pair = lambda p, x: (layer(p, x), x)  # noqa: E731
    pipe = sjp.Pipeline(_stages([pair, layer], names=["pair", "last"]), mse, optax.sgd(0.1), microbatches=2)
    before = _snapshot(pipe)
    with pytest.raises(sj.SBPError, match=r"stage 0 \('pair'\) returns a tuple, not one array"):
        pipe.step(*_batch(2))
    _assert_unchanged(before, _snapshot(pipe))
    assert threading.active_count() == 1 or all(t.daemon for t in threading.enumerate()[1:])


def test_a_pipeline_without_an_optimizer_or_with_a_stage_on_no_group_is_refused():
    with pytest.raises(sj.SBPError, match="optimizer=None is not an optax GradientTransformation"):
        sjp.Pipeline(_stages([layer, layer]), mse, None, microbatches=2)
    for schedule in ("1f1b", "zb-h1"):  # zb-h1 does not read it: refused all the same
        with pytest.raises(sj.SBPError, match=r"activation_registers must be an int >= 1.*got 0"):
            sjp.Pipeline(
                _stages([layer, layer]),
                mse,
                optax.sgd(0.1),
                microbatches=2,
                schedule=schedule,
                activation_registers=0,
            )
    lists = sjp.ZeroBubbleH1().action_lists(2, 2)
    with pytest.raises(sj.SBPError, match=r"runs stage 1 on device group 5.*2 groups \(0..1\)"):
        sjp.Pipeline(
            _stages([layer, layer]),
            mse,
            optax.sgd(0.1),
            microbatches=2,
            schedule=sjp.ActionList(lists, stage_devices=[0, 5]),
        )


def test_nan_stage_is_named_when_checked():
    def nan_layer(p, x):
        return layer(p, x) * jnp.nan

    stages = _stages([layer, nan_layer, layer], names=["first", "poisoned", "last"])
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2, check_finite=True)
    before = _snapshot(pipe)
    with pytest.raises(sjp.PipelineError) as e:
        pipe.step(*_batch(2))
    assert e.value.stage == 1 and e.value.kind == "forward"
    assert "stage 1 ('poisoned')" in str(e.value) and "forward output" in str(e.value)
    _assert_unchanged(before, _snapshot(pipe))
    # without the check the step runs and the NaN reaches every parameter it touches
    unchecked = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2)
    assert np.isnan(unchecked.step(*_batch(2)).loss)


def test_a_stage_fed_another_shape_names_its_inputs():
    """A stage that returns another shape than the next stage takes fails at
    the next stage's first op; the error names that stage and the shapes it
    was given, so the mismatch can be traced back (before: JAX's message
    alone, ``dot_general requires contracting dimensions to have the same
    shape``). Nothing changes."""

    def wide(p, x):  # one feature too many
        return jnp.concatenate([layer(p, x), x[:, :1]], axis=1)

    stages = _stages([layer, wide, layer], names=["first", "wide", "last"])
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2)
    before = _snapshot(pipe)
    with pytest.raises(sjp.PipelineError) as e:
        pipe.step(*_batch(2))
    assert e.value.stage == 2 and e.value.kind == "forward", str(e.value)
    assert "Its inputs:" in str(e.value) and "float32[2, 9]" in str(e.value), str(e.value)
    _assert_unchanged(before, _snapshot(pipe))


def test_nan_gradient_names_the_stage_that_made_it():
    def nan_grad_layer(p, x):  # finite forward; sqrt at 0 has an infinite slope: 0 * inf = NaN backward
        return layer(p, x) + jnp.sqrt(x * 0.0)

    stages = _stages([layer, nan_grad_layer, layer], names=["first", "sqrt", "last"])
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=2, check_finite=True)
    before = _snapshot(pipe)
    with pytest.raises(sjp.PipelineError) as e:
        pipe.step(*_batch(2))
    assert e.value.stage == 1 and e.value.kind == "backward", str(e.value)
    assert "stage 1 ('sqrt')" in str(e.value) and "input gradient" in str(e.value)
    _assert_unchanged(before, _snapshot(pipe))


@pytest.mark.parametrize("failing", [0, 1])
def test_failing_update_changes_no_stage(failing):
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.adam(1e-2), microbatches=4)
    x, y = _batch(4)
    pipe.step(x, y)  # adam's state is no longer its initial zeros
    before = _snapshot(pipe)
    done = []

    def fault(spec, k):
        if spec.kind == "update":
            if spec.stage == failing:
                time.sleep(0.3)  # let the other stage's update finish first
                raise RuntimeError("device lost during the update")
            done.append(spec.stage)

    pipe.before_action = fault
    with pytest.raises(sjp.PipelineError, match="device lost") as e:
        pipe.step(x, y)
    assert (e.value.kind, e.value.stage) == ("update", failing)
    _assert_unchanged(before, _snapshot(pipe))
    # and the next step is the step that would have run: from the same parameters
    pipe.before_action = None
    again = pipe.step(x, y)
    assert np.isfinite(again.loss)


# -- zero-bubble schedules: a W that fails, a W that makes NaN, a W that hangs -------------------


@pytest.mark.parametrize("failing_stage", [0, 1])
def test_failing_w_stops_the_step_with_nothing_updated(failing_stage):
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.adam(1e-2), microbatches=4, schedule="zb-h1")
    x, y = _batch(4)
    pipe.step(x, y)  # compiles; adam's state is no longer its initial zeros
    before = _snapshot(pipe)

    def fault(spec, k):
        if spec.kind == "backward_weight" and spec.stage == failing_stage and k == 2:
            raise RuntimeError("W lost its device")

    pipe.before_action = fault
    with pytest.raises(sjp.PipelineError, match="W lost its device") as e:
        pipe.step(x, y)
    assert (e.value.kind, e.value.stage, e.value.microbatch) == ("backward_weight", failing_stage, 2)
    assert f"stage {failing_stage}, microbatch 2" in str(e.value)
    _assert_unchanged(before, _snapshot(pipe))
    pipe.before_action = None
    assert np.isfinite(pipe.step(x, y).loss)  # and the next step runs from the same parameters


def test_nan_weight_gradient_is_named_at_its_w():
    def nan_weight_grad(p, x):  # finite forward and input gradient; d/db sqrt(0 * b) is 0 * inf = NaN
        return layer(p, x) + jnp.sqrt(p["b"] * 0.0)

    stages = _stages([layer, nan_weight_grad, layer], names=["first", "sqrt", "last"])
    pipe = sjp.Pipeline(stages, mse, optax.sgd(0.1), microbatches=3, schedule="zb-h1", check_finite=True)
    before = _snapshot(pipe)
    with pytest.raises(sjp.PipelineError) as e:
        pipe.step(*_batch(3))
    assert (e.value.kind, e.value.stage) == ("backward_weight", 1), str(e.value)
    assert "stage 1 ('sqrt')" in str(e.value) and "weight gradient" in str(e.value)
    _assert_unchanged(before, _snapshot(pipe))


def test_hanging_w_raises_within_the_deadline(no_leftover_threads_after_release):
    release = no_leftover_threads_after_release
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=4, schedule="zb-h1")
    x, y = _batch(4)
    pipe.step(x, y)
    before = _snapshot(pipe)

    def block(spec, k):
        if spec.kind == "backward_weight" and spec.stage == 1 and k == 1:
            release.wait()

    pipe.before_action = block
    pipe.action_timeout = 1.0
    with pytest.raises(sjp.PipelineTimeout) as e:
        pipe.step(x, y)
    assert (e.value.kind, e.value.stage, e.value.microbatch) == ("backward_weight", 1, 1)
    _assert_unchanged(before, _snapshot(pipe))


def test_a_w_left_running_past_its_deadline_never_touches_a_later_step(monkeypatch):
    """A W whose body (not its before_action: a hung collective) outlives its
    step's deadline finishes later, on its own thread. Its weight gradient goes
    into the failed step's accumulator: the next step's gradients are the
    single-device ones (the stale W had added into the next step's)."""
    from sbpjax.pipeline import bodies

    slow = threading.Event()
    original = bodies.StepBodies.backward_weight

    def backward_weight(self, s):
        body = original(self, s)

        def maybe_slow(k, v):
            if slow.is_set() and s == 1 and k == 1:
                time.sleep(3.5)  # inside the body (the runtime cannot skip it), past the 2 s grace
            return body(k, v)

        return maybe_slow

    monkeypatch.setattr(bodies.StepBodies, "backward_weight", backward_weight)
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.0), microbatches=4, schedule="zb-h1")
    x, y = _batch(4)
    pipe.step(x, y)  # compiles (sgd(0): the parameters never change)
    pipe.action_timeout = 0.5
    slow.set()
    with pytest.raises(sjp.PipelineTimeout):
        pipe.step(x, y)
    slow.clear()
    time.sleep(1.5)  # the stale W has finished by now (0.5 s deadline + 2 s grace + 1.5 s > 3.5 s)
    # the next step is judged by its gradients, not its speed: no 0.5 s deadline for it (on a
    # loaded 2-core machine a transfer took 1.4 s there and timed the step out)
    pipe.action_timeout = None
    got = pipe.step(x, y).grads
    params = [_params(0), _params(1)]
    want = jax.grad(lambda ps: mse(layer(ps[1], layer(ps[0], x)), y))(params)
    for g, w in zip(got, want):
        for key in ("w", "b"):
            np.testing.assert_allclose(g[key].numpy(), w[key], rtol=1e-5, atol=1e-6)


def test_an_action_whose_step_failed_while_it_waited_does_not_run(
    monkeypatch, no_leftover_threads_after_release
):
    """A W held in ``before_action`` past the deadline is released after the
    step has failed: its body is not run (it would hold a device for nothing)."""
    from sbpjax.pipeline import bodies

    release = no_leftover_threads_after_release
    ran = []
    original = bodies.StepBodies.backward_weight

    def backward_weight(self, s):
        body = original(self, s)

        def counted(k, v):
            ran.append((s, k))
            return body(k, v)

        return counted

    monkeypatch.setattr(bodies.StepBodies, "backward_weight", backward_weight)
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=4, schedule="zb-h1")
    x, y = _batch(4)
    pipe.step(x, y)

    def block(spec, k):
        if spec.kind == "backward_weight" and spec.stage == 1 and k == 1:
            release.wait()

    # the deadline holds every action: 0.5 s failed the step before W(1, 0) ran
    # when a loaded 2-core CI machine stalled an earlier action that long
    pipe.before_action, pipe.action_timeout = block, 2.0
    ran.clear()
    with pytest.raises(sjp.PipelineTimeout):
        pipe.step(x, y)
    release.set()
    time.sleep(0.5)
    assert (1, 0) in ran and (1, 1) not in ran


GPIPE_TOO_FEW_SLOTS = dict(schedule="gpipe", stash_counts=[1, 1])


def test_counts_take_numpy_ints_and_refuse_bools_and_a_stalling_gpipe():
    """A microbatch count computed with NumPy runs; True is no count; GPipe
    with fewer stash slots than microbatches is refused before it stalls; an
    optimizer whose mask is written for the whole model (not one stage's
    tree) is an SBPError, not optax's raw pytree error."""
    x, y = _batch(2)
    pipe = sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=np.int64(4) // 2)
    assert len(pipe.step(x, y).microbatch_losses) == 2
    for bad in (
        dict(microbatches=True),
        dict(microbatches=2, action_timeout=True),
        dict(microbatches=2, memory_budget=True),
    ):
        with pytest.raises(sj.SBPError, match="True"):
            sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), **bad)
    with pytest.raises(sj.SBPError, match=r"stash_counts \[1, 1\] would stall.*at least 2 slots"):
        sjp.Pipeline(_stages([layer, layer]), mse, optax.sgd(0.1), microbatches=2, **GPIPE_TOO_FEW_SLOTS)
    whole = optax.masked(optax.add_decayed_weights(1e-2), [{"w": True, "b": False}] * 2)
    with pytest.raises(sj.SBPError, match=r"cannot be initialized on stage 0 \('layer0'\)'s own parameters"):
        sjp.Pipeline(_stages([layer, layer]), mse, optax.chain(whole, optax.sgd(0.1)), microbatches=2)


def test_an_integer_parameter_is_refused_by_name():
    """Not a float0 TypeError at the first backward."""
    params = dict(_params(0), n=np.int32(3))
    with pytest.raises(sj.SBPError, match=r"Stage 'counted': parameter \['n'\] has dtype int32"):
        sjp.Stage(layer, params, sj.placement(1, "d"), name="counted")
