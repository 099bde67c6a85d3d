"""While loops whose trip count is known only at run time (sbpjax.compiler.inner_loops):
no SBPWarning, the carries keep the layouts they arrive in, values equal the
single-device program's, the compiled program keeps the loop with its
collectives inside, and the plan's bytes (one iteration) equal the compiled
program's as sj.collectives counts them."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes
from models import compiled_bytes

import sbpjax as sj
from sbpjax import B, P, S
from sbpjax.comm import _computations


def collectives_in_while_bodies(f, *args) -> set:
    """The kinds of collective the compiled program runs inside a while
    loop's body or condition (or what they call)."""
    comps = _computations(f.lower(*args).compile().as_text())
    names = {k.replace("ENTRY", "", 1): k for k in comps}
    inside: set = set()
    todo = [
        callee
        for lines in comps.values()
        for line in lines
        if re.search(r"\swhile\(", line)
        for callee in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
    ]
    seen: set = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in names:
            continue
        seen.add(name)
        for line in comps[names[name]]:
            inside.update(
                re.findall(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(", line)
            )
            todo += re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", line)
    return inside


def strict(fn, placement, in_sbp, *args, options=None):
    """Compile and run with SBPWarning as an error."""
    f = sj.jit(fn, placement=placement, in_sbp=in_sbp, options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sj.SBPWarning)
        out = f(*args)
    return f, out


def doubling(x):
    return jax.lax.while_loop(lambda c: c.sum() < 1e3, lambda c: c * 2 + 1, x)


def test_a_split_carry_stays_split_and_the_predicate_is_reduced_in_the_loop(pl8):
    X = np.random.default_rng(5).normal(size=(16, 8)).astype(np.float32)
    f, y = strict(doubling, pl8, (S(0),), X)
    assert y.sbp == (S(0),)
    assert_close(y.numpy(), np.asarray(doubling(X)), rtol=1e-6)
    e = f.explain(X)
    # each iteration all-reduces the 4-byte partial sum the predicate compares
    assert e.bytes == compiled_bytes(f, X) == 2 * 7 * 4
    assert "while_iteration" in str(e)
    assert collectives_in_while_bodies(f, X) == {"all-reduce"}


def newton_sqrt(x):
    """Square roots to a tolerance: the carry starts as ``ones_like(x)``."""

    def cond(s):
        return (s[1] < 50) & (jnp.max(jnp.abs(s[0] * s[0] - x)) > 1e-4)

    return jax.lax.while_loop(cond, lambda s: (0.5 * (s[0] + x / s[0]), s[1] + 1), (jnp.ones_like(x), 0))[0]


def counted_sqrt(x):
    return jax.lax.while_loop(
        lambda s: s[1] < 20, lambda s: (0.5 * (s[0] + x / s[0]), s[1] + 1), (jnp.ones_like(x), 0)
    )[0]


@pytest.mark.parametrize("fn,moved", [(newton_sqrt, 2 * 7 * 4), (counted_sqrt, 0)])
def test_a_carry_made_from_a_constant_takes_the_split_of_what_it_meets(pl8, fn, moved):
    """The carry arrives replicated (nothing before the loop chose otherwise);
    kept so, every iteration gathered the split x (20 all-gathers, 71,680 B).
    Split like x (free), an iteration moves only the predicate's max (GSPMD's
    bytes)."""
    X = (np.abs(np.random.default_rng(2).normal(size=(16, 8))) * 10 + 0.1).astype(np.float32)
    f, y = strict(fn, pl8, (S(0),), X)
    assert_close(y.numpy(), np.sqrt(X), rtol=1e-5)
    assert compiled_bytes(f, X) == moved
    assert "all-gather" not in collectives_in_while_bodies(f, X)


def mlp_until_small(x, w):
    """tanh(x @ w) until every entry is small or 50 iterations have run."""

    def body(c):
        h, i = c
        return jnp.tanh(h @ w), i + 1

    return jax.lax.while_loop(lambda c: (jnp.abs(c[0]).max() > 0.05) & (c[1] < 50), body, (x, 0))


def test_a_column_split_body_boxes_its_result_back_to_the_carry_every_iteration(pl24):
    """Rows over x, the kernel's columns over y: each iteration computes its
    columns and gathers them back over y, inside the loop."""
    r = np.random.default_rng(1)
    X = r.normal(size=(16, 32)).astype(np.float32)
    W = (r.normal(size=(32, 32)) / 8).astype(np.float32)
    f, (h, n) = strict(mlp_until_small, pl24, ((S(0), B), (B, S(1))), X, W)
    ref_h, ref_n = jax.jit(mlp_until_small)(X, W)
    assert int(n.numpy()) == int(ref_n) > 1
    assert h.sbp == (S(0), B)
    assert_close(h.numpy(), np.asarray(ref_h), rtol=1e-5, scale=1.0)
    e = f.explain(X, W)
    assert e.bytes == compiled_bytes(f, X, W) > 0
    assert "all-gather" in collectives_in_while_bodies(f, X, W)


def power_iteration(w, v0):
    """The largest singular value of ``w`` to a tolerance, and ``w`` scaled by it."""

    def cond(c):
        i, _, prev, s = c
        return (i < 50) & (jnp.abs(s - prev) > 1e-5 * s)

    def body(c):
        i, v, _, s = c
        u = w @ v
        v = w.T @ (u / jnp.linalg.norm(u))
        return i + 1, v / jnp.linalg.norm(v), s, jnp.linalg.norm(v)

    _, _, _, s = jax.lax.while_loop(cond, body, (0, v0, jnp.float32(0.0), jnp.float32(1.0)))
    return s, w / s


def test_a_replicated_carry_may_take_the_split_the_body_makes_it_in(pl24):
    """Power iteration on a matrix split over both axes of 2x4: ``w.T @ u``
    makes the vector split over y. The carry arrives replicated; kept so,
    every iteration gathered it back (3,152 B per iteration against GSPMD's
    2,048). Carried in the split the body makes it in (B -> S at the entry
    is free; ``inner_loops._carries_as_made``), no iteration gathers: 2,000 B."""
    r = np.random.default_rng(3)
    W = r.normal(size=(64, 48)).astype(np.float32)
    v0 = r.normal(size=(48,)).astype(np.float32)
    layouts = (((S(0), S(1)), (B, B)), ((B, B), (S(0), S(1))))
    f = sj.jit(power_iteration, placement=pl24, in_sbp=layouts[0], out_sbp=layouts[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", sj.SBPWarning)
        s, scaled = f(W, v0)
    ref_s, ref_scaled = jax.jit(power_iteration)(W, v0)
    assert_close(s.numpy(), np.asarray(ref_s), rtol=1e-4)
    assert_close(scaled.numpy(), np.asarray(ref_scaled), rtol=1e-4)
    moved = compiled_bytes(f, W, v0)
    assert moved == f.explain(W, v0).bytes
    assert moved <= gspmd_bytes(power_iteration, pl24, *layouts, (W, v0))
    assert "all-gather" not in collectives_in_while_bodies(f, W, v0)


def test_a_partial_carry_is_reduced_and_an_uneven_one_gathered_before_the_loop(pl8):
    r = np.random.default_rng(2)

    parts = r.normal(size=(8, 16, 8)).astype(np.float32)  # a partial-sum tensor's 8 pieces
    x = sj.from_local_tensors(list(parts), pl8, (P,), (16, 8))
    f, y = strict(doubling, pl8, (P,), x)
    assert_close(y.numpy(), np.asarray(doubling(parts.sum(0))), rtol=1e-5, scale=8.0)
    loop = next(d for d in f.explain(x).propagation.decisions if d.node.name == "while")
    assert loop.in_sbp == [(B,)] and loop.out_sbp == [(B,)]
    # 12 rows on 8 devices: the carry is gathered, the loop runs on the whole value
    Y = r.normal(size=(12, 8)).astype(np.float32)
    g, z = strict(doubling, pl8, (S(0),), Y)
    assert_close(z.numpy(), np.asarray(doubling(Y)), rtol=1e-6)
    loop = next(d for d in g.explain(Y).propagation.decisions if d.node.name == "while")
    assert loop.in_sbp == [(B,)]
    assert g.explain(Y).bytes == compiled_bytes(g, Y)


def test_nested_while_loops_and_constants_read_in_the_loop(pl8):
    r = np.random.default_rng(3)
    X = r.normal(size=(16, 8)).astype(np.float32)
    scale = np.float32(1.5)

    def nested(x, s):
        def inner(c):
            return jax.lax.while_loop(lambda v: jnp.abs(v).sum() < 50.0, lambda v: v * s, c)

        def outer(c):
            h, k = c
            return inner(h) - 1.0, k + 1

        # (a bare counter's bound XLA would find, and count 3 iterations' collectives)
        return jax.lax.while_loop(lambda c: (c[1] < 3) & (jnp.abs(c[0]).max() < 1e6), outer, (x, 0))

    f, (h, k) = strict(nested, pl8, (S(0), B), X, scale)
    ref_h, ref_k = nested(X, scale)
    assert int(k.numpy()) == int(ref_k) == 3
    assert h.sbp == (S(0),)
    assert_close(h.numpy(), np.asarray(ref_h), rtol=1e-5, scale=50.0)
    # per iteration: the outer condition's reduction and the inner one's
    assert f.explain(X, scale).bytes == compiled_bytes(f, X, scale) == 2 * 2 * 7 * 4


def test_a_side_effect_in_the_body_runs_once_per_iteration_and_the_loop_stays_split(pl8):
    """A callback in the body sees the whole carry and runs once per
    iteration, from the first device (as under jax.jit); the carry keeps its
    split."""
    X = np.random.default_rng(4).normal(size=(16, 8)).astype(np.float32)
    seen = []

    def printing(x):
        def body(c):
            jax.debug.callback(lambda v: seen.append(np.asarray(v)), c)
            return c * 2 + 1

        return jax.lax.while_loop(lambda c: c.sum() < 1e3, body, x)

    f = sj.jit(printing, placement=pl8, in_sbp=(S(0),))
    y = f(X)
    jax.effects_barrier()
    assert y.sbp == (S(0),)
    assert_close(y.numpy(), np.asarray(doubling(X)), rtol=1e-6)
    carries, c = [], X
    while c.sum() < 1e3:  # the loop's iterations, in NumPy
        carries.append(c)
        c = c * 2 + 1
    assert len(seen) == len(carries)  # once per iteration, not once per device
    for v, c in zip(seen, carries):
        assert_close(v, c, rtol=1e-6)


def test_the_loops_result_is_boxed_after_it_to_the_layout_out_sbp_asks(pl8):
    X = np.random.default_rng(6).normal(size=(16, 8)).astype(np.float32)
    f = sj.jit(doubling, placement=pl8, in_sbp=(S(0),), out_sbp=(B,))
    y = f(X)
    assert y.sbp == (B,)
    assert_close(y.numpy(), np.asarray(doubling(X)), rtol=1e-6)
    assert f.explain(X).bytes == compiled_bytes(f, X)


def rnn(h0, xs, w, u, v):
    """An RNN over the time steps of ``xs`` (T, batch, features); returns
    the last state and each step's readout."""

    def step(h, x):
        h = jnp.tanh(h @ w + x @ u)
        return h, h @ v

    return jax.lax.scan(step, h0, xs)


@pytest.mark.parametrize("xs_sbp", [(S(1), B), (S(0), S(2))], ids=["batch-split", "time-split"])
def test_a_scan_too_long_to_write_out_runs_split_as_a_loop_of_its_own(pl24, xs_sbp):
    """The time steps pass CompileOptions.unroll_limit: the scan stays one equation,
    its body planned on its own. A batch-split input keeps its split in each
    slice; one split along time (the stacked dim) is gathered along time
    first. Readouts stack in the layout the body chose for them."""
    r = np.random.default_rng(7)
    t, n, d = 64, 16, 8
    xs = r.normal(size=(t, n, d)).astype(np.float32)
    h0 = np.zeros((n, d), np.float32)
    w, u, v = ((r.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32) for _ in range(3))
    in_sbp = ((S(0), B), xs_sbp, (B, B), (B, B), (B, S(1)))
    f, (h, ys) = strict(rnn, pl24, in_sbp, h0, xs, w, u, v, options=sj.CompileOptions(unroll_limit=50))
    ref_h, ref_ys = jax.jit(rnn)(h0, xs, w, u, v)
    assert_close(h.numpy(), np.asarray(ref_h), rtol=1e-5, scale=1.0)
    assert_close(ys.numpy(), np.asarray(ref_ys), rtol=1e-5, scale=3.0)
    e = f.explain(h0, xs, w, u, v)
    loop = next(d for d in e.propagation.decisions if d.node.name == "scan")
    assert all(not (isinstance(s, sj.sbp.Split) and s.dim == 0) for s in loop.in_sbp[1])  # time whole
    assert e.bytes == compiled_bytes(f, h0, xs, w, u, v)
    # the state keeps its batch split; each readout is (batch, v's columns)
    assert h.sbp == (S(0), B) and ys.sbp == (S(1), S(2))
    if xs_sbp == (S(1), B):
        assert e.bytes == 0  # every step runs on the device's rows alone


def test_carries_nothing_reads_after_a_loop_kept_whole_are_not_planned(pl8):
    """A loop kept whole (an effect in its body; a run-time trip count; a scan
    past the unroll limit) whose results are partly used: the carries nothing
    needs (not read after the loop, by its condition, or by an effect) are
    not planned, as XLA drops them. ``explain()`` counts what the compiled
    program moves (before: 114,688 B counted for a dead split matmul chain,
    0 compiled). A carry an effect reads stays, with its exchanges."""
    r = np.random.default_rng(8)
    x = r.normal(size=(16, 64)).astype(np.float32)
    w = (r.normal(size=(64, 64)) / 8).astype(np.float32)

    def printing_step(x, w):  # only the step counter is used; the print keeps the loop whole
        def body(i, c):
            h, s = c
            jax.debug.print("step {i}", i=i)
            return jnp.tanh(h @ w), s + 1.0

        return jax.lax.fori_loop(0, 4, body, (x, 0.0))[1]

    def printing_chain(x, w):  # the print reads the sum, and so the chain
        def body(i, c):
            h, s = c
            jax.debug.print("s {s}", s=s)
            return jnp.tanh(h @ w), s + h.sum()

        return jax.lax.fori_loop(0, 4, body, (x, 0.0))[1]

    def run_time_trips(x, w):
        def body(c):
            k, h = c
            return k * 1.5 + 1.0, jnp.tanh(h @ w)

        return jax.lax.while_loop(lambda c: c[0] < 40.0, body, (jnp.float32(0.0), x))[0]

    def long_scan(x, w):
        def step(c, _):
            h, s = c
            return (jnp.tanh(h @ w), s * 0.5 + 1.0), None

        return jax.lax.scan(step, (x, jnp.float32(1.0)), None, length=64)[0][1]

    options = sj.CompileOptions(unroll_limit=50)
    for fn, live in [
        (printing_step, False),
        (printing_chain, True),
        (run_time_trips, False),
        (long_scan, False),
    ]:
        f = sj.jit(fn, placement=pl8, in_sbp=((S(1),), (S(0),)), options=options)
        e = f.explain(x, w)
        assert e.bytes == compiled_bytes(f, x, w), fn.__name__
        assert (e.bytes > 0) == live, (fn.__name__, e.bytes)
        assert_close(f(x, w).numpy(), np.asarray(jax.jit(fn)(x, w)), rtol=1e-5, scale=1.0)
    jax.effects_barrier()


def test_a_vmapped_while_loop_runs_each_example_its_own_trip_count(pl8):
    """``jax.vmap`` of a ``while_loop`` whose trip count differs per example
    writes a ``while`` on a batched predicate (it crashed: "cond_fun must
    return a boolean scalar"). Each example stops at its own count; split by
    examples the carries stay split and each iteration all-reduces one flag
    (whether any example still runs), as ``explain()`` counts."""
    r = np.random.default_rng(9)
    a = (np.abs(r.normal(size=64)) * 10 + 1).astype(np.float32)
    limit = np.float32(1.5)  # read by the condition: a constant of the loop

    def halvings(a, limit):
        return jax.lax.while_loop(lambda c: c[0] > limit, lambda c: (c[0] / 2, c[1] + 1), (a, 0))

    fn = jax.vmap(halvings, in_axes=(0, None))
    want = jax.jit(fn)(a, limit)
    assert len(set(np.asarray(want[1]).tolist())) > 1  # the trip counts differ
    for sbp, moved in [((S(0),), True), ((B,), False)]:
        f, (x, n) = strict(fn, pl8, (sbp, (B,)), a, limit)
        assert_close(x.numpy(), np.asarray(want[0]), rtol=1e-6)
        assert np.array_equal(n.numpy(), np.asarray(want[1]))
        e = f.explain(a, limit)
        assert e.bytes == compiled_bytes(f, a, limit)
        assert (e.bytes > 0) == moved and e.bytes <= 8 * 7 * 4  # a flag per device, not the carries
        assert x.sbp == sbp
