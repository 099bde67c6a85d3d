"""A 2-stage pipeline (1F1B, or the schedule named by the first argument, e.g.
zb-h1), stage 0 on devices 0-3 and stage 1 on devices 4-7.

Run alone on 8 devices (one process: the threaded runtime) or under
``python -m sbpjax.launch -n 2 --local-devices 4`` (one stage per process: the
lockstep runtime, transfers as collectives between the processes). Either
way every step is checked against the same training on one device (plain
JAX, the whole batch), and the losses are printed for tests/test_multihost.py
to compare the two runs.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sbpjax as sj
import sbpjax.pipeline as sjp
from sbpjax import B, S

D, H, MICRO, BATCH = 8, 32, 4, 16
rng = np.random.default_rng(0)
w1 = (rng.normal(size=(D, H)) / 3).astype(np.float32)
w2 = (rng.normal(size=(H, D)) / 6).astype(np.float32)
batches = [
    (rng.normal(size=(BATCH, D)).astype(np.float32), rng.normal(size=(BATCH, D)).astype(np.float32))
    for _ in range(3)
]


def first(p, x):
    return jnp.tanh(x @ p["w1"])


def second(p, h):
    return h @ p["w2"]


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


devices = np.array(jax.devices())
pl0 = sj.Placement(devices[:4], ("tp",))
pl1 = sj.Placement(devices[4:], ("tp",))
pipe = sjp.Pipeline(
    [
        sjp.Stage(first, {"w1": w1}, pl0, param_sbp={"w1": (S(1),)}, out_sbp=(S(1),), name="first"),
        sjp.Stage(second, {"w2": w2}, pl1, param_sbp={"w2": (S(0),)}, in_sbp=(S(1),), name="second"),
    ],
    loss_fn,
    optax.sgd(0.5),
    microbatches=MICRO,
    schedule=sys.argv[1] if len(sys.argv) > 1 else "1f1b",
    target_sbp=(B,),
)
print("RUNTIME", "lockstep" if pipe.lockstep else "threaded")


def whole(p, x, t):
    return loss_fn(second(p, first(p, x)), t)


params = {"w1": w1, "w2": w2}
opt = optax.sgd(0.5)
state = opt.init(params)
losses = []
for x, t in batches:
    result = pipe.step(x, t)
    want, grads = jax.value_and_grad(whole)(params, x, t)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(result.loss, float(want), rtol=1e-5, atol=1e-6)
    for s, name in ((0, "w1"), (1, "w2")):
        if pipe.here[s]:  # a stage's parameters live in the process that runs it
            got = pipe.stages[s].params[name].numpy()
            np.testing.assert_allclose(got, np.asarray(params[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    losses.append(result.loss)
kinds = sorted({r.kind for r in result.timeline.actions})
print("KINDS", kinds)
print("LOSSES", repr([float(v) for v in losses]))
if pipe.lockstep:
    # a process stepping another batch shape: refused in every process before any
    # transfer (gloo aborted the run, or timed out after 30 s, when it was not)
    x, t = batches[0]
    rows = BATCH if jax.process_index() == 0 else BATCH // 2
    try:
        pipe.step(x[:rows], t[:rows])
    except sj.SBPError as e:
        assert "run another step than process 0" in str(e), e
        print("MISMATCH REFUSED", jax.process_index())
    # a batch one process refuses itself (rows the microbatches do not divide): the
    # other process hears of it in the exchange instead of waiting there for ever
    rows = BATCH if jax.process_index() == 0 else BATCH - 1
    try:
        pipe.step(x[:rows], t[:rows])
    except sj.SBPError as e:
        mine = "run another step than process 0" if jax.process_index() == 0 else "microbatches"
        assert mine in str(e), e
        print("REFUSAL SHARED", jax.process_index())
print("OK", jax.process_index())
