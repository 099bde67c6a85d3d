"""The plan's estimated peak per device (``explain().estimated_peak_bytes``,
``sbpjax.compiler.liveness``) against XLA's ``memory_analysis()`` of the
compiled program: arguments + outputs + temporaries - aliased."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_peak
from test_regather import WEIGHTS, X, fsdp

import sbpjax as sj
from sbpjax import B, S

PL24 = sj.placement((2, 4), ("x", "y"))


def xla_held(compiled) -> int:
    """What the program holds however XLA schedules it: its arguments and results."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def _megatron_mlp():
    def loss(w1, w2, x):
        return jnp.mean((jax.nn.gelu(x @ w1) @ w2) ** 2)

    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(64, 256)).astype(np.float32)
    w2 = rng.normal(size=(256, 64)).astype(np.float32)
    x = rng.normal(size=(32, 64)).astype(np.float32)
    f = sj.jit(
        jax.value_and_grad(loss, argnums=(0, 1)),
        placement=PL24,
        in_sbp=((B, S(1)), (B, S(0)), (S(0), B)),
        out_sbp=((B, B), ((B, S(1)), (B, S(0)))),
    )
    return f, (w1, w2, x)


def _data_parallel_mlp():
    f = sj.jit(
        jax.value_and_grad(lambda ws, x: jnp.mean(sum(jnp.tanh(x @ w1) @ w2 for w1, w2 in ws) ** 2)),
        placement=sj.placement(8, "x"),
        in_sbp=((B,), (S(0),)),
        out_sbp=((B,), (B,)),
    )
    return f, (WEIGHTS, X)


CASES = {
    "fsdp_held": lambda: (fsdp(False), (WEIGHTS, X)),
    "fsdp_regathered": lambda: (fsdp(True), (WEIGHTS, X)),
    "megatron_mlp_2x4": _megatron_mlp,
    "data_parallel": _data_parallel_mlp,
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_estimate_holds_at_least_what_every_schedule_holds(name):
    """Arguments and results are held whatever XLA fuses or reorders: the
    estimate counts them, and the values live at its peak on top."""
    f, args = CASES[name]()
    e = f.explain(*args)
    compiled = f.lower(*args).compile()
    assert e.estimated_peak_bytes >= xla_held(compiled) > 0
    assert f"estimated peak {e.estimated_peak_bytes} B and {e.estimated_flops} FLOPs per device" in str(e)
    assert "estimated peak" in e.summary().splitlines()[0]


def test_regathers_lower_the_estimate_as_they_lower_xlas_peak():
    """The estimate counts a regathered weight from each gathering to its last
    use before the next: regathering lowers it, as it lowers XLA's peak."""
    held, again = fsdp(False), fsdp(True)
    e_held, e_again = held.explain(WEIGHTS, X), again.explain(WEIGHTS, X)
    assert any(b.regather for b in e_again.boxings)
    assert e_again.estimated_peak_bytes < e_held.estimated_peak_bytes
    assert xla_peak(again.lower(WEIGHTS, X).compile()) < xla_peak(held.lower(WEIGHTS, X).compile())


def _deep_mlp(checkpointed: bool):
    """A 4-layer tanh MLP's loss and gradients, each layer under
    ``jax.checkpoint`` or not."""

    def layer(h, w):
        return jnp.tanh(h @ w)

    blk = jax.checkpoint(layer) if checkpointed else layer

    def loss(ws, x):
        for w in ws:
            x = blk(x, w)
        return jnp.mean(x**2)

    rng = np.random.default_rng(1)
    ws = [rng.normal(size=(64, 64)).astype(np.float32) / 8 for _ in range(4)]
    x = rng.normal(size=(256, 64)).astype(np.float32)
    f = sj.jit(
        jax.value_and_grad(loss), placement=sj.placement(8, "x"), in_sbp=((B,), (S(0),)), out_sbp=((B,), (B,))
    )
    return f.explain(ws, x).propagation


def test_hoisting_moves_only_recomputation():
    """live_bytes(hoisted=True) runs each op of a checkpoint region as early as
    its inputs allow. Without regions the counts are the program order's,
    entry for entry. With them, the recomputation hoisted into the forward
    pass keeps each layer's activations alive until the backward pass reads
    them: more than the program order holds, which recomputes each layer
    just before its backward step."""
    from sbpjax.compiler.liveness import live_bytes

    plain = _deep_mlp(False)
    assert all(d.node.region == 0 for d in plain.decisions)
    np.testing.assert_array_equal(live_bytes(plain, hoisted=True), live_bytes(plain))

    remat = _deep_mlp(True)
    assert any(d.node.region for d in remat.decisions)
    order, hoisted = live_bytes(remat), live_bytes(remat, hoisted=True)
    assert order.shape == hoisted.shape
    # a (256, 64) float32 activation, split 8 ways: 8 KiB per device
    activation = 256 * 64 * 4 // 8
    assert hoisted.max() >= order.max() + 2 * activation, (hoisted.max(), order.max())


def test_layouts_that_differ_only_over_an_axis_of_one_device_are_one_block():
    """On 8x1 a result asked for as (B, S(1)) is the (B, B) value itself: its
    boxing moves nothing and makes no second block. The estimate counts it
    once, as XLA holds it: the same as with out_sbp (B, B) (counted twice,
    each result's bytes came on top: a data-parallel GPT step's estimate was
    1.49x XLA's peak, 1.19x now)."""

    def step(ws, x):
        loss, grads = jax.value_and_grad(lambda ws: jnp.mean(jnp.tanh(x @ ws[0]) @ ws[1]))(ws)
        return loss, [w - 0.1 * g for w, g in zip(ws, grads)]

    rng = np.random.default_rng(2)
    ws = [rng.normal(size=(256, 256)).astype(np.float32) / 16 for _ in range(2)]
    x = rng.normal(size=(64, 256)).astype(np.float32)
    pl = sj.placement((8, 1), ("x", "y"))
    ws_sbp = [(B, B), (B, B)]

    def plan(out_ws):
        f = sj.jit(step, placement=pl, in_sbp=(ws_sbp, (S(0), B)), out_sbp=((B, B), out_ws))
        return f, f.explain(ws, x)

    f_split, split = plan([(B, S(1)), (B, S(0))])
    _, whole = plan(ws_sbp)
    assert split.bytes == whole.bytes
    assert split.estimated_peak_bytes == whole.estimated_peak_bytes
    assert split.estimated_peak_bytes >= xla_held(f_split.lower(ws, x).compile())


def _within_a_tenth(estimate: int, xla: int) -> bool:
    """The issue's criterion for the estimate: within 10% of XLA's peak."""
    return abs(estimate - xla) <= 0.1 * xla


def test_results_are_boxed_after_the_last_op_not_beside_it():
    """``u @ v @ w`` with ``u`` split by columns and ``v`` by rows: both
    products are partial sums and the result is all-reduced at the end. Its
    boxing runs after the last op, when that op's operand ``u @ v`` is dead:
    the most held at once is two whole (m, m) blocks (counted beside the last
    op it was three, 1.31x XLA's peak on the compiler benchmark's row)."""
    from sbpjax.compiler.liveness import live_bytes

    m = 256
    rng = np.random.default_rng(5)
    u, v, w = (rng.normal(size=(m, m)).astype(np.float32) for _ in range(3))
    f = sj.jit(
        lambda u, v, w: u @ v @ w,
        placement=sj.placement(8, "x"),
        in_sbp=((S(1),), (S(0),), (B,)),
        out_sbp=(B,),
    )
    e = f.explain(u, v, w)
    whole = m * m * 4
    assert [b.dst for b in e.propagation.out_boxings] == [(B,)]
    assert len(live_bytes(e.propagation)) == len(e.propagation.decisions) + 1
    assert e.estimated_peak_bytes == 2 * whole // 8 + whole + 2 * whole
    assert _within_a_tenth(e.estimated_peak_bytes, xla_peak(f.lower(u, v, w).compile()))


def _softmax_cross_entropy():
    def ce(z, y):
        zz = z - jax.lax.stop_gradient(z.max(-1, keepdims=True))
        return (jnp.log(jnp.exp(zz).sum(-1)) - jnp.take_along_axis(zz, y[:, None], axis=1)[:, 0]).mean()

    rng = np.random.default_rng(4)
    z = rng.normal(size=(64, 4096)).astype(np.float32)
    y = rng.integers(0, 4096, size=(64,)).astype(np.int32)
    f = sj.jit(ce, placement=sj.placement(8, "x"), in_sbp=((S(1),), (B,)), out_sbp=(B,))
    return f, (z, y)


def _adam_step_8x1():
    import optax

    opt = optax.adam(1e-2)

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def step(ws, state, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        updates, state = opt.update(grads, state, ws)
        return optax.apply_updates(ws, updates), state, value

    rng = np.random.default_rng(3)
    ws = [rng.normal(size=(256, 256)).astype(np.float32) / 16 for _ in range(3)]
    state = opt.init(ws)
    x = rng.normal(size=(64, 256)).astype(np.float32)
    rep = (B, B)
    state_sbp = jax.tree.map(lambda _: rep, state)
    f = sj.jit(
        step,
        placement=sj.placement((8, 1), ("x", "y")),
        in_sbp=([rep] * 3, state_sbp, (S(0), B)),
        out_sbp=([rep] * 3, state_sbp, rep),
    )
    return f, (ws, state, x)


@pytest.mark.parametrize("make", [_softmax_cross_entropy, _adam_step_8x1], ids=["softmax_ce", "adam_8x1"])
def test_values_xla_computes_inside_their_one_reader_are_not_counted(make):
    """``exp(z - max)`` is summed as it is computed, and Adam's per-leaf
    chain (``m / (1 - b1**t)``, ``sqrt(v / (1 - b2**t))``, their ratio...) runs
    as one loop per leaf, though optax computes each stage for every leaf
    before the next: XLA writes none of these values. Counted as written the
    estimate is over 1.1x XLA's peak; with them fused away (their operands
    held to where they are read) it is within 10%."""
    from sbpjax.compiler.liveness import argument_bytes, live_bytes

    f, args = make()
    e = f.explain(*args)
    xla = xla_peak(f.lower(*args).compile())
    as_written = argument_bytes(e.propagation) + int(live_bytes(e.propagation).max())
    assert as_written > 1.1 * xla, (as_written, xla)
    assert e.estimated_peak_bytes < as_written
    assert _within_a_tenth(e.estimated_peak_bytes, xla), (e.estimated_peak_bytes, xla)


def test_a_branch_result_is_held_from_where_the_branches_join():
    """XLA runs one branch of a ``lax.cond``, and its result exists from the
    end of the conditional. The flat program runs both branches' ops in turn:
    ``x * 2``, made first, is counted from the ``select_n`` that joins the
    branches, not through the other branch's matmuls."""
    from sbpjax.compiler.liveness import _branch_results, live_bytes

    rng = np.random.default_rng(6)
    w = rng.normal(size=(256, 256)).astype(np.float32) / 16
    x = rng.normal(size=(64, 256)).astype(np.float32)

    def fn(x, w, flag):
        return jax.lax.cond(flag, lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w), lambda x, w: x * 2.0, x, w)

    f = sj.jit(fn, placement=sj.placement(8, "x"), in_sbp=((S(0),), (B,), (B,)), out_sbp=(S(0),))
    prop = f.explain(x, w, np.bool_(True)).propagation
    names = [d.node.name for d in prop.decisions]
    doubled = next(d.node.outs[0] for d in prop.decisions if d.node.name == "mul" and d.node.branch)
    assert _branch_results(prop)[id(doubled)] == names.index("select_n")
    block = 64 * 256 * 4 // 8
    live = live_bytes(prop)
    # at the first matmul: its result and the flag's index (4 B), never x * 2 beside them
    assert live[names.index("dot_general")] == block + 4
    # the most: both branches' results where they join, and the selected one
    assert live.max() == 3 * block + 4, live


def test_a_branch_result_boxed_where_the_branches_join_is_held_there():
    """The greedy plan of a Megatron block under ``cond`` beside ``x * 2``
    zero-fills ``x * 2`` into a partial sum where the branches join: read only
    by that boxing, it is held at the join, never counted negative before it."""
    from sbpjax.compiler.liveness import live_bytes

    rng = np.random.default_rng(7)
    w1 = rng.normal(size=(64, 256)).astype(np.float32) / 8
    w2 = rng.normal(size=(256, 64)).astype(np.float32) / 16
    x = rng.normal(size=(32, 64)).astype(np.float32)

    def fn(x, w1, w2, flag):
        return jax.lax.cond(
            flag, lambda x, w1, w2: x + jnp.tanh(x @ w1) @ w2, lambda x, *_: x * 2.0, x, w1, w2
        )

    f = sj.jit(
        fn,
        placement=PL24,
        in_sbp=((S(0), B), (B, S(1)), (B, S(0)), (B, B)),
        out_sbp=(S(0), B),
        solver="greedy",
    )
    prop = f.explain(x, w1, w2, np.bool_(True)).propagation
    select = next(i for i, d in enumerate(prop.decisions) if d.node.name == "select_n")
    doubled = next(d.node.outs[0] for d in prop.decisions if d.node.name == "mul" and d.node.branch)
    assert any(b.var is doubled for b in prop.decisions[select].boxings)  # zero-filled at the join
    live = live_bytes(prop)
    block = x.nbytes // 2  # x's (32, 64) float32 block, split 2 ways; x @ w1's too (4 ways of 256)
    flag = 4  # the branch index
    # at the first matmul, its result alone: x * 2 is not yet held (nor taken off before it is)
    assert live[[d.node.name for d in prop.decisions].index("dot_general")] == block + flag, live
    # at the join: x * 2 and its partial form, the block's result and the selected value
    assert live[select] == 4 * block + flag, live


def _benchmark_gpt(d_model: int, layers: int, shape=(2, 4)):
    """The AdamW GPT step of ``benchmarks/compiler.py``'s sweep, as ``sj.jit``
    of it and its arguments."""
    import os

    from conftest import load_module

    benchmarks = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
    bench = load_module(
        os.path.join(benchmarks, "compiler.py"), "bench_compiler_liveness", imports_from=benchmarks
    )
    seen = {}

    def capture(name, fn, pl, leaves_sbp, args, out_sbp, *rest, **kw):
        seen.update(fn=fn, pl=pl, in_sbp=leaves_sbp, args=args, out_sbp=out_sbp)
        return {}

    bench.run_program = capture
    bench.gpt_sweep_row((d_model, layers, shape), 0, -1, np.random.default_rng(0), execute=False)
    f = sj.jit(seen["fn"], placement=seen["pl"], in_sbp=seen["in_sbp"], out_sbp=seen["out_sbp"])
    return f, seen["args"]


def test_a_value_waiting_for_its_boxing_is_held_in_the_smaller_layout():
    """The 1-layer GPT step (d_model 64): its gradients are made in the
    backward pass and boxed for the optimizer at its end. Counted from that
    boxing on only, they were held nowhere while they waited; each is held in
    the smaller of its two layouts (``scheduled=True``, as XLA's scheduler
    runs a boxing that shrinks at once and one that grows late). Up to the
    results' step that only adds values held (a result's boxing that shrinks
    it frees its source at once instead of after the last op), and the
    estimate is within 10% of XLA's peak."""
    from sbpjax.compiler.liveness import live_bytes, regathered

    f, args = _benchmark_gpt(64, 1)
    e = f.explain(*args)
    prop = e.propagation
    held = regathered(prop)
    unscheduled = live_bytes(prop, held, fused=True)
    scheduled = live_bytes(prop, held, fused=True, scheduled=True)
    assert (scheduled[:-1] >= unscheduled[:-1]).all()
    assert scheduled.max() > unscheduled.max()
    assert _within_a_tenth(e.estimated_peak_bytes, xla_peak(f.lower(*args).compile()))


def test_the_estimate_counts_xlas_allocations_not_only_what_is_alive_at_once():
    """The 2-layer GPT step (d_model 256): XLA gives each result an
    allocation of its own for the whole run, which other values use only
    before the result is made, and packs the rest into one more. Its
    ``memory_analysis()`` is those allocations, more than is ever alive at
    once: the live-range peak alone is under 0.9x of it. Counted as XLA
    allocates (``sbpjax.compiler.allocation``), the estimate is within 10%."""
    from sbpjax.compiler.liveness import argument_bytes, live_bytes, regathered

    f, args = _benchmark_gpt(256, 2)
    e = f.explain(*args)
    prop = e.propagation
    xla = xla_peak(f.lower(*args).compile())
    alive = argument_bytes(prop) + int(live_bytes(prop, regathered(prop), fused=True, scheduled=True).max())
    assert alive < 0.9 * xla
    assert _within_a_tenth(e.estimated_peak_bytes, xla), (e.estimated_peak_bytes, xla)


def test_allocated_bytes_reuses_a_result_allocation_only_before_the_result_and_where_it_fits():
    """A result of 100 B made at step 6; temporaries of 100 B (steps 0-2),
    60 B (3-5) and 80 B (4-8, overlapping the result), and one of 120 B (too
    large for it): the first two use the result's allocation one after the
    other, the last two go to the packed one, where they are alive together
    at steps 4-5."""
    from sbpjax.compiler.allocation import Value, allocated_bytes

    result = Value(100, 6, 9)
    temps = [Value(100, 0, 2), Value(60, 3, 5), Value(80, 4, 8), Value(120, 1, 5)]
    assert allocated_bytes(temps, [result], 10) == 100 + 80 + 120
    # without the result, all four are packed: at steps 4-5, 60 + 80 + 120 alive
    assert allocated_bytes(temps, [], 10) == 60 + 80 + 120


@pytest.mark.parametrize(
    "d_model, layers, shape",
    [
        (128, 2, (2, 4)),
        (512, 2, (2, 4)),
        (128, 2, (4, 2)),
        (128, 2, (8, 1)),
        (128, 2, (1, 8)),
        (64, 4, (2, 4)),
    ],
)
def test_the_estimate_is_within_a_tenth_of_xlas_on_the_benchmark_rows(d_model, layers, shape):
    """Issue 51's criterion on the GPT sweep rows of ``benchmarks/compiler.py``
    that compile in seconds (the others, with the transformer steps, are in
    its results file: ``--estimates-only`` writes both figures)."""
    f, args = _benchmark_gpt(d_model, layers, shape)
    est, xla = f.explain(*args).estimated_peak_bytes, xla_peak(f.lower(*args).compile())
    assert _within_a_tenth(est, xla), (est, xla)
