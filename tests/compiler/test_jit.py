"""sj.jit on whole programs: signatures, boxings, values and measured bytes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from models import (
    BATCH,
    VOCAB,
    D,
    T,
    block_loss,
    block_params,
    check_train,
    compiled_bytes,
    mlp_loss,
    mlp_params,
)

import sbpjax as sj

S0, S1, B, P = sj.S(0), sj.S(1), sj.B, sj.P


def measured(f, *args):
    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def rng(seed=0):
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    "xs, ws, ys", [(S0, B, S0), (B, S1, S1), (S1, S0, P), (P, B, P), (B, P, P), (B, B, B)], ids=str
)
def test_oneflow_table_1(xs, ws, ys, pl8):
    X, W = rng().normal(size=(16, 8)).astype(np.float32), rng(1).normal(size=(8, 24)).astype(np.float32)
    f = sj.jit(lambda x, w: x @ w, placement=pl8)
    x, w = sj.to_global(X, pl8, xs), sj.to_global(W, pl8, ws)
    y = f(x, w)
    assert y.sbp == (ys,)
    np.testing.assert_allclose(y.numpy(), X @ W, rtol=1e-5, atol=1e-5)
    assert f.explain(x, w).bytes == 0 == measured(f, x, w)


@pytest.mark.parametrize("xs, ws, ys", [((S0, B), (B, S1), (S0, S1)), ((S0, S1), (B, S0), (S0, P))], ids=str)
def test_oneflow_table_3(xs, ws, ys, pl24):
    X, W = rng().normal(size=(16, 8)).astype(np.float32), rng(1).normal(size=(8, 24)).astype(np.float32)
    f = sj.jit(lambda x, w: x @ w, placement=pl24)
    x, w = sj.to_global(X, pl24, xs), sj.to_global(W, pl24, ws)
    y = f(x, w)
    assert y.sbp == ys
    np.testing.assert_allclose(y.numpy(), X @ W, rtol=1e-5, atol=1e-5)
    assert measured(f, x, w) == 0


def test_autoddl_3d_matmul():
    pl = sj.placement((2, 2, 2), ("a", "b", "c"))
    X, W = rng().normal(size=(8, 8)).astype(np.float32), rng(1).normal(size=(8, 8)).astype(np.float32)
    f = sj.jit(lambda x, w: x @ w, placement=pl)
    x, w = sj.to_global(X, pl, (S0, B, S1)), sj.to_global(W, pl, (B, S1, S0))
    y = f(x, w)
    assert y.sbp == (S0, S1, P)
    np.testing.assert_allclose(y.numpy(), X @ W, rtol=1e-5, atol=1e-5)


def test_uvw_keeps_the_partial_between_products(pl8):
    U, V, W = (rng(i).normal(size=s).astype(np.float32) for i, s in enumerate([(16, 32), (32, 8), (8, 8)]))
    f = sj.jit(lambda u, v, w: u @ v @ w, placement=pl8, out_sbp=B)
    args = (sj.to_global(U, pl8, S1), sj.to_global(V, pl8, S0), sj.to_global(W, pl8, B))
    np.testing.assert_allclose(f(*args).numpy(), U @ V @ W, rtol=1e-4, atol=1e-4)
    e = f.explain(*args)
    assert [d[3] for d in e.ops] == [[(P,)], [(P,)]]  # both products partial
    assert all(b.where == "output 0" for b in e.boxings)  # no boxing until the output
    found = sj.collectives(f.lower(*args).compile())
    assert [c.op for c in found] == ["all-reduce"] and found[0].bytes == e.bytes == 7 * 16 * 8 * 4 * 2


def _ce(z, y):
    m = jax.lax.stop_gradient(z.max(-1, keepdims=True))
    zz = z - m
    lse = jnp.log(jnp.exp(zz).sum(-1))
    return (lse - jnp.take_along_axis(zz, y[:, None], axis=1)[:, 0]).mean()


def test_model_parallel_softmax_cross_entropy_never_gathers_logits(pl8):
    N, C = 16, 64
    Z = rng().normal(size=(N, C)).astype(np.float32)
    Y = rng(1).integers(0, C, size=(N,)).astype(np.int32)
    f = sj.jit(_ce, placement=pl8, out_sbp=B)
    args = (sj.to_global(Z, pl8, S1), sj.to_global(Y, pl8, B))
    assert_close(f(*args).numpy(), _ce(Z, Y), rtol=1e-6)
    found = sj.collectives(f.lower(*args).compile())
    assert sum(c.bytes for c in found) == f.explain(*args).bytes
    # only batch-sized partial max / sum reductions cross devices
    assert max(c.bytes_per_device for c in found) <= 2 * N * 4
    assert {c.op for c in found} <= {"all-reduce", "reduce-scatter"}


def test_model_parallel_cross_entropy_gradient(pl8):
    N, C = 16, 64
    Z = rng().normal(size=(N, C)).astype(np.float32)
    Y = rng(1).integers(0, C, size=(N,)).astype(np.int32)
    f = sj.jit(jax.grad(_ce), placement=pl8)
    args = (sj.to_global(Z, pl8, S1), sj.to_global(Y, pl8, B))
    g = f(*args)
    np.testing.assert_allclose(g.numpy(), jax.grad(_ce)(Z, Y), rtol=1e-5, atol=1e-7)
    assert measured(f, *args) == f.explain(*args).bytes


@pytest.mark.jax_versions
def test_optax_integer_label_cross_entropy_with_class_split_logits(pl8):
    """optax's own loss, value and gradient, logits S(1) over classes: no
    collective carries logits-sized data (the per-row factor of the gradient is
    gathered, N values, before it is broadcast over the class shard)."""
    import optax

    N, C = 64, 1024
    Z = rng().normal(size=(N, C)).astype(np.float32)
    Y = rng(1).integers(0, C, size=(N,)).astype(np.int32)

    def loss(z, y):
        return optax.softmax_cross_entropy_with_integer_labels(z, y).mean()

    f = sj.jit(jax.value_and_grad(loss), placement=pl8, in_sbp=((S1,), (B,)), out_sbp=((B,), (S1,)))
    value, grad = f(Z, Y)
    want_value, want_grad = jax.value_and_grad(loss)(Z, Y)
    assert_close(value.numpy(), want_value, rtol=1e-6)
    np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-5, atol=1e-8)
    assert grad.sbp == (S1,)
    gargs = (sj.to_global(Z, pl8, S1), sj.to_global(Y, pl8, B))
    found = sj.collectives(f.lower(*gargs).compile())
    # the whole-program choice gathers the per-row factor once: planned = run
    assert sum(c.bytes for c in found) == f.explain(*gargs).bytes
    logits_shard = N * C * 4 // 8
    assert max(c.bytes_per_device for c in found) <= 4 * N * 4 < logits_shard // 16
    # The greedy pass plans one all-gather of a row vector twice: the label
    # term's gradient (a scatter into zeros at index 0) simplifies to a reshape
    # of a row vector the plan also gathers. jaxlib 0.10's XLA merges the two
    # gathers (it runs N * 4 * 7 B less than planned); 0.12's runs both.
    g = sj.jit(
        jax.value_and_grad(loss), placement=pl8, in_sbp=((S1,), (B,)), out_sbp=((B,), (S1,)), solver="greedy"
    )
    greedy_found = sj.collectives(g.lower(*gargs).compile())
    assert g.explain(*gargs).bytes - sum(c.bytes for c in greedy_found) in (0, N * 4 * 7)
    assert f.explain(*gargs).bytes == g.explain(*gargs).bytes - N * 4 * 7


@pytest.mark.parametrize("solver", ["ilp", "greedy"])
def test_a_reshape_that_cannot_keep_the_split_gathers_rather_than_reduces_a_partial(pl8, solver):
    """(16, 24) split by rows on 8 devices reshaped to (4, 4, 6, 4): no split
    of the result holds the same rows. Zero-filling a partial is free, but its
    all-reduce later costs 2(p-1)|T|; the gather before costs (p-1)|T|."""
    X = rng().normal(size=(16, 24)).astype(np.float32)
    f = sj.jit(lambda a: jnp.sin(a.reshape(4, 4, 6, 4)), placement=pl8, in_sbp=S0, solver=solver)
    assert_close(f(X).numpy(), np.sin(X.reshape(4, 4, 6, 4)), rtol=1e-6)
    gather = sj.plan_boxing((16, 24), np.float32, pl8, (S0,), (sj.B,)).bytes
    assert f.explain(X).bytes == compiled_bytes(f, X) == gather == 7 * 16 * 24 * 4


def test_data_parallel_sgd_momentum_reduces_each_gradient_once(pl8):
    """The momentum trace and the update both come from the gradient: reducing
    the gradient once serves both (keeping the partial would reduce twice)."""
    import optax

    W = rng().normal(size=(64, 64)).astype(np.float32)
    X = rng(1).normal(size=(64, 64)).astype(np.float32)
    opt = optax.sgd(0.1, momentum=0.9)

    def step(w, s, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        u, s = opt.update(g, s, w)
        return optax.apply_updates(w, u), s

    f = sj.jit(step, placement=pl8, in_sbp=((B,), (B,), (S0,)), out_sbp=((B,), (B,)))
    state = opt.init(W)
    (w, s), (want_w, want_s) = f(W, state, X), step(W, state, X)
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-6)
    trace = jax.tree.leaves(s, is_leaf=lambda v: isinstance(v, sj.GlobalTensor))[0]
    np.testing.assert_allclose(trace.numpy(), jax.tree.leaves(want_s)[0], rtol=1e-5, atol=1e-6)
    found = sj.collectives(f.lower(W, state, X).compile())
    assert [(c.op, c.bytes) for c in found] == [("all-reduce", 2 * 7 * W.nbytes)]


def test_embedding_split_by_vocabulary_gives_partial_sum(pl8):
    table = rng().normal(size=(64, 8)).astype(np.float32)
    ids = rng(1).integers(0, 64, size=(12,)).astype(np.int32)
    f = sj.jit(lambda t, i: t[i], placement=pl8)
    args = (sj.to_global(table, pl8, S0), sj.to_global(ids, pl8, B))
    out = f(*args)
    assert out.sbp == (P,)
    np.testing.assert_array_equal(out.numpy(), table[ids])
    assert measured(f, *args) == f.explain(*args).bytes == 0
    # split by hidden dim instead: the lookup is local, the output split the same way
    out2 = f(sj.to_global(table, pl8, S1), sj.to_global(ids, pl8, B))
    assert out2.sbp == (S1,)
    np.testing.assert_array_equal(out2.numpy(), table[ids])


def test_embedding_gradient_scatter_add(pl8):
    table = rng().normal(size=(64, 8)).astype(np.float32)
    ids = rng(1).integers(0, 64, size=(16,)).astype(np.int32)
    loss = lambda t, i: jnp.sum(jnp.sin(t[i]))  # noqa: E731
    want = jax.grad(loss)(table, ids)
    for tsbp, isbp in [(S0, B), (B, S0), (S1, B)]:
        f = sj.jit(jax.grad(loss), placement=pl8)
        args = (sj.to_global(table, pl8, tsbp), sj.to_global(ids, pl8, isbp))
        np.testing.assert_allclose(f(*args).numpy(), want, rtol=1e-6, atol=1e-6)
        assert measured(f, *args) == f.explain(*args).bytes


# ---------------------------------------------------------------------------
# Oracle tests per primitive family: every input layout, against JAX on one device
# ---------------------------------------------------------------------------

FAMILIES = {
    "elementwise": (
        lambda a, b: jnp.tanh(a) * b - jnp.exp(-a) / (1 + b**2) + jnp.maximum(a, b),
        [(8, 16), (8, 16)],
    ),
    "select_compare": (lambda a, b: jnp.where(a > b, a, -b).astype(jnp.float32), [(8, 16), (8, 16)]),
    "reductions": (lambda a: a.sum(0) + a.max(1).sum() - a.min(), [(8, 16)]),
    "argmax_cumsum": (
        lambda a: jnp.argmax(a, axis=1).astype(jnp.float32).sum() + jnp.cumsum(a, 1)[:, -1].sum(),
        [(8, 16)],
    ),
    "reshape_transpose": (lambda a: (a.reshape(4, 2, 16).transpose(2, 0, 1).reshape(16, 8) * 2).T, [(8, 16)]),
    "broadcast_concat_pad": (
        lambda a, b: jnp.concatenate([a, b], 1)[:, :24] + jnp.pad(a, ((0, 0), (0, 16)))[:, 8:],
        [(8, 16), (8, 16)],
    ),
    "dot_batch": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), [(8, 8, 8), (8, 8, 16)]),
    "iota_slice": (
        lambda a: a + jnp.arange(16)[None, :] + jax.lax.dynamic_slice(a, (0, 0), (8, 16)),
        [(8, 16)],
    ),
    "softmax": (lambda a: jax.nn.softmax(a, axis=-1) @ jnp.ones((16, 4)), [(8, 16)]),
    # same width (shape kept) and f32 -> 4 x u8 (a trailing dim added), back to numbers
    "bitcast": (
        lambda a: (
            jax.lax.bitcast_convert_type(a + 1, jnp.int32).astype(jnp.float32) / 2**23
            + jax.lax.bitcast_convert_type(a, jnp.uint8).astype(jnp.float32).sum(-1)
        ),
        [(8, 16)],
    ),
}
LAYOUTS = [S0, S1, B, P]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_primitive_families_against_one_device(name, pl8):
    fn, shapes = FAMILIES[name]
    r = rng()
    arrays = [r.integers(-3, 4, size=s).astype(np.float32) for s in shapes]
    want = np.asarray(fn(*arrays))
    f = sj.jit(fn, placement=pl8)
    for sbps in itertools.product(LAYOUTS, repeat=len(shapes)):
        args = [sj.to_global(a, pl8, s) for a, s in zip(arrays, sbps)]
        got = f(*args)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=str(sbps))
        assert measured(f, *args) == f.explain(*args).bytes, sbps


# ---------------------------------------------------------------------------
# Training steps: loss and parameters equal the single-device program
# ---------------------------------------------------------------------------


def _check_train(loss_fn, params, x, y, pl, param_sbp, x_sbp, y_sbp):
    return check_train(loss_fn, params, x, y, pl, param_sbp, x_sbp, y_sbp)[1]


def _mlp_data():
    r = rng(3)
    return r.normal(size=(16, D)).astype(np.float32), r.normal(size=(16, D)).astype(np.float32)


def test_mlp_data_parallel(pl8):
    x, y = _mlp_data()
    e = _check_train(mlp_loss, mlp_params(), x, y, pl8, {"w1": (B,), "w2": (B,)}, (S0,), (S0,))
    ops = {s.op for b in e.boxings for s in b.plan.steps}
    assert "all_reduce" in ops  # gradients of B parameters are all-reduced


def test_mlp_zero_style_reduce_scatter(pl8):
    x, y = _mlp_data()
    e = _check_train(mlp_loss, mlp_params(), x, y, pl8, {"w1": (S0,), "w2": (S0,)}, (S0,), (S0,))
    assert any(s.op == "reduce_scatter" for b in e.boxings for s in b.plan.steps)


def test_mlp_megatron_tensor_parallel(pl8):
    x, y = _mlp_data()
    _check_train(mlp_loss, mlp_params(), x, y, pl8, {"w1": (S1,), "w2": (S0,)}, (B,), (B,))


def test_mlp_2d_hybrid(pl24):
    x, y = _mlp_data()
    _check_train(mlp_loss, mlp_params(), x, y, pl24, {"w1": (B, S1), "w2": (B, S0)}, (S0, B), (S0, B))


def _block_data():
    r = rng(4)
    return (
        r.integers(0, VOCAB, size=(BATCH, T)).astype(np.int32),
        r.integers(0, VOCAB, size=(BATCH, T)).astype(np.int32),
    )


def _block_sbp(kind, n_axes):
    rep = (B,) * n_axes
    col = rep[:-1] + (S1,)
    row = rep[:-1] + (S0,)
    if kind == "data":
        return {k: rep for k in block_params()}
    return {
        "wq": col,
        "wk": col,
        "wv": col,
        "wo": row,
        "w1": col,
        "w2": row,
        "g": rep,
        "emb": rep,
        "head": col,
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["data", "tensor", "2d"])
def test_transformer_block_train_step(kind, pl8, pl24):
    tokens, labels = _block_data()
    if kind == "data":
        _check_train(block_loss, block_params(), tokens, labels, pl8, _block_sbp("data", 1), (S0,), (S0,))
    elif kind == "tensor":
        _check_train(block_loss, block_params(), tokens, labels, pl8, _block_sbp("tensor", 1), (B,), (B,))
    else:
        _check_train(
            block_loss, block_params(), tokens, labels, pl24, _block_sbp("tensor", 2), (S0, B), (S0, B)
        )


# ---------------------------------------------------------------------------
# Constraints, out_sbp, errors
# ---------------------------------------------------------------------------


def test_constrain_forces_a_layout(pl8):
    X = rng().normal(size=(16, 8)).astype(np.float32)
    f = sj.jit(lambda x: sj.constrain(jnp.sin(x), sj.S(1)) * 2, placement=pl8)
    x = sj.to_global(X, pl8, S0)
    y = f(x)
    assert y.sbp == (S1,)
    assert_close(y.numpy(), np.sin(X) * 2, rtol=1e-6)
    assert [s.op for b in f.explain(x).boxings for s in b.plan.steps] == ["all_to_all"]
    assert np.allclose(sj.constrain(jnp.ones(3), sj.B), 1)  # outside sj.jit: identity


def test_constrain_lays_out_every_leaf_of_a_pytree(pl24):
    """``sj.constrain`` of a tuple, dict or list, as ``with_sharding_constraint``
    takes one: one nd-SBP for every leaf, or a pytree of them (None leaves a
    leaf free). It returned the pytree unchanged, the layout dropped without
    a word."""
    X = rng().normal(size=(16, 12)).astype(np.float32)
    one = (S1, S0)

    def pairs(a):
        t = sj.constrain((a * 2, {"h": a * 3}), one)
        d = sj.constrain({"u": a + 1, "v": [a - 1]}, {"u": one, "v": None})
        g = sj.constrain([a * 4, a * 5], [(B, S1), one], grad_sbp=(B, B))
        return t, d, g

    f = sj.jit(pairs, placement=pl24, in_sbp=(S0, B))
    (t0, t1), d, (g0, g1) = f(X)
    assert t0.sbp == t1["h"].sbp == d["u"].sbp == g1.sbp == one and g0.sbp == (B, S1)
    assert d["v"][0].sbp != one  # left free
    for got, want in (
        (t0, X * 2),
        (t1["h"], X * 3),
        (d["u"], X + 1),
        (d["v"][0], X - 1),
        (g0, X * 4),
        (g1, X * 5),
    ):
        assert_close(got.numpy(), want, rtol=1e-6)
    assert sum(b.node.name == "sbp_constrain" for b in f.explain(X).propagation.decisions) == 5
    with pytest.raises(sj.SBPError, match="sj.constrain's sbp does not match the structure"):
        sj.jit(lambda a: sj.constrain((a, a), [one, one, one]), placement=pl24)(X)
    assert sj.constrain((1.0, {"a": 2.0}), one) == (1.0, {"a": 2.0})  # outside sj.jit: identity


def test_explain_keeps_the_line_number_of_a_source_in_a_deep_directory(pl8, tmp_path):
    import importlib.util

    deep = tmp_path / ("a_project_directory_" * 3) / "with" / "a" / "realistic" / "depth"
    deep.mkdir(parents=True)
    (deep / "model_code.py").write_text("import jax.numpy as jnp\n\n\ndef f(x):\n    return jnp.sin(x) * 2\n")
    spec = importlib.util.spec_from_file_location("model_code", deep / "model_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = str(sj.jit(module.f, placement=pl8, in_sbp=S0).explain(np.ones((8, 4), np.float32)))
    assert "model_code.py:5:" in text, text


def test_explain_points_a_written_out_scans_slices_and_stacks_at_the_users_scan(pl8):
    """The slices and stacks sbpjax writes for a scan's iterations come from its
    own small programs; explain() shows the user's lax.scan line for them."""
    X = rng().normal(size=(6, 4, 8)).astype(np.float32)

    def f(xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h + x), h.sum()), jnp.zeros((4, 8)), xs)[1]

    text = str(sj.jit(f, placement=pl8, in_sbp=S1).explain(X))
    assert "small_jaxprs.py" not in text and "trace.py" not in text
    assert "test_jit.py" in text.split("slice", 1)[1].split("\n", 1)[0]  # a slice's row: the test's line


def test_python_scalars_keep_their_weak_type_as_under_jax_jit(pl8):
    """A bf16 array times 2.0 stays bf16 (the scalar is weakly typed); a NumPy
    scalar is not weak, as under jax.jit."""
    x = jnp.ones((16, 8), jnp.bfloat16)
    xi = jnp.ones((16,), jnp.int8)
    scale = sj.jit(lambda x, s: x * s, placement=pl8, in_sbp=(S0, sj.B))
    for a, s in (
        (x, 2.0),
        (xi, 3),
        (x, jnp.asarray(2.0)),
        (x, np.float32(2.0)),
        (x, np.float64(2.0)),
        (xi, 3.5),
    ):
        want = jax.jit(lambda x, s: x * s)(a, s)
        got = scale(a, s)
        assert got.dtype == want.dtype, (a.dtype, type(s))
        np.testing.assert_array_equal(got.numpy(), np.asarray(want))


def test_jax_transformations_of_an_sj_jit_function(pl8):
    """jax.grad through .to_jax() of its results works (the documented route);
    jax.vmap of it and an argument that is no array are SBPErrors saying what to
    write instead, and the function still works after them."""
    X = rng().normal(size=(16, 8)).astype(np.float32)
    Wt = rng().normal(size=(8, 4)).astype(np.float32)
    loss = sj.jit(lambda x, w: jnp.tanh(x @ w).sum(), placement=pl8, in_sbp=(S0, sj.B), out_sbp=sj.B)
    g = jax.grad(lambda w: loss(X, w).to_jax())(Wt)
    want = jax.grad(lambda w: jnp.tanh(X @ w).sum())(Wt)
    assert_close(np.asarray(g), want, rtol=1e-5)
    double = sj.jit(lambda a: a * 2, placement=pl8, in_sbp=S0)
    with pytest.raises(sj.SBPError, match=r"under jax.vmap.*sj.jit\(jax.vmap\(f\)"):
        jax.vmap(double)(np.stack([X, X]))
    mode = sj.jit(lambda x, mode: x * 2 if mode == "train" else x, placement=pl8)
    with pytest.raises(sj.SBPError, match=r"kwargs\['mode'\] is 'eval' \(str\).*functools.partial"):
        mode(X, mode="eval")
    np.testing.assert_array_equal(double(X).numpy(), X * 2)


def test_an_sj_jit_function_called_inside_another_is_inlined(pl8, pl24):
    """The outer sj.jit plans the whole program: the inner body is inlined, its
    in_sbp / out_sbp kept as sj.constrain points (read in the plan), under
    jax.grad too; an inner function on another placement is an SBPError."""
    X = rng().normal(size=(16, 8)).astype(np.float32)
    inner = sj.jit(lambda a: jnp.sin(a) * 2, placement=pl8, in_sbp=S0, out_sbp=S1)
    outer = sj.jit(lambda a: jnp.sum(inner(a) ** 2), placement=pl8, in_sbp=S1)
    assert_close(outer(X).numpy(), np.sum((np.sin(X) * 2) ** 2), rtol=1e-5)
    text = str(outer.explain(X))
    assert "S(1)->S(0)" in text and "S(0)->S(1)" in text  # both constrain points boxed
    grad = sj.jit(jax.grad(lambda a: jnp.sum(inner(a) ** 2)), placement=pl8, in_sbp=S1)
    assert_close(grad(X).numpy(), 8 * np.sin(X) * np.cos(X), rtol=1e-5)
    elsewhere = sj.jit(lambda a: inner(a), placement=pl24)
    with pytest.raises(sj.SBPError, match="one program runs on one placement"):
        elsewhere(X)
    assert_close(outer(X).numpy(), np.sum((np.sin(X) * 2) ** 2), rtol=1e-5)  # nothing left half-done


@pytest.mark.parametrize("zeros", [jnp.zeros, lambda s: jnp.zeros(s[::-1]).T], ids=["zeros", "transposed"])
def test_a_zero_tensor_is_made_afresh_not_moved(zeros, pl8):
    """A tensor known to be zeros is made in the layout its consumer wants: the
    plan moves no byte, as XLA (which folds collectives of zeros) does not."""
    X = rng().normal(size=(16, 8)).astype(np.float32)

    def f(x):
        z = sj.constrain(zeros((16, 8)), S0)
        return x + sj.constrain(z, S1)

    f = sj.jit(f, placement=pl8)
    x = sj.to_global(X, pl8, S1)
    assert_close(f(x).numpy(), X, rtol=0)
    e = f.explain(x)
    # B -> S(0) slices (free either way); S(0) -> S(1) would be an all-to-all
    assert [s.op for b in e.boxings for s in b.plan.steps] == ["local_slice", "zeros"]
    assert e.bytes == 0 == measured(f, x)


def test_constrain_grad_sbp_pins_the_cotangent(pl8):
    """``grad_sbp`` forces the cotangent where the backward pass crosses the
    constraint; without it the cotangent follows the value's layout."""
    X = rng().normal(size=(16, 8)).astype(np.float32)
    W = rng(1).normal(size=(8, 32)).astype(np.float32)

    def loss(w, x, grad_sbp):
        h = sj.constrain(x @ w, S0, grad_sbp=grad_sbp)
        return jnp.sum(jnp.tanh(h) ** 2)

    want = jax.grad(loss)(W, X, None)
    cotangent_layouts = {}
    for grad_sbp in (None, S1):
        f = sj.jit(
            jax.grad(lambda w, x, g=grad_sbp: loss(w, x, g)),
            placement=pl8,
            in_sbp=((B,), (S0,)),
            out_sbp=(B,),
        )
        np.testing.assert_allclose(f(W, X).numpy(), want, rtol=1e-5, atol=1e-5)
        e = f.explain(W, X)
        constrained = [d for d in e.ops if d[0] == "sbp_constrain"]
        assert all(src.startswith(__file__) for _, src, _, _ in constrained)  # the user's line
        cotangent_layouts[grad_sbp] = [outs[0] for _, _, _, outs in constrained[1:]]
        assert measured(f, W, X) == e.bytes
    assert cotangent_layouts == {None: [], S1: [(S1,)]}
    assert sj.constrain(jnp.ones(3), sj.B, grad_sbp=sj.B).shape == (3,)  # outside sj.jit: identity


def test_out_sbp_boxes_outputs_and_plain_arrays_are_broadcast(pl8):
    X = rng().normal(size=(16, 8)).astype(np.float32)
    f = sj.jit(lambda x: x.sum(0), placement=pl8, in_sbp=(S0,), out_sbp=S0)
    y = f(X)
    assert y.sbp == (S0,)
    assert_close(y.numpy(), X.sum(0), rtol=1e-5)
    assert [s.op for b in f.explain(X).boxings for s in b.plan.steps] == ["reduce_scatter"]
    g = sj.jit(lambda x: x * 2, placement=pl8)
    assert g(X).sbp == (B,)


def test_errors(pl8, pl24):
    with pytest.raises(sj.SBPError, match=r"has 1 entries but the placement has 2 axes"):
        sj.jit(lambda x: x, placement=pl24, in_sbp=(S0,))(np.ones((8, 8), np.float32))
    with pytest.raises(
        sj.SBPError, match=r"sj.constrain at .*splits a dim the tensor of shape \(16,\) does not have"
    ):
        sj.jit(lambda x: sj.constrain(x, sj.S(1)), placement=pl8)(np.ones(16, np.float32))
    with pytest.raises(sj.SBPError, match="must be an sj.Placement"):
        sj.jit(lambda x: x, placement="x")


def test_unknown_primitive_runs_whole_with_a_warning(pl8):
    X = rng().normal(size=(8, 8)).astype(np.float32)

    def absmax(a):
        return np.abs(a).max(axis=1).astype(np.float32)

    def fn(x):  # a host callback: no rule, every device runs it whole
        return jax.pure_callback(absmax, jax.ShapeDtypeStruct((8,), np.float32), x)

    f = sj.jit(fn, placement=pl8)
    with pytest.warns(sj.SBPWarning, match=r"no SBP rule for 'pure_callback' at .*test_jit.py"):
        y = f(sj.to_global(X, pl8, S0))
    assert_close(y.numpy(), np.asarray(fn(X)), rtol=1e-5, scale=4.0)


@pytest.mark.parametrize("xs, ks, want", [(S0, B, S0), (B, sj.S(3), sj.S(3)), (sj.S(3), sj.S(2), P)], ids=str)
def test_conv_batch_and_channel_splits(xs, ks, want, pl8):
    x = rng().normal(size=(8, 6, 6, 16)).astype(np.float32)  # NHWC
    k = rng(1).normal(size=(3, 3, 16, 8)).astype(np.float32)  # HWIO
    conv = lambda a, b: jax.lax.conv_general_dilated(
        a,
        b,
        (1, 1),
        "SAME",  # noqa: E731
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    f = sj.jit(conv, placement=pl8)
    args = (sj.to_global(x, pl8, xs), sj.to_global(k, pl8, ks))
    y = f(*args)
    assert y.sbp == (want,)
    np.testing.assert_allclose(y.numpy(), conv(x, k), rtol=1e-4, atol=1e-4)
    assert measured(f, *args) == f.explain(*args).bytes == 0


def test_explain_reports_the_time_of_each_phase(pl24):
    f = sj.jit(lambda a, b: jnp.tanh(a @ b).sum(), placement=pl24, in_sbp=((sj.S(0), sj.B), (sj.B, sj.S(1))))
    a, b = np.ones((16, 32), np.float32), np.ones((32, 64), np.float32)
    e = f.explain(a, b)
    assert set(e.timings) == {"trace_s", "choose_s", "build_s"} and all(v >= 0 for v in e.timings.values())
    assert "front end" in e.summary() and "XLA compile" not in e.summary()
    e = f.explain(a, b, compile=True)  # lowers and compiles with XLA too
    assert e.timings["xla_compile_s"] > 0 and e.timings["lower_s"] > 0
    assert "XLA compile" in e.summary() and "XLA compile" in str(e)


def test_a_none_among_the_arguments_shifts_no_layout(pl24):
    """None is no leaf of the values: the None standing for it in in_sbp (or
    out_sbp) must not become an entry, or every later argument takes the
    layout written for the one before it."""
    a = np.arange(16 * 32, dtype=np.float32).reshape(16, 32)

    def f(pair, v, w):
        return {"a": None, "b": pair[0] + v}, w * 2

    sbp = ((sj.S(0), sj.B), (sj.S(1), sj.S(0)), (sj.B, sj.S(1)))
    g = sj.jit(
        f, placement=pl24, in_sbp=((sbp[0], None), sbp[1], sbp[2]), out_sbp=({"a": None, "b": sbp[2]}, sbp[1])
    )
    assert [tuple(nd) for nd in g.explain((a, None), a, a).propagation.in_sbp] == list(sbp)
    out, w2 = g((a, None), a, a)
    assert out["a"] is None and out["b"].sbp == sbp[2] and w2.sbp == sbp[1]
    np.testing.assert_array_equal(out["b"].numpy(), a + a)
    np.testing.assert_array_equal(w2.numpy(), a * 2)


def test_a_bad_layout_names_the_leaf_by_its_place_in_the_call(pl24):
    f = sj.jit(lambda p, x: p["w"] @ x, placement=pl24, in_sbp=({"w": (S0, B)}, (B, sj.S(1))))
    with pytest.raises(sj.SBPError, match=r"in_sbp of argument args\[1\] \(8,\).*splits dim 1"):
        f({"w": np.ones((4, 8), np.float32)}, np.ones(8, np.float32))


def test_in_sbp_for_an_argument_passed_by_keyword_says_so(pl24):
    """As jax.jit's in_shardings, in_sbp covers positional arguments; a call
    passing one by keyword is told that, not only that the trees differ."""
    f = sj.jit(lambda w, x: jnp.tanh(x @ w), placement=pl24, in_sbp=((B, sj.S(1)), (S0, B)))
    w, x = np.ones((32, 64), np.float32), np.ones((16, 32), np.float32)
    with pytest.raises(sj.SBPError, match=r"positional arguments only.*passes \['x'\] by keyword"):
        f(w, x=x)
    assert_close(f(w, x).numpy(), np.tanh(x @ w), rtol=1e-6)


def test_lower_and_explain_read_shapes_and_place_no_data(pl24, monkeypatch):
    """As jax.jit's lower(), sj.jit's lower() and explain() need only the
    arguments' shapes and dtypes: they place nothing (jax.device_put, which
    to_global places data with, is not called), ShapeDtypeStructs stand for
    the arrays, and the program lowered is the one a call runs (its
    arguments placed: ``_prepare``), for an uneven split, a Python number,
    a weakly typed jax array (whole, and split evenly), a global tensor in
    another layout and an AUTO argument. That program runs on the placed
    arguments. A call needs values, and says so."""

    def f(w, x, b, c):
        return jnp.tanh(x @ w) + b + c[:13, None]

    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(16, 24)).astype(np.float32), rng.normal(size=(13, 16)).astype(np.float32)
    c = jnp.full((16,), 0.5)  # weakly typed, as the Python numbers it is made from
    cases = {
        "arrays": (w, x, 2.0, c),
        "a weak scalar": (w, x, jnp.asarray(2.0), c),
        "a global tensor in another layout": (sj.to_global(w, pl24, (S0, B)), x, 2.0, c),
    }
    described = (
        jax.ShapeDtypeStruct(w.shape, w.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((), np.float32, weak_type=True),
        jax.ShapeDtypeStruct((16,), np.float32, weak_type=True),
    )
    want = np.tanh(x @ w) + 2.0 + 0.5
    for in_sbp in (((B, S1), (S0, B), None, (S0, B)), (sj.AUTO, (S0, B), None, (S0, B))):
        g = sj.jit(f, placement=pl24, in_sbp=in_sbp, out_sbp=(S0, B))
        for name, args in cases.items():
            placed, (_, program, _) = g._prepare(args, {})
            runs = program.lower(*[t.physical for t in placed]).as_text()
            with monkeypatch.context() as m:
                m.setattr(jax, "device_put", None)  # placing data would fail
                assert g.lower(*args).as_text() == runs, (in_sbp, name)
                assert g.explain(*args).bytes == g.explain(*described).bytes
            (out,) = g.lower(*args).compile()(*[t.physical for t in placed])
            assert_close(sj.GlobalTensor(out, (13, 24), np.float32, pl24, (S0, B)).numpy(), want, rtol=1e-5)
        with monkeypatch.context() as m:
            m.setattr(jax, "device_put", None)
            described_text = g.lower(*described).as_text()
        assert (
            described_text
            == program.lower(*[t.physical for t in g._prepare(cases["a weak scalar"], {})[0]]).as_text()
        )
        with pytest.raises(sj.SBPError, match="ShapeDtypeStruct: it describes an argument for f.lower"):
            g(*described)
    key = jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype)
    with pytest.raises(sj.SBPError, match="ShapeDtypeStruct of typed PRNG keys"):
        sj.jit(lambda k: jax.random.uniform(k, (8,)), placement=pl24).lower(key)


def test_lower_describes_a_weak_global_tensor_as_its_boxing_makes_it(pl24):
    """A weakly typed global tensor boxed by the call stays weak, but for a
    zero-fill along its split dim (S -> P), which makes a new array of the
    dtype: lower() describes each as the call's boxing makes it (traced,
    not run), so its program is the call's."""

    def f(c):
        return c.astype(jnp.bfloat16) * 2

    for src, dst in (((S0, B), (P, B)), ((S0, S1), (P, P)), ((B, B), (S0, B)), ((S0, B), (B, B))):
        c = sj.to_global(jnp.full((8, 8), 0.5), pl24, src)
        g = sj.jit(f, placement=pl24, in_sbp=(dst,))
        placed, (_, program, _) = g._prepare((c,), {})
        described = g._prepare((c,), {}, abstract=True)[0]
        assert described[0].physical.weak_type == placed[0].physical.weak_type == (dst[0] != P), (src, dst)
        assert g.lower(c).as_text() == program.lower(*[t.physical for t in placed]).as_text(), (src, dst)
        np.testing.assert_array_equal(g(c).numpy().astype(np.float32), np.ones((8, 8), np.float32))
