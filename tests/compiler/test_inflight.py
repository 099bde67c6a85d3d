"""Many calls and many re-layouts in flight (sbpjax/compiler/inflight.py,
tensor.relayout_together): jax 0.10's CPU client deadlocks when some 30
programs with collectives are queued at once, and aborts the process 40 s
later. A train loop that never reads its results, and a call re-laying out
dozens of arguments, must run to the end and equal one device."""

import textwrap

import numpy as np
import pytest
from conftest import assert_close, run_script

import sbpjax as sj
from sbpjax import B, S
from sbpjax.boxing.lower import boxings_fn
from sbpjax.boxing.plan import plan_boxing
from sbpjax.tensor import relayout_together

# on both CI legs: the deadlock is jax 0.10's; jax 0.12 must run it too
pytestmark = pytest.mark.jax_versions

LOOP = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import sbpjax as sj

    pl = sj.placement(8, "x")
    rng = np.random.default_rng(0)
    L = 12
    params = {f"l{i}": (rng.normal(size=(16, 16)) / 4).astype(np.float32) for i in range(L)}
    x = rng.normal(size=(64, 16)).astype(np.float32)

    def step(p, x):
        def loss(p):
            h = x
            for i in range(L):
                h = jnp.tanh(h @ p[f"l{i}"])
            return (h ** 2).mean()
        value, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda w, d: w - 0.05 * d, p, g), value

    # out_sbp S(0): every call re-lays out the 12 parameters to B (one program)
    f = sj.jit(step, placement=pl, in_sbp=(sj.B, sj.S(0)), out_sbp=(sj.S(0), sj.B), donate_argnums=0)
    ref = jax.jit(step)
    p, q = params, params
    for _ in range(300):  # never reads a result until the end
        p, value = f(p, x)
        q, want = ref(q, x)
    np.testing.assert_allclose(float(value.numpy()), float(want), rtol=1e-4, atol=1e-4 * abs(float(want)) + 1e-7)
    for k in params:
        got, expected = p[k].numpy(), np.asarray(q[k])
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    print("OK", float(value.numpy()))
    """
)


def test_a_train_loop_that_never_reads_its_results_runs_to_the_end():
    out = run_script(["-c", LOOP], timeout=600).stdout
    assert out.startswith("OK"), out


def test_relayout_together_equals_one_to_global_each(pl24):
    rng = np.random.default_rng(1)
    values = [rng.normal(size=s).astype(np.float32) for s in [(8, 12), (16,), (4, 8, 2), (8, 12), (6,)]]
    src = [(S(0), S(1)), (S(0), B), (B, S(1)), (S(1), S(0)), (B, B)]
    dst = [(B, B), (B, S(0)), (S(0), B), (S(1), S(0)), (S(0), B)]
    tensors = [sj.to_global(v, pl24, s) for v, s in zip(values, src)]
    together = relayout_together(tensors, dst)
    for t, v, d, one in zip(tensors, values, dst, together):
        assert one.sbp == d
        np.testing.assert_array_equal(one.numpy(), v)
        np.testing.assert_array_equal(one.to_jax(), t.to_global(sbp=d).to_jax())  # same physical blocks
    assert together[3] is tensors[3]  # already in place: the tensor itself
    # the boxings that move data run as one program, with each one's collectives
    plans = [plan_boxing(t.shape, t.dtype, pl24, s, d) for t, s, d in zip(tensors, src, dst)]
    moving = [(t, p) for t, p in zip(tensors, plans) if p.steps]
    compiled = boxings_fn(tuple(p for _, p in moving)).lower(*[t.physical for t, _ in moving]).compile()
    assert len(moving) == 4
    assert sum(c.bytes for c in sj.collectives(compiled)) == sum(p.bytes for _, p in moving)


def test_a_call_re_laying_out_many_arguments_equals_one_device(pl24):
    rng = np.random.default_rng(2)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) / 3 for _ in range(48)]
    split = [sj.to_global(w, pl24, (S(0), S(1))) for w in ws]
    f = sj.jit(lambda ws: sum(w.sum() for w in ws), placement=pl24, in_sbp=(B, B), out_sbp=(B, B))
    assert_close(f(split).numpy(), sum(w.sum() for w in ws), rtol=1e-5)
    assert all(t.sbp == (S(0), S(1)) for t in split)  # the arguments keep their own layout
