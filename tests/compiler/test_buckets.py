"""Combined collectives (sbpjax.compiler.buckets): a train step reduces its
gradients in one bucket per kind of boxing, not one collective per parameter,
with the planned bytes, and the values of the single-device step."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from models import state_sbp, train_step

import sbpjax as sj
import sbpjax.compiler.buckets as buckets
from sbpjax import B, S

DIMS = (16, 32, 32, 16)  # three dense layers: six parameters


def mlp_params(dims=DIMS, seed=0):
    r = np.random.default_rng(seed)
    p = {}
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        p[f"w{i}"] = (r.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        p[f"b{i}"] = (r.normal(size=(b,)) / 10).astype(np.float32)
    return p


def mlp_loss(p, x, y):
    n = len(p) // 2
    h = x
    for i in range(n):
        h = h @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            h = jax.nn.gelu(h)
    return jnp.mean((h - y) ** 2)


OPTS = {"adamw": lambda: optax.adamw(1e-2, weight_decay=0.1), "sgd": lambda: optax.sgd(0.1, momentum=0.9)}

# Two nodes (x) of four devices (y), the network between nodes much slower than the
# links inside one: reducing a gradient over both axes is then cheaper as a
# reduce-scatter over y, an all-reduce over x of a quarter and an all-gather over y
# than as one all-reduce over (x, y) at the network's speed (the same bytes).
NODES = sj.CostModel(alpha={"x": 1e-5, "y": 1e-9}, beta={"x": 1e-9, "y": 1e-11})

# placement shape, axis names, batch layout, cost model
PLACEMENTS = {
    "8x1": ((8,), ("x",), (S(0),), None),
    "2x4": ((2, 4), ("x", "y"), (S(0), S(0)), None),
    "2x4-nodes": ((2, 4), ("x", "y"), (S(0), S(0)), NODES),
}


def _jit(p, opt, pl, batch_sbp, param_sbp=None, cost_model=None, options=None):
    rep = (B,) * pl.ndim
    psbp = param_sbp or {k: rep for k in p}
    ssbp = state_sbp(opt.init(p), psbp, rep)
    step = train_step(mlp_loss, opt)
    return step, sj.jit(
        step,
        placement=pl,
        in_sbp=(psbp, ssbp, batch_sbp, batch_sbp),
        out_sbp=(psbp, ssbp, rep),
        cost_model=cost_model,
        options=options,
    )


def _data(dims=DIMS, seed=1):
    r = np.random.default_rng(seed)
    return r.normal(size=(16, dims[0])).astype(np.float32), r.normal(size=(16, dims[-1])).astype(np.float32)


def _found(f, args):
    found = sj.collectives(f.lower(*args).compile())
    return collections.Counter(c.op for c in found), sum(c.bytes for c in found)


def _check_values(step, f, p, opt, x, y, steps=2):
    ref = jax.jit(step)
    p_ref, s_ref = p, opt.init(p)
    p_sj, s_sj = p, opt.init(p)
    numpy = lambda t: jax.tree.map(  # noqa: E731
        lambda v: v.numpy(), t, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)
    )
    for _ in range(steps):
        p_ref, s_ref, l_ref = ref(p_ref, s_ref, x, y)
        p_sj, s_sj, l_sj = f(p_sj, s_sj, x, y)
        assert_close(l_sj.numpy(), l_ref, rtol=2e-5)
        p_sj, s_sj = numpy(p_sj), numpy(s_sj)
        for k in p:
            assert_close(p_sj[k], p_ref[k], rtol=2e-5, scale=1.0, err_msg=k)
        for got, want in zip(jax.tree.leaves(s_sj), jax.tree.leaves(s_ref)):
            assert_close(got, want, rtol=2e-5, scale=1.0)


@pytest.mark.parametrize("opt_name", sorted(OPTS))
@pytest.mark.parametrize("where", sorted(PLACEMENTS))
def test_data_parallel_step_reduces_the_gradients_in_one_bucket(where, opt_name, monkeypatch):
    shape, names, batch_sbp, cm = PLACEMENTS[where]
    pl = sj.placement(shape, names)
    p, (x, y) = mlp_params(), _data()
    opt = OPTS[opt_name]()
    args = (p, opt.init(p), x, y)

    step, f = _jit(p, opt, pl, batch_sbp, cost_model=cm)
    counts, nbytes = _found(f, args)
    e = f.explain(*args)
    assert nbytes == e.bytes > 0
    if cm is None:
        # every gradient and the loss: P(sum) -> B over every axis, one all-reduce (on
        # 2x4 over (x, y) as one group: the same bytes as a reduce-scatter over y, an
        # all-reduce over x and an all-gather over y, in one collective; Step.tie_time)
        assert counts == {"all-reduce": 1}
    else:
        # gradients (P, P) -> (B, B) across slow nodes: reduce-scatter over y,
        # all-reduce over x, all-gather over y, each once; the loss (a scalar, which
        # no reduce-scatter can split): one all-reduce over (x, y)
        assert counts == {"reduce-scatter": 1, "all-reduce": 2, "all-gather": 1}
    assert buckets.count_collectives(e.propagation) == sum(counts.values())
    _check_values(step, f, p, opt, x, y)

    # the same program lowered one boxing at a time: the same bytes, more collectives
    _, g = _jit(p, opt, pl, batch_sbp, cost_model=cm, options=sj.CompileOptions(bucketing=False))
    alone, alone_bytes = _found(g, args)
    assert alone_bytes == nbytes == g.explain(*args).bytes
    if cm is not None:  # XLA:CPU combines all-reduces by itself, not reduce-scatters or all-gathers
        assert alone["reduce-scatter"] == alone["all-gather"] == len(p)
    assert buckets.count_collectives(g.explain(*args).propagation) > sum(counts.values())


def test_emitted_price_counts_a_bucket_once(monkeypatch):
    """The second solve compares plans by pricing.emitted_price: the bytes plus
    alpha / beta for each collective the compiled program runs. A
    data-parallel sgd step's seven reductions (six gradients and the loss)
    run as one all-reduce: one latency, where pricing.price, boxing by boxing,
    counts seven."""
    import dataclasses

    from sbpjax.compiler.choose import total_bytes
    from sbpjax.compiler.pricing import emitted_price, price

    pl = sj.placement(8, "x")
    p, (x, y) = mlp_params(), _data()
    opt = optax.sgd(0.1)
    args = (p, opt.init(p), x, y)
    _, f = _jit(p, opt, pl, (S(0),))
    prop = f.explain(*args).propagation
    counts, nbytes = _found(f, args)
    assert counts == {"all-reduce": 1}
    assert total_bytes(prop) == nbytes
    latency = sj.CostModel().axis_alpha("x") / sj.CostModel().axis_beta("x")  # 100 kB
    boxings = [b for b in prop.boxings if any(s.collective is not None for s in b.plan.steps)]
    assert len(boxings) == len(p) + 1
    assert emitted_price(prop) == pytest.approx(nbytes + latency * sum(counts.values()))
    assert price(prop) == pytest.approx(nbytes + latency * len(boxings))
    # links without a bandwidth term (beta 0): no latency in either price
    free = sj.CostModel(beta=0.0)
    assert emitted_price(prop, free) == price(prop, free) == pytest.approx(nbytes)
    # lowered without buckets, each boxing runs (and pays) its own collective
    prop.options = dataclasses.replace(prop.options, bucketing=False)
    assert emitted_price(prop) == pytest.approx(price(prop))


def test_bucket_cap_splits_a_bucket_and_keeps_the_bytes(monkeypatch):
    pl = sj.placement((2, 4), ("x", "y"))
    p, (x, y) = mlp_params(), _data()
    opt = optax.sgd(0.1, momentum=0.9)
    args = (p, opt.init(p), x, y)
    # the largest gradient (32x32 f32) fills a bucket by itself; the others share
    capped = sj.CompileOptions(bucket_bytes=32 * 32 * 4)
    step, f = _jit(p, opt, pl, (S(0), S(0)), cost_model=NODES, options=capped)
    counts, nbytes = _found(f, args)
    e = f.explain(*args)
    assert nbytes == e.bytes
    # a range, not a number: the cap splits the gradients into more than one bucket
    # and fewer than one per parameter; how they group depends on their order
    assert 1 < counts["reduce-scatter"] < len(p)
    assert counts["reduce-scatter"] == counts["all-gather"]
    bks, _ = buckets.plan_buckets(e.propagation)
    for bk in bks.values():
        assert sum(int(np.prod(b.plan.shape)) * 4 for b in bk.boxings) <= 32 * 32 * 4
    _check_values(step, f, p, opt, x, y, steps=1)


def test_uneven_gradients_keep_their_values_and_bytes():
    """Widths 30 and 20 do not split 4 ways evenly: those reduce-scatters and
    all-gathers run alone (they need index tables); the even ones and every
    all-reduce still share buckets."""
    dims = (16, 30, 20, 16)
    pl = sj.placement((2, 4), ("x", "y"))
    p, (x, y) = mlp_params(dims), _data(dims)
    opt = optax.adamw(1e-2)
    args = (p, opt.init(p), x, y)
    step, f = _jit(p, opt, pl, (S(0), S(0)), cost_model=NODES)
    counts, nbytes = _found(f, args)
    assert nbytes == f.explain(*args).bytes
    assert counts["reduce-scatter"] < len(p)
    _check_values(step, f, p, opt, x, y)


def test_megatron_2d_step_is_unchanged_in_bytes_and_values():
    """Column/row-split kernels on 2x4 (activations' boxings depend on one
    another, few share a bucket): the same bytes as planned, the same values."""
    pl = sj.placement((2, 4), ("x", "y"))
    p, (x, y) = mlp_params(), _data()
    opt = optax.adamw(1e-2)
    psbp = {k: (B, S(v.ndim - 1)) for k, v in p.items()}
    args = (p, opt.init(p), x, y)
    step, f = _jit(p, opt, pl, (S(0), B), psbp)
    _, nbytes = _found(f, args)
    assert nbytes == f.explain(*args).bytes
    _check_values(step, f, p, opt, x, y)


def _partial_input(r, shape, pl):
    """A (P, P) global tensor of random local tensors and its logical value."""
    locals_ = np.empty(pl.shape, dtype=object)
    for c in np.ndindex(*pl.shape):
        locals_[c] = r.normal(size=shape).astype(np.float32)
    return sj.from_local_tensors(locals_, pl, (sj.P, sj.P), shape), sum(locals_.flat)


def test_gathers_and_scatters_on_every_dim_share_buckets(monkeypatch):
    """Reduce-scatters and all-gathers over non-leading dims go through the
    flat buffer with each tensor's pieces in device order: the outputs equal
    the logical values, with the planned bytes, in fewer collectives."""
    pl = sj.placement((2, 4), ("x", "y"))
    r = np.random.default_rng(0)
    xs, want, in_sbp, out_sbp = [], [], [], []
    for shape, dst in [
        ((8, 12), (B, S(1))),
        ((4, 8, 6), (S(0), S(1))),
        ((8, 12), (B, B)),
        ((16, 4), (B, S(0))),
    ]:
        g, logical = _partial_input(r, shape, pl)
        xs.append(g)
        want.append(logical)
        in_sbp.append((sj.P, sj.P))
        out_sbp.append(dst)
    for shape, src in [
        ((8, 4), (S(1), S(0))),
        ((16,), (S(0), S(0))),
        ((6, 8, 4), (B, S(1))),
        ((6, 8, 4), (B, S(2))),
    ]:
        v = r.normal(size=shape).astype(np.float32)
        xs.append(sj.to_global(v, pl, src))
        want.append(v)
        in_sbp.append(src)
        out_sbp.append((B, B))

    def fn(*args):
        return tuple(a * 2.0 for a in args)

    results = {}
    for on in (False, True):
        options = sj.CompileOptions(bucketing=on)
        f = sj.jit(fn, placement=pl, in_sbp=tuple(in_sbp), out_sbp=tuple(out_sbp), options=options)
        outs = f(*xs)
        for got, w, dst in zip(outs, want, out_sbp):
            assert got.sbp == dst
            assert_close(got.numpy(), 2.0 * w, rtol=1e-5)
        counts, nbytes = _found(f, xs)
        assert nbytes == f.explain(*xs).bytes
        results[on] = (sum(counts.values()), nbytes)
    assert results[True][1] == results[False][1]
    assert results[True][0] < results[False][0]


def test_schedule_lets_a_short_sequence_ride_in_a_long_ones_round():
    rs, ar, ag = ("reduce_scatter", (1,), "sum"), ("all_reduce", (0,), "sum"), ("all_gather", (1,), None)
    assert buckets.schedule([(rs, ar, ag), (rs, ar, ag)]) == [(rs, [0, 1]), (ar, [0, 1]), (ag, [0, 1])]
    assert buckets.schedule([(ar,), (rs, ar, ag)]) == [(rs, [1]), (ar, [0, 1]), (ag, [1])]
    assert buckets.schedule([(ag,), (ar,)]) == [(ag, [0]), (ar, [1])]


def test_buckets_stay_inside_or_outside_checkpoint_regions():
    """A jax.checkpoint region's recomputation reads its inputs through an
    optimization barrier; no boxing moves across it into or out of a bucket."""
    pl = sj.placement((2, 4), ("x", "y"))
    p, (x, y) = mlp_params(), _data()
    opt = optax.sgd(0.1)

    def loss(p, x, y):
        h = jax.checkpoint(lambda h, w, b: jax.nn.gelu(h @ w + b))(x, p["w0"], p["b0"])
        h = jax.checkpoint(lambda h, w, b: jax.nn.gelu(h @ w + b))(h, p["w1"], p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    psbp = {k: (B, S(v.ndim - 1)) for k, v in p.items()}  # tensor-parallel: boxings inside the regions
    rep = (B, B)
    step = train_step(loss, opt)
    ssbp = state_sbp(opt.init(p), psbp, rep)
    f = sj.jit(step, placement=pl, in_sbp=(psbp, ssbp, (S(0), B), (S(0), B)), out_sbp=(psbp, ssbp, rep))
    args = (p, opt.init(p), x, y)
    prop = f.explain(*args).propagation
    region = {id(b): d.node.region for d in prop.decisions for b in d.boxings}
    assert any(region.values())
    for bk in buckets.plan_buckets(prop)[0].values():
        assert len({region.get(id(b), 0) for b in bk.boxings}) == 1
    # (measured bytes are not compared with the plan here: with checkpoint regions
    # XLA moves fewer bytes than planned with or without buckets)
    p1, _, l1 = f(*args)
    p0, _, l0 = jax.jit(step)(*args)
    assert_close(l1.numpy(), l0, rtol=2e-5)
    for k in p:
        assert_close(p1[k].numpy(), p0[k], rtol=2e-5, scale=1.0, err_msg=k)


def test_gather_buckets_hold_at_most_a_share_of_the_peak(monkeypatch):
    """All-gathers whose sources are ready together (a ZeRO-3 step's weights,
    here six split arrays gathered whole) would run as one bucket, its flat
    buffer and the pieces cut from it alive together (on jax 0.12 the model
    zoo's unrolled decoder peaked there, at 9.7 MB against GSPMD's 9.1 MB); a
    bucket of all-gathers holds at most CompileOptions.gather_share of the program's
    estimated peak per device (sbpjax.compiler.liveness), with the same bytes
    and values."""
    from sbpjax.compiler.liveness import live_bytes

    pl = sj.placement(8, "x")
    r = np.random.default_rng(0)
    xs = [r.normal(size=(64, 32)).astype(np.float32) for _ in range(6)]

    def fn(*args):
        return tuple(a * 2.0 for a in args)

    def jit(share):
        options = sj.CompileOptions(gather_share=share)
        return sj.jit(fn, placement=pl, in_sbp=((S(0),),) * 6, out_sbp=((B,),) * 6, options=options)

    def gather_buckets(f):
        bks, _ = buckets.plan_buckets(f.explain(*xs).propagation)
        return [bk for bk in bks.values() if all(kind[0] == "all_gather" for kind, _ in bk.rounds)]

    whole = jit(1e9)  # no cap but bucket_bytes
    assert [len(bk.boxings) for bk in gather_buckets(whole)] == [6]
    f = jit(1 / 16)
    e = f.explain(*xs)
    cap = int(live_bytes(e.propagation).max() / 16)
    capped = gather_buckets(f)
    assert len(capped) > 1
    for bk in capped:
        assert sum(buckets._local_bytes(b, pl.shape) for b in bk.boxings) <= cap
    assert e.bytes == whole.explain(*xs).bytes
    counts, nbytes = _found(f, xs)
    assert nbytes == e.bytes
    assert counts["all-gather"] == len(capped) + sum(1 for b in e.boxings) - sum(
        len(bk.boxings) for bk in capped
    )
    for got, x in zip(f(*xs), xs):
        assert_close(got.numpy(), 2.0 * x, rtol=1e-6)


def test_a_program_of_no_ops_gathers_its_results():
    """Only output boxings (the results gathered whole): the peak estimate
    that caps gather buckets counts the results, and the values are the
    arguments."""
    pl = sj.placement(8, "x")
    xs = [np.arange(64, dtype=np.float32).reshape(16, 4) + k for k in range(2)]
    f = sj.jit(lambda a, b: (a, b), placement=pl, in_sbp=((S(0),), (S(0),)), out_sbp=((B,), (B,)))
    for got, x in zip(f(*xs), xs):
        assert got.sbp == (B,)
        np.testing.assert_array_equal(got.numpy(), x)
    assert _found(f, xs)[1] == f.explain(*xs).bytes
