"""The whole-program layout choice (sbpjax/compiler/choose.py): bytes against
GSPMD given the same annotations, read from both compiled programs; values
against the single-device program."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from models import (
    deep_mlp_loss,
    deep_mlp_params,
    deep_mlp_sbp,
    gpt_loss,
    gpt_params,
    gpt_sbp,
    is_nd_sbp,
    layernorm,
    state_sbp,
)

import sbpjax as sj
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler import pricing
from sbpjax.compiler.choose import total_bytes
from sbpjax.layout import Geometry

S0, S1, B, P = sj.S(0), sj.S(1), sj.B, sj.P
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def is_gt(v):
    return isinstance(v, sj.GlobalTensor)


def measured(compiled) -> int:
    return sum(c.bytes for c in sj.collectives(compiled))


def spec_of(nd, ndim, pl):
    """The PartitionSpec GSPMD uses for an S/B nd-SBP."""
    return Geometry((1,) * ndim, pl.shape).partition_spec(
        normalized_layout(nd, ndim, pl.shape), pl.axis_names
    )


def assert_close(got, want, what, atol_floor=0.0):
    """rtol, and an atol scaled to the operand's magnitude (a value near zero
    is a difference of larger terms, so its rounding is relative to them)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w, np.float32)
        atol = max(atol_floor, 1e-5 * max(1.0, float(np.abs(w).max(initial=0.0))))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=2e-4, atol=atol, err_msg=what)


def assert_step_close(got, want, what, adam_lr=None):
    """(params, state, loss) of a train step. Adam's update is lr * m / sqrt(v)
    per entry: a gradient entry at rounding-noise level (zero in exact
    arithmetic) becomes an update of up to +-lr in any program, so with Adam
    the parameters get an atol of 2 lr; the optimizer state (the gradients'
    moments) and the loss are held to the tight tolerance."""
    params, state, loss = got
    assert_close(state, want[1], what + ": optimizer state")
    assert_close(loss, want[2], what + ": loss")
    assert_close(params, want[0], what + ": parameters", atol_floor=2 * adam_lr if adam_lr else 0.0)


def compare(step, args, in_sbp, out_sbp, pl, solver="ilp", adam_lr=None, cost_model=None, options=None):
    """sbpjax and GSPMD on the same step and layouts: (sbpjax bytes, GSPMD
    bytes, explanation, sbpjax's compiled program); both checked against the
    single-device step."""
    want = jax.jit(step)(*args)
    f = sj.jit(
        step,
        placement=pl,
        in_sbp=in_sbp,
        out_sbp=out_sbp,
        solver=solver,
        cost_model=cost_model,
        options=options,
    )
    got = f(*args)
    assert_step_close(jax.tree.map(lambda t: t.numpy(), got, is_leaf=is_gt), want, "sbpjax", adam_lr)
    compiled = f.lower(*args).compile()
    e = f.explain(*args)
    ours = measured(compiled)
    assert ours == e.bytes  # the plan is what XLA runs
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, want)
    assert_step_close(g(*g_args), want, "gspmd", adam_lr)
    return ours, measured(g.lower(*g_args).compile()), e, compiled


def collective_count(compiled) -> int:
    """The collectives ``compiled`` runs (``sj.collectives``' counts summed)."""
    return sum(c.count for c in sj.collectives(compiled))


def gspmd_jit(step, args, in_sbp, out_sbp, pl, want):
    """GSPMD's ``jax.jit`` of ``step`` given the same layouts, and ``args``
    placed so (``want``: the step's results, for their shapes)."""

    def shardings(sbp_tree, values):
        return jax.tree.map(
            lambda nd, v: NamedSharding(pl.mesh, spec_of(nd, np.ndim(v), pl)),
            sbp_tree,
            values,
            is_leaf=is_nd_sbp,
        )

    in_sh = shardings(in_sbp, args)
    g = jax.jit(step, in_shardings=in_sh, out_shardings=shardings(out_sbp, want))
    return g, jax.device_put(args, in_sh)


def train_step(loss_fn, opt, *extra):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y, *extra)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step


def gpt_case(pl, kind, d, layers, opt, data_axis=0, seed=0, vocab=64, batch=16, seq=8, heads=4):
    params = gpt_params(d, layers, vocab, seed=seed)
    r = np.random.default_rng(seed + 1)
    tokens = r.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    labels = r.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    state = opt.init(params)
    rep = (B,) * pl.ndim
    psbp = gpt_sbp(params, kind, pl.ndim)
    ssbp = state_sbp(state, psbp, rep)
    dsbp = tuple(S0 if a == data_axis else B for a in range(pl.ndim))
    step = train_step(gpt_loss, opt, heads)
    return step, (params, state, tokens, labels), (psbp, ssbp, dsbp, dsbp), (psbp, ssbp, rep)


def mlp_case(pl, kind, d, layers, opt, seed=0, batch=32):
    """A deep MLP's train step (models.deep_mlp_*), the batch split over the
    first axis: (step, args, in_sbp, out_sbp)."""
    params = deep_mlp_params(d, layers, seed=seed)
    r = np.random.default_rng(seed + 1)
    x, y = (r.normal(size=(batch, d)).astype(np.float32) for _ in range(2))
    state = opt.init(params)
    rep = (B,) * pl.ndim
    psbp = deep_mlp_sbp(params, kind, pl.ndim)
    ssbp = state_sbp(state, psbp, rep)
    dsbp = (S0,) + rep[1:]
    step = train_step(deep_mlp_loss, opt)
    return step, (params, state, x, y), (psbp, ssbp, dsbp, dsbp), (psbp, ssbp, rep)


# ---------------------------------------------------------------------------
# The two cases
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_gpt_hybrid_d128_on_2x4_moves_no_more_than_gspmd():
    """examples/gpt_hybrid.py's model (Flax NNX, Megatron rules, adamw) at
    d_model 128 on 2x4: the greedy pass moved 44.3 MB where GSPMD moves 28.3 MB.
    Values checked with SGD (Adam turns rounding noise in a gradient that is
    zero in exact arithmetic into +-lr, in any program). The plan does not
    depend on how fast the machine runs the solver (a wall-clock limit once
    stopped it at 28.0 MB on a loaded CI machine, over GSPMD's 25.6 MB)."""
    sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples")]
    try:
        from train import reference_step, run_both
    finally:
        del sys.path[:2]
    cfg = (96, 32, 128, 4, 2, 16)  # vocab, seq, d_model, heads, layers, batch
    pl = sj.placement((2, 4), ("x", "y"))
    rng = np.random.default_rng(0)
    batch = tuple(rng.integers(0, 96, size=(16, 32)).astype(np.int32) for _ in range(2))
    r = run_both(cfg, pl, optax.adamw(1e-3, weight_decay=0.01), batch)
    assert r["sbpjax_bytes"] == r["sbpjax_explained_bytes"]
    assert r["sbpjax_bytes"] <= r["gspmd_bytes"], (r["sbpjax_bytes"], r["gspmd_bytes"])
    gspmd_loss = np.asarray(r["gspmd_result"][1])
    np.testing.assert_allclose(
        r["sbpjax_result"][1], gspmd_loss, rtol=2e-5, atol=2e-5 * np.abs(gspmd_loss).max()
    )
    check = run_both(cfg, pl, optax.sgd(0.1), batch)
    ref_params, ref_loss = reference_step(cfg, optax.sgd(0.1), batch)
    np.testing.assert_allclose(
        check["sbpjax_result"][1], ref_loss, rtol=2e-5, atol=2e-5 * np.abs(ref_loss).max()
    )
    assert_close(check["sbpjax_result"][0], jax.tree.map(np.asarray, ref_params), "sbpjax sgd step")


def test_pure_data_parallel_adamw_all_reduces_each_gradient_once():
    """A Megatron-annotated GPT on an 8x1 placement is plain data parallelism:
    each gradient is all-reduced once (greedy reduce-scattered it at g**2 and
    again for the first moment), plus the loss's own all-reduce: GSPMD's plan."""
    pl = sj.placement((8, 1), ("x", "y"))
    step, args, in_sbp, out_sbp = gpt_case(pl, "megatron", 32, 1, optax.adamw(1e-2, weight_decay=0.1))
    ours, gspmd, e, compiled = compare(step, args, in_sbp, out_sbp, pl, adam_lr=1e-2)
    found = sj.collectives(compiled)
    assert {c.op for c in found} == {"all-reduce"}  # no gradient reduced in pieces, no row gathered
    params = sum(np.asarray(v).nbytes for v in jax.tree.leaves(args[0]))
    # a ring all-reduce of |T| on 8 devices receives 2 * 7 * |T| bytes in all:
    # every gradient and the scalar loss exactly once (XLA may combine them
    # into one tuple all-reduce; the bytes are the same)
    assert ours == sum(c.bytes for c in found) == 2 * 7 * (params + 4)
    assert ours <= gspmd
    greedy = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp, solver="greedy")
    assert ours < greedy.explain(*args).bytes  # the case greedy got wrong

    # Bytes alone (no latency, CompileOptions.latency) make the embedding's
    # gradient a scatter-add of the batch's gathered ids and rows: fewer bytes
    # than all-reducing the table, in more collectives. The latency of those
    # collectives (100 kB each on the default cost model) outweighs the saving.
    # (fewer_collectives off: its second solve, by the ring's latency, would
    # take the one all-reduce back from the plan by bytes alone.)
    bytes_only = sj.CompileOptions(latency=False, fewer_collectives=0)
    f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp, options=bytes_only)
    by_bytes = f.explain(*args)
    assert by_bytes.bytes < ours
    count = lambda ex: sum(len([s for s in b.plan.steps if s.bytes]) for b in ex.propagation.boxings)  # noqa: E731
    assert count(by_bytes) > count(e)
    assert pricing.price(by_bytes.propagation) > pricing.price(e.propagation)


def test_explain_reports_the_choice(pl24):
    """explain() names the method, the objective, the proven gap and the
    solve time; solver='greedy' skips the solver."""
    step, args, in_sbp, out_sbp = gpt_case(pl24, "megatron", 32, 1, optax.adamw(1e-2))
    f = sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp)
    e = f.explain(*args)
    c = e.choice
    assert c.greedy_bytes is not None and c.ilp_bytes is not None and c.solve_s > 0
    # the plan kept is the cheaper by the objective (bytes and latency: pricing.price);
    # the regathers "auto" adds afterwards (sbpjax.compiler.regather) count in e.bytes
    regathers = sum(b.bytes for b in e.boxings if b.regather)
    assert c.method == "ilp" and e.bytes == c.ilp_bytes + regathers
    assert c.objective is not None and c.objective >= c.ilp_bytes
    assert c.gap is not None and 0 <= c.gap <= 1e-9 and c.bound <= c.objective + 1e-6
    # the problem's size: every op, the decisions they make, the nodes and edges
    assert c.ops == len(e.propagation.decisions) and 0 < c.groups <= c.variables and c.constraints > 0
    text = str(e)
    assert "layouts: whole-program choice" in text and "proven gap 0.00%" in text, text
    assert f"{c.ops} ops in {c.groups} decisions" in text, text
    g = sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp, solver="greedy").explain(*args)
    assert g.choice.method == "greedy" and g.choice.ilp_bytes is None and g.bytes == c.greedy_bytes
    with pytest.raises(sj.SBPError, match="solver='fast' is not one of"):
        sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp, solver="fast").explain(*args)


def test_the_solvers_problems_are_those_the_checked_constructor_makes(pl24, monkeypatch):
    """form_problem hands the settling rounds' tables to the solver unchecked
    (``Problem._prechecked``): on a GPT step every problem equals the one the
    checking constructor makes from the same tables, array for array."""
    from sbpjax.compiler import backend
    from sbpjax.solver import Problem

    made = []
    unchecked = backend.form_problem

    def compared(form, usage_limit=None):
        p = unchecked(form, usage_limit)
        q = Problem(form.costs, [(u, v, t) for (u, v), t in form.edges.items()])
        assert len(p.costs) == len(q.costs) and len(p.edges) == len(q.edges)
        for a, b in zip(p.costs, q.costs):
            assert a.dtype == b.dtype == np.float64 and a.shape == b.shape and np.array_equal(a, b)
        for e, f in zip(p.edges, q.edges):
            assert (e.u, e.v) == (f.u, f.v) and e.costs.shape == f.costs.shape
            assert e.costs.dtype == np.float64 and np.array_equal(e.costs, f.costs)
        made.append(p)
        return p

    monkeypatch.setattr(backend, "form_problem", compared)
    step, args, in_sbp, out_sbp = gpt_case(pl24, "megatron", 32, 1, optax.adamw(1e-2))
    sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp, plan_cache=False).explain(*args)
    assert len(made) > 1, "no settling rounds ran"


def test_partial_with_several_consumers_is_reduced_once(pl8):
    """A partial gradient used by two ops that cannot take it (g**2 and g/2):
    one all-reduce serves both."""
    W = np.random.default_rng(0).normal(size=(32, 32)).astype(np.float32)
    X = np.random.default_rng(1).normal(size=(64, 32)).astype(np.float32)

    def fn(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)
        return jnp.sqrt(g**2 + 1.0) + jnp.exp(g)

    f = sj.jit(fn, placement=pl8, in_sbp=((B,), (S0,)), out_sbp=(B,))
    np.testing.assert_allclose(f(W, X).numpy(), fn(W, X), rtol=1e-5, atol=1e-6)
    found = sj.collectives(f.lower(W, X).compile())
    assert sum(c.bytes for c in found) == f.explain(W, X).bytes
    assert [(c.op, c.bytes) for c in found] == [("all-reduce", 2 * 7 * W.nbytes)]


# ---------------------------------------------------------------------------
# Property sweep: random GPT / MLP train steps, every placement and annotation
# ---------------------------------------------------------------------------

PLACEMENTS = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2), "2x2x2": (2, 2, 2)}


def _sweep_cases(n=10, seed=12):
    r = np.random.default_rng(seed)
    cases = []
    names = list(PLACEMENTS)
    for i in range(n):
        model = ["gpt", "mlp"][i % 2]
        placement = names[i % len(names)]
        kind = ["dp", "megatron", "2d"][int(r.integers(3))] if PLACEMENTS[placement][0] > 1 else "megatron"
        d = int(r.choice([32, 64, 128, 256] if model == "mlp" else [32, 64, 128]))
        layers = int(r.integers(1, 4))
        if model == "gpt" and layers == 3:
            # the draw's other fields kept; a 3-layer GPT at width 128 took 80-110 s of a CI
            # run, and the width changes the sizes, not the ops, rules or layouts to choose
            d = min(d, 64)
        cases.append(
            dict(
                model=model,
                placement=placement,
                kind=kind,
                d=d,
                layers=layers,
                opt=["adamw", "momentum"][int(r.integers(2))],
                seed=int(r.integers(1000)),
            )
        )
    return cases


def test_data_parallel_on_4x2_runs_the_one_all_reduce_the_cost_model_times_faster():
    """docs/concepts/compiler.md: a data-parallel MLP step on 4x2 (y idle).
    By bytes first each gradient is a slice over y, a reduce-scatter over x
    and an all-gather over all 8 devices: 5,242,928 B in 3 collectives,
    17% fewer bytes than GSPMD's one all-reduce, more than
    FEWER_COLLECTIVES' 10%. The second solve, with each collective at its
    ring latency, finds GSPMD's all-reduce: a third of the collectives, no
    larger estimated peak, faster by the cost model; so it is kept. A slower
    launch (alpha 1e-4) prices the same plan in the first solve already."""
    pl = sj.placement((4, 2), ("x", "y"))
    step, args, in_sbp, out_sbp = mlp_case(pl, "dp", 256, 1, optax.sgd(0.1, momentum=0.9))
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, jax.eval_shape(step, *args))
    assert collective_count(g.lower(*g_args).compile()) == 1
    for cm in (None, sj.CostModel(alpha=1e-4)):
        ours, gspmd, e, compiled = compare(step, args, in_sbp, out_sbp, pl, cost_model=cm)
        assert ours == gspmd == 6291504
        assert [c.op for c in sj.collectives(compiled)] == ["all-reduce"]
        if cm is None:  # the plan by bytes first was the three collectives
            note = e.choice.latency_note
            assert "in place of 5242928 B" in note and "half the collectives, no larger peak" in note, note
            assert "1 collectives in place of 3" in note, note


@pytest.mark.slow
def test_fewer_collectives_are_not_bought_with_a_checkpointed_steps_memory():
    """benchmarks/models.py's unrolled decoder (4 layers, each under
    jax.checkpoint; Megatron annotations on 2x4). The bytes-first plan splits
    the batch over all 8 devices and gathers the weights. Solved again with
    each collective's ring latency, the plan is Megatron over y: under half
    the collectives and a smaller program-order peak estimate, but each
    layer's residual stream replicated over y. XLA does not recompute each
    layer just before its backward step, and the trade raised XLA's peak
    (1.07x GSPMD's at the time). With the recomputation hoisted the estimate
    sees it, and the bytes-first plan is kept."""
    from conftest import load_module, xla_peak

    from sbpjax.compiler.buckets import emitted_collectives
    from sbpjax.compiler.liveness import live_bytes

    benchmarks = os.path.join(ROOT, "benchmarks")  # its models.py, not this folder's
    bench = load_module(os.path.join(benchmarks, "models.py"), "bench_models", imports_from=benchmarks)

    def plan(options):
        m = bench.build("decoder_unrolled", bench.configs(False), np.random.default_rng(0))
        f = sj.jit(
            m["step"], placement=m["placement"], in_sbp=m["in_sbp"], out_sbp=m["out_sbp"], options=options
        )
        flat, tree = f._globals(m["args"], {})
        args, _ = jax.tree_util.tree_unflatten(tree, flat)
        return f.explain(*args), f.lower(*args).compile()

    kept, kept_compiled = plan(sj.CompileOptions())
    assert "that plan kept" not in (kept.choice.latency_note or ""), kept.choice.latency_note
    # every ring-priced plan within the bytes bound: the plan the peak condition refused
    ring, ring_compiled = plan(sj.CompileOptions(fewer_collectives=1e9))
    if "that plan kept" not in ring.choice.latency_note:
        # jax 0.12.1 traces this step so that no ring-priced plan beats the
        # bytes-first one (55.2 MB either way, against 54.9 MB and a 76.1 MB
        # ring plan on jax 0.12.0): there is no trade to refuse
        assert jax.__version_info__ >= (0, 12, 1), ring.choice.latency_note
        assert ring.bytes == kept.bytes, (ring.bytes, kept.bytes)
        return
    a, k = ring.propagation, kept.propagation
    # what the rule counts: the collectives each plan launches, combined as the lowering combines them
    launched = [pricing.count_collectives(p, emitted_collectives(p)) for p in (a, k)]
    assert 2 * launched[0] <= launched[1], launched
    assert measured(kept_compiled) < measured(ring_compiled)
    assert live_bytes(a).max() <= live_bytes(k).max()
    assert live_bytes(a, hoisted=True).max() > live_bytes(k, hoisted=True).max()
    assert xla_peak(kept_compiled) < xla_peak(ring_compiled)


def test_a_deep_data_parallel_step_on_4x2_runs_the_one_all_reduce_too():
    """The same on a 3-layer GPT (drawn by the random sweep's seed 202,
    1,066 ops): each gradient's slice, reduce-scatter and all-gather become
    GSPMD's one all-reduce."""
    pl = sj.placement((4, 2), ("x", "y"))
    step, args, in_sbp, out_sbp = gpt_case(pl, "dp", 64, 3, optax.adamw(1e-2, weight_decay=0.1), seed=461)
    ours, gspmd, e, compiled = compare(step, args, in_sbp, out_sbp, pl, adam_lr=1e-2)
    assert ours == gspmd == 7489584
    assert [c.op for c in sj.collectives(compiled)] == ["all-reduce"]


def _two_d(sbp_tree):
    """Megatron over the last axis plus the other split dim over the first
    axis (2-D parameter layouts: kernels split on both axes)."""

    def f(nd):
        if isinstance(nd[-1], sj.sbp.Split):
            other = S0 if nd[-1] == S1 else S1
            return (other,) + nd[1:]
        return nd

    return jax.tree.map(f, sbp_tree, is_leaf=is_nd_sbp)


# Three draws: seed 31's found the 2-D misses fixed by gathering split weights
# at contractions (domains.Domains._gathered); seed 77's the data-parallel
# steps on 4x2 fixed by letting contractions run whole on an idle axis
# (Domains.idle) and planning boxings by bytes plus launches
# (CompileOptions.launch_priced).
SWEEP_SEEDS = (12, 31, 77)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [c for seed in SWEEP_SEEDS for c in _sweep_cases(seed=seed)],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_sweep_bytes_at_most_gspmd(case):
    pl = sj.placement(PLACEMENTS[case["placement"]], ("x", "y", "z")[: len(PLACEMENTS[case["placement"]])])
    opt = optax.adamw(1e-2, weight_decay=0.1) if case["opt"] == "adamw" else optax.sgd(0.1, momentum=0.9)
    kind = "megatron" if case["kind"] == "2d" else case["kind"]
    if case["model"] == "gpt":
        step, args, in_sbp, out_sbp = gpt_case(pl, kind, case["d"], case["layers"], opt, seed=case["seed"])
    else:
        step, args, in_sbp, out_sbp = mlp_case(pl, kind, case["d"], case["layers"], opt, seed=case["seed"])
    if case["kind"] == "2d":
        psbp2 = _two_d(in_sbp[0])
        ssbp2 = state_sbp(args[1], psbp2, (B,) * pl.ndim)
        in_sbp = (psbp2, ssbp2) + in_sbp[2:]
        out_sbp = (psbp2, ssbp2, out_sbp[2])
    ours, gspmd, e, compiled = compare(
        step, args, in_sbp, out_sbp, pl, adam_lr=1e-2 if case["opt"] == "adamw" else None
    )
    assert ours <= gspmd, (ours, gspmd, e.choice.describe())
    # and no more than twice GSPMD's collectives (CompileOptions.fewer_collectives)
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, jax.eval_shape(step, *args))
    g_count = collective_count(g.lower(*g_args).compile())
    count = collective_count(compiled)
    assert count <= 2 * g_count, (count, g_count, e.choice.describe())


def test_two_d_mlp_on_4x2_with_momentum_moves_no_more_than_gspmd():
    """A 3-layer MLP at d 32 with kernels split over both axes (2-D) on 4x2,
    SGD with momentum (found by the sweep with seed 31). Until contractions
    could all-gather a 2-D weight over one of its axes (domains.Domains.
    _gathered) the kernels stayed split and activations were permuted around
    them: 326,712 B in 48 collectives against GSPMD's 323,632 B in 17."""
    pl = sj.placement((4, 2), ("x", "y"))
    ours, gspmd, e, compiled, g_count = _two_d_mlp_against_gspmd(pl, 32, 3, seed=605)
    assert ours <= gspmd, (ours, gspmd)
    assert collective_count(compiled) <= g_count
    # the kernels are gathered over x where the contractions read them (ZeRO-3)
    assert any(c.op == "all-gather" and c.group_size == 4 for c in sj.collectives(compiled))
    assert _every_kernel_gathered(e, 6), e


def test_fsdp_kernels_on_8x1_are_gathered_where_read():
    """ZeRO-3 / FSDP on a one-axis placement: a 2-layer MLP at d 32 on 8x1
    whose kernels are split over x, the axis the batch is split over (the
    sweep's "2d" layouts, seed 1000). While only weights split over two axes
    could be gathered at a contraction (Domains._gathered), the
    second kernel of each layer stayed split: its matmul all-to-alled the
    activations and the kernel and reduce-scattered the product, 301,112 B
    in 12 collectives against GSPMD's 344,120 B in 5. Gathered like the
    first kernel: 258,104 B in 8."""
    pl = sj.placement((8, 1), ("x", "y"))
    ours, gspmd, e, compiled, g_count = _two_d_mlp_against_gspmd(pl, 32, 2, seed=151)
    assert ours <= gspmd, (ours, gspmd)
    assert collective_count(compiled) <= 2 * g_count, e
    assert not any(c.op == "all-to-all" for c in sj.collectives(compiled)), e
    assert _every_kernel_gathered(e, 4), e


def _two_d_mlp_against_gspmd(pl, d, layers, seed):
    """An MLP step (SGD with momentum) with the sweep's "2d" kernel layouts
    on ``pl``, against GSPMD: ``compare``'s results and GSPMD's collective
    count."""
    step, args, in_sbp, out_sbp = mlp_case(pl, "megatron", d, layers, optax.sgd(0.1, momentum=0.9), seed=seed)
    psbp = _two_d(in_sbp[0])
    in_sbp = (psbp, state_sbp(args[1], psbp, (B, B))) + in_sbp[2:]
    out_sbp = (psbp, in_sbp[1], (B, B))
    ours, gspmd, e, compiled = compare(step, args, in_sbp, out_sbp, pl)
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, jax.eval_shape(step, *args))
    return ours, gspmd, e, compiled, collective_count(g.lower(*g_args).compile())


def _every_kernel_gathered(e, n_kernels) -> bool:
    """Whether the plan all-gathers each of a deep MLP step's ``n_kernels``
    kernels (its parameters, the program's first inputs) somewhere."""
    kernels = e.propagation.program.inputs[:n_kernels]
    gathered = {id(b.var) for b in e.boxings if any(s.op == "all_gather" for s in b.plan.steps)}
    return all(id(v) in gathered for v in kernels)


@pytest.mark.slow
def test_data_parallel_on_4x2_all_reduces_over_the_data_axis_alone():
    """Data parallelism annotated on 4x2 (the batch split over x, nothing
    over y; found by the sweep with seed 77): GSPMD runs the step replicated
    over y and all-reduces the gradients over x. Two things made sbpjax split
    attention over y and reduce over all 8 devices instead (1,479,728 B in
    20 collectives against GSPMD's 1,382,448 B in 1): contractions had to use
    every device, also on an axis no argument is split over
    (``Domains.idle``), and a small gradient's reduction over x was planned
    by bytes alone, as a slice, a reduce-scatter and an all-gather
    (``CompileOptions.launch_priced``)."""
    pl = sj.placement((4, 2), ("x", "y"))
    opt = optax.adamw(1e-2, weight_decay=0.1)
    step, args, in_sbp, out_sbp = gpt_case(pl, "dp", 32, 2, opt, seed=258)
    ours, gspmd, e, compiled = compare(step, args, in_sbp, out_sbp, pl, adam_lr=1e-2)
    assert ours <= gspmd, (ours, gspmd, e.choice.describe())
    found = sj.collectives(compiled)
    # every gradient and the loss, each once, over x alone (XLA combines them)
    assert {(c.op, c.group_size) for c in found} == {("all-reduce", 4)}, found
    params = sum(np.asarray(v).nbytes for v in jax.tree.leaves(args[0]))
    # a ring all-reduce of |T| over 4 devices receives 2 * 3 * |T|, in each of 2 groups
    assert ours == 2 * (2 * 3) * (params + 4)


@pytest.mark.slow
def test_two_d_gpt_on_2x2x2_with_an_idle_axis_moves_no_more_than_gspmd():
    """A 2-layer GPT at d 32 with 2-D weights on 2x2x2, SGD with momentum
    (found by the sweep with seed 5): the batch and the weights' splits are
    over x and z, so y is idle. A time-limited solve of its 67,000-binary
    integer program once ended at 1,828,896 B, above GSPMD's 1,781,792."""
    pl = sj.placement((2, 2, 2), ("x", "y", "z"))
    opt = optax.sgd(0.1, momentum=0.9)
    step, args, in_sbp, out_sbp = gpt_case(pl, "megatron", 32, 2, opt, seed=234)
    psbp = _two_d(in_sbp[0])
    in_sbp = (psbp, state_sbp(args[1], psbp, (B,) * 3)) + in_sbp[2:]
    out_sbp = (psbp, in_sbp[1], out_sbp[2])
    ours, gspmd, e, _ = compare(step, args, in_sbp, out_sbp, pl)
    assert ours <= gspmd, (ours, gspmd, e.choice.describe())


@pytest.mark.parametrize(
    "n, steps", [(32, ["all_reduce"]), (256, ["local_slice", "reduce_scatter", "all_gather"])]
)
def test_a_boxing_that_borrows_an_axis_whole_in_both_layouts_is_priced_with_its_launches(n, steps):
    """(B, P) -> (B, B) on 2x4 moves the fewest bytes as a slice over x, a
    reduce-scatter over y and an all-gather over all 8 devices: x, whole in
    both layouts, is borrowed. For a small tensor the one all-reduce over y
    costs less by the layout choice's price (bytes plus 100 kB a launch), and
    that plan is offered: Muon's Gram matrices (32x32) were otherwise zero-
    filled into partials over x to be reduced in one all-reduce over all 8
    devices (390,272 B on a Megatron MLP step against GSPMD's 339,072). A
    large one keeps the fewest-bytes plan."""
    from sbpjax.compiler.program import Program, Var
    from sbpjax.compiler.propagator import Propagator

    pl = sj.placement((2, 4), ("x", "y"))
    v = Var((n, n), np.dtype(np.float32))
    plan = Propagator(Program([v], [], [v], None, [], []), pl, sj.CostModel()).plan(v, (B, P), (B, B))
    assert [st.op for st in plan.steps] == steps


def test_idle_axes_are_those_no_argument_is_split_or_partial_over():
    from sbpjax.compiler.propagation import idle_axes

    assert idle_axes([(S0, B), (B, B)], (4, 2)) == {1}  # data parallel on 4x2
    assert idle_axes([(S0, B), (B, S1)], (4, 2)) == set()  # Megatron
    assert idle_axes([(S0, B), (B, P)], (4, 2)) == set()  # a partial argument uses y
    assert idle_axes([(S0, B)], (8, 1)) == set()  # an axis of one device is no axis
    assert idle_axes([(S0, B), sj.AUTO], (4, 2)) == set()  # AUTO may split over any


def test_a_zero_fill_of_a_split_pays_for_the_block_it_grows(pl24):
    """S -> P moves nothing but makes every device's block full size; B -> P
    does not grow a block and stays free (CompileOptions.zero_fill_weight)."""
    from sbpjax.boxing.plan import plan_boxing

    _cost = pricing.boxing_cost
    ZERO_FILL_WEIGHT = sj.CompileOptions().zero_fill_weight

    cm = sj.CostModel()
    shape, f32 = (64, 32), np.dtype(np.float32)
    grown = plan_boxing(shape, f32, pl24, (sj.S(0), sj.S(1)), (sj.S(0), sj.P))
    assert grown.bytes == 0
    block, full = 32 * 8 * 4, 32 * 32 * 4  # a (32, 8) block becomes (32, 32) on each of 8 devices
    assert _cost(grown, cm) == round(64 * ZERO_FILL_WEIGHT * 8 * (full - block)) > 0
    assert _cost(plan_boxing(shape, f32, pl24, (sj.S(0), sj.B), (sj.S(0), sj.P)), cm) == 0


def test_each_collective_pays_its_latency_in_bytes(pl24):
    """The objective prices a boxing at its bytes plus alpha / beta of each
    collective's group (CompileOptions.latency): per axis from the cost model, once
    per collective, once per round of a permute."""
    from sbpjax.boxing.plan import plan_boxing

    _cost = pricing.boxing_cost

    shape, f32 = (64, 32), np.dtype(np.float32)
    cm = sj.CostModel(alpha={"x": 2e-5, "y": 1e-6}, beta={"x": 1e-10, "y": 1e-11})
    over_y = plan_boxing(shape, f32, pl24, (sj.S(0), sj.P), (sj.S(0), sj.B), cost_model=cm)
    assert [st.op for st in over_y.steps] == ["all_reduce"]
    assert _cost(over_y, cm) == 64 * over_y.bytes + round(64 * 1e-6 / 1e-11)  # 100 kB on y
    over_x = plan_boxing(shape, f32, pl24, (sj.P, sj.S(1)), (sj.B, sj.S(1)), cost_model=cm)
    assert _cost(over_x, cm) == 64 * over_x.bytes + round(64 * 2e-5 / 1e-10)  # 200 kB on x
    # both axes: one reduction per axis, or one over the group (priced as its
    # slowest links: the largest alpha and beta, CostModel.group)
    ratio = lambda axes: cm.group(axes)[0] / cm.group(axes)[1]  # noqa: E731
    both = plan_boxing(shape, f32, pl24, (sj.P, sj.P), (sj.B, sj.B), cost_model=cm)
    latency = sum(ratio(st.axes) for st in both.steps if st.bytes)
    assert _cost(both, cm) == 64 * both.bytes + round(64 * latency)
    # moving a y-split to x is one permute of three rounds: three collective-permutes
    moved = plan_boxing(shape, f32, pl24, (sj.B, sj.S(0)), (sj.S(0), sj.B), cost_model=cm)
    assert [(st.op, st.rounds) for st in moved.steps] == [("permute", 3)]
    assert _cost(moved, cm) == 64 * moved.bytes + round(64 * 3 * ratio(moved.steps[0].axes))
    assert _cost(plan_boxing(shape, f32, pl24, (sj.S(0), sj.B), (sj.S(0), sj.S(1)), cost_model=cm), cm) == 0


def test_ring_latency_is_the_cost_models_time_in_summed_bytes(pl24):
    """With ring=True a collective pays the cost model's alpha terms
    (CostModel.collective_time of zero bytes: the ring's hops; a permute one
    alpha per round) times the placement's devices over beta, plus its
    launches, the bytes the devices' links would carry in that time: 11.2 MB
    + 100 kB for an all-reduce over 8 devices on the default model."""
    from sbpjax.boxing.plan import plan_boxing, ring_latency_bytes

    _cost = pricing.boxing_cost

    cm = sj.CostModel()
    alpha, beta = cm.group(["x"])
    pl8 = sj.placement((8,), ("x",))
    assert ring_latency_bytes(cm, pl8, "all_reduce", ("x",)) == pytest.approx((8 * 2 * 7 + 1) * alpha / beta)
    assert ring_latency_bytes(cm, pl8, "all_gather", ("x",)) == pytest.approx((8 * 7 + 1) * alpha / beta)
    assert ring_latency_bytes(cm, pl8, "permute", ("x",), rounds=3) == pytest.approx(
        (8 * 3 + 3) * alpha / beta
    )
    shape, f32 = (64, 32), np.dtype(np.float32)
    reduce = plan_boxing(shape, f32, pl8, (sj.P,), (sj.B,), cost_model=cm)
    ring = 64 * reduce.bytes + round(64 * (8 * 2 * 7 + 1) * alpha / beta)
    assert _cost(reduce, cm, ring=True) == ring
    # over y of 2x4 the ring has 4 devices' hops, and both groups of 4 run them at
    # once: 8 devices' links idle for that time, as the plan's bytes count all 8
    over_y = plan_boxing(shape, f32, pl24, (sj.S(0), sj.P), (sj.S(0), sj.B), cost_model=cm)
    assert _cost(over_y, cm, ring=True) == 64 * over_y.bytes + round(64 * (8 * 2 * 3 + 1) * alpha / beta)


def test_independent_all_reduces_are_counted_as_one_launch():
    """emitted_collectives counts all-reduces as XLA combines them: those
    that do not depend on one another are one launch, a chain of two
    dependent reductions two (buckets.all_reduce_rounds); the count and
    emitted_price(ring=True) follow, and the compiled program agrees."""
    _count, emitted_price = pricing.count_collectives, pricing.emitted_price

    pl8 = sj.placement((8,), ("x",))
    x = np.ones((64, 16), np.float32)

    def two_sums(a, b):  # the two contractions' partial results are independent
        return a.T @ a, b.T @ b

    def chained(a, b):  # the second reduction consumes the first's result
        return (a.T @ a) @ (b.T @ b)

    cm = sj.CostModel()
    alpha, beta = cm.group(["x"])
    for fn, out_sbp, launches in ((two_sums, ((B,), (B,)), 1), (chained, (B,), 2)):
        f = sj.jit(fn, placement=pl8, in_sbp=((S0,), (S0,)), out_sbp=out_sbp)
        prop = f.explain(x, x).propagation
        assert _count(prop) == launches, fn.__name__
        latency = launches * (8 * 2 * 7 + 1) * alpha / beta
        assert emitted_price(prop, ring=True) == pytest.approx(total_bytes(prop) + latency)
        compiled = f.lower(x, x).compile()
        assert collective_count(compiled) == launches, fn.__name__


@pytest.mark.slow
def test_a_few_percent_of_bytes_are_not_bought_with_collectives():
    """benchmarks/compiler.py's data-parallel transformer step (one block,
    adamw, 8 devices). By bytes first its plan moves the embedding's gradient
    by a gather of the token ids, an all-to-all and an all-gather: 7% fewer
    bytes than one all-reduce of every gradient, in 4 collectives where GSPMD
    runs 1. Solved again with each collective's ring latency
    (CompileOptions.fewer_collectives) it is GSPMD's one all-reduce, which the cost
    model times as faster, for 8% more bytes than the bytes-first plan and no
    more than GSPMD's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import compiler as bench
    finally:
        del sys.path[0]
    step, args, _, _ = bench.block_step(np.random.default_rng(0), quick=False)
    pl = sj.placement((8,), ("x",))
    ps = bench.block_sbp("data", pl, args[0])
    ss = bench.state_sbp(args[1], ps, (B,))
    in_sbp, out_sbp = (ps, ss, (S0,), (S0,)), (ps, ss, (B,))
    ours, g_bytes, e, compiled = compare(step, args, in_sbp, out_sbp, pl, adam_lr=1e-3)
    g, g_args = gspmd_jit(step, args, in_sbp, out_sbp, pl, jax.eval_shape(step, *args))
    g_count = collective_count(g.lower(*g_args).compile())
    assert collective_count(compiled) <= 2 * g_count
    assert ours <= g_bytes
    assert "ring latency, and that plan kept" in e.choice.describe()

    bytes_first = sj.CompileOptions(fewer_collectives=0)  # bytes first throughout
    f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp, options=bytes_first)
    by_bytes = f.explain(*args)
    assert by_bytes.bytes < ours <= (1 + 0.10) * by_bytes.bytes
    assert collective_count(f.lower(*args).compile()) > 2 * g_count
    assert pricing.emitted_price(e.propagation, ring=True) < pricing.emitted_price(
        by_bytes.propagation, ring=True
    )


def test_a_replicated_head_on_megatron_blocks_is_computed_as_gspmd_does(pl24):
    """Megatron MLP blocks (tensor axis y) and a last Dense the caller left B
    (models.py's linen_mlp). Computing that Dense whole over y, as GSPMD does,
    needs no gather: its input is the replicated residual stream. The rule
    that keeps contractions off whole axes once left only splitting the batch
    over y, which made the head's weight gradient a partial over both axes
    and moved more than GSPMD."""
    d, hid, layers = 64, 256, 2
    r = np.random.default_rng(0)
    params = {
        "blocks": [
            {
                "w1": (r.normal(size=(d, hid)) / np.sqrt(d)).astype(np.float32),
                "w2": (r.normal(size=(hid, d)) / np.sqrt(hid)).astype(np.float32),
            }
            for _ in range(layers)
        ],
        "head": (r.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32),
    }
    psbp = {"blocks": [{"w1": (B, S1), "w2": (B, S0)} for _ in range(layers)], "head": (B, B)}

    def loss(p, x, y):
        for blk in p["blocks"]:
            x = x + jax.nn.gelu(layernorm(x, 1.0) @ blk["w1"]) @ blk["w2"]
        return jnp.mean((layernorm(x, 1.0) @ p["head"] - y) ** 2)

    opt = optax.sgd(0.1)
    x, y = (r.normal(size=(32, d)).astype(np.float32) for _ in range(2))
    state = opt.init(params)
    rep = (B, B)
    ssbp = state_sbp(state, psbp, rep)
    step = train_step(loss, opt)
    ours, gspmd, e, compiled = compare(
        step, (params, state, x, y), (psbp, ssbp, (S0, B), (S0, B)), (psbp, ssbp, rep), pl24
    )
    assert ours <= gspmd, (ours, gspmd, e.choice.describe())
    # the head's gradient is reduced over the data axis alone (2 devices)
    head = [b for b in e.propagation.boxings if b.var.shape == (d, d)]
    assert head and all(b.src == (P, B) for b in head), [(b.src, b.dst) for b in head]


@pytest.mark.slow
def test_two_d_gpt_on_4x2_moves_no_more_than_gspmd():
    """A 2-layer GPT at d_model 32 with 2-D weights on 4x2 (batch 20, vocab
    100, sgd with momentum). Its integer program's relaxation bounds nothing
    (99% gaps); a time-limited solve once stopped at 2.24 MB against GSPMD's
    1.70 MB."""
    pl = sj.placement((4, 2), ("x", "y"))
    opt = optax.sgd(0.1, momentum=0.9)
    step, args, in_sbp, out_sbp = gpt_case(pl, "megatron", 32, 2, opt, seed=849, vocab=100, batch=20)
    psbp = _two_d(in_sbp[0])
    ssbp = state_sbp(args[1], psbp, (B, B))
    in_sbp, out_sbp = (psbp, ssbp) + in_sbp[2:], (psbp, ssbp, out_sbp[2])
    ours, gspmd, e, _ = compare(step, args, in_sbp, out_sbp, pl)
    assert ours <= gspmd, (ours, gspmd, e.choice.describe())
