"""Uneven splits inside sj.jit (``sbpjax.compiler.uneven``): batches and
vocabularies the devices do not divide. Every value is checked against the
single-device program, and the plan's bytes against the compiled program's
collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from models import D, block_loss, block_params, check_train, compiled_bytes, mlp_loss, mlp_params

import sbpjax as sj
from sbpjax.compiler.uneven import fits, uneven_dims

S0, S1, B, P = sj.S(0), sj.S(1), sj.B, sj.P


def rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# Train steps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [12, 13, 5])
def test_data_parallel_mlp_with_a_batch_the_devices_do_not_divide(batch, pl8):
    r = rng(batch)
    x, y = r.normal(size=(batch, D)).astype(np.float32), r.normal(size=(batch, D)).astype(np.float32)
    _, e = check_train(mlp_loss, mlp_params(), x, y, pl8, {"w1": (B,), "w2": (B,)}, (S0,), (S0,))
    steps = {s.op for b in e.boxings for s in b.plan.steps} - {"local_slice"}
    if batch >= 8:  # the batch stays split: the only collectives are the gradients' all-reduces
        assert steps == {"all_reduce"}
    else:  # 5 rows leave 3 devices idle: the batch is boxed to a layout that gives all work
        assert e.ops[0][2][0] != (S0,)


@pytest.mark.parametrize("batch", [6, 5])
def test_megatron_mlp_with_an_uneven_batch_on_2x4(batch, pl24):
    """The batch over 'x' (6 = 3+3 is even there, 5 = 3+2 is not), the hidden
    dim over 'y'; also the batch split over both axes (8 pieces)."""
    r = rng(batch)
    x, y = r.normal(size=(batch, D)).astype(np.float32), r.normal(size=(batch, D)).astype(np.float32)
    check_train(mlp_loss, mlp_params(), x, y, pl24, {"w1": (B, S1), "w2": (B, S0)}, (S0, B), (S0, B))
    check_train(mlp_loss, mlp_params(), x, y, pl24, {"w1": (B, B), "w2": (B, B)}, (S0, S0), (S0, S0))


def test_transformer_block_with_12_sequences_on_8_devices(pl8):
    r = rng(4)
    vocab = block_params()["emb"].shape[0]
    tokens = r.integers(0, vocab, size=(12, 8)).astype(np.int32)
    labels = r.integers(0, vocab, size=(12, 8)).astype(np.int32)
    params = block_params()
    check_train(block_loss, params, tokens, labels, pl8, {k: (B,) for k in params}, (S0,), (S0,), steps=2)


@pytest.mark.parametrize(
    "vocab, batch, kind", [(50, 5, "megatron"), (50, 6, "dp"), (97, 3, "megatron")], ids=str
)
def test_gpt_with_uneven_vocabulary_and_batch_on_2x4(vocab, batch, kind, pl24):
    """A GPT block whose vocabulary does not divide the tensor axis (50 on 4:
    13, 13, 12, 12) and whose batch does not divide the data axis (5 on 2);
    Megatron layouts split the head by vocabulary, the embedding is B."""
    import functools

    from models import gpt_loss, gpt_params, gpt_sbp

    r = rng(vocab + batch)
    tokens = r.integers(0, vocab, size=(batch, 8)).astype(np.int32)
    labels = r.integers(0, vocab, size=(batch, 8)).astype(np.int32)
    params = gpt_params(16, 1, vocab, seed=1)
    loss = functools.partial(gpt_loss, heads=4)
    _, e = check_train(
        loss, params, tokens, labels, pl24, gpt_sbp(params, kind, 2), (S0, B), (S0, B), steps=2
    )
    assert e.bytes > 0


def _lm_loss(p, tokens, labels):
    x = p["emb"][tokens]
    logits = jnp.tanh(x) @ p["head"]
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


def test_gpt2_vocabulary_split_over_4_devices():
    """50257 = 12565 + 3 x 12564: the embedding rows and the head's columns
    split by vocabulary; the softmax's max and sum and the label lookup are
    partials over the pieces."""
    pl = sj.placement(4, "x")
    vocab, d = 50257, 8
    r = rng(5)
    params = {
        "emb": (r.normal(size=(vocab, d)) / 3).astype(np.float32),
        "head": (r.normal(size=(d, vocab)) / 3).astype(np.float32),
    }
    tokens = r.integers(0, vocab, size=(4, 6)).astype(np.int32)
    labels = r.integers(0, vocab, size=(4, 6)).astype(np.int32)
    tokens[0, :4] = [0, 12564, 12565, vocab - 1]  # the first and last row of pieces
    labels[0, :4] = [12565, 12564, 0, vocab - 1]
    f, e = check_train(
        _lm_loss, params, tokens, labels, pl, {"emb": (S0,), "head": (S1,)}, (B,), (B,), opt=optax.sgd(0.5)
    )
    # nothing of vocabulary size crosses devices (the embedding gradient is
    # scattered whole on every device and sliced locally: 0 bytes)
    assert all(b.bytes == 0 for b in e.boxings if vocab in b.var.shape)
    activation = 4 * 6 * d * 4  # one (4, 6, 8) float32 value: 768 B; the table is 1.6 MB
    assert e.bytes <= 3 * 2 * (4 - 1) * activation  # at most three activation all-reduces


# ---------------------------------------------------------------------------
# The padded positions
# ---------------------------------------------------------------------------


def test_reductions_and_boxings_do_not_read_the_padding(pl8):
    """log(0) = -inf in the padding (to_global pads with zeros): sums, maxima,
    minima and contractions over the split dim, and a gather to B, must not see it."""
    X = rng(1).uniform(0.5, 2.0, size=(12, 5)).astype(np.float32)

    def fn(x):
        y = sj.constrain(jnp.log(x), S0)
        return y.sum(0), y.max(0), y.min(0), y.T @ y, y, jnp.cumsum(y, 0)

    f = sj.jit(fn, placement=pl8, in_sbp=(S0,), out_sbp=(B, B, B, B, B, S0))
    x = sj.to_global(X, pl8, S0)
    want = fn(X)
    for got, ref in zip(f(x), want):
        assert_close(got.numpy(), np.asarray(ref), rtol=1e-5)
    e = f.explain(x)
    assert e.ops[0][2] == [(S0,)] and e.ops[0][3] == [(S0,)]  # log runs on the uneven pieces
    assert compiled_bytes(f, x) == e.bytes


def test_iota_gather_and_scatter_add_on_uneven_pieces(pl8):
    """``iota`` starts each piece at its balanced offset; an embedding table
    split by rows (42 = 6+6+5+5+5+5+5+5) looks up and accumulates only its
    own rows, rows at the pieces' edges included."""
    table = rng(2).normal(size=(42, 3)).astype(np.float32)  # rows 6,6,5,5,5,5,5,5
    idx = np.array([0, 5, 6, 11, 12, 16, 17, 41, 41, 36, 37], np.int32)

    def fn(t, i, x):
        pos = x + jnp.arange(x.shape[0], dtype=x.dtype)[:, None]
        return pos, t[i], jax.grad(lambda t: jnp.sum(jnp.sin(t[i])))(t)

    X = rng(3).normal(size=(12, 4)).astype(np.float32)
    f = sj.jit(fn, placement=pl8, in_sbp=((S0,), (B,), (S0,)), out_sbp=((S0,), (B,), (S0,)))
    args = (sj.to_global(table, pl8, S0), idx, sj.to_global(X, pl8, S0))
    for got, ref in zip(f(*args), fn(table, idx, X)):
        assert_close(got.numpy(), np.asarray(ref), rtol=1e-5)
    e = f.explain(*args)
    assert compiled_bytes(f, *args) == e.bytes
    gather = [op for op in e.ops if op[0] == "gather"][0]
    assert gather[2][0] == (S0,)  # the table is not gathered for the lookup


def test_pooling_runs_on_uneven_batch_pieces(pl8):
    """A 2x2 max pool and an average pool of an NHWC batch of 12 on 8 devices,
    and the max pool's gradient (``select_and_scatter_add``): the windows
    never cross the batch dim, so each piece is pooled where it is. Before,
    the batch's split moved to the height and back: 71,680 B for the max
    pool alone, where a batch of 16 moves nothing."""
    X = rng(6).normal(size=(12, 8, 8, 3)).astype(np.float32)

    def fn(x):
        mx = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        avg = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9
        grad = jax.grad(
            lambda x: jnp.sum(
                jnp.sin(jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"))
            )
        )(x)
        return mx, avg, grad

    f = sj.jit(fn, placement=pl8, in_sbp=(S0,), out_sbp=(S0, S0, S0))
    x = sj.to_global(X, pl8, S0)
    for got, ref in zip(f(x), fn(X)):
        assert_close(got.numpy(), np.asarray(ref), rtol=1e-5)
    assert compiled_bytes(f, x) == f.explain(x).bytes == 0


def test_a_reshape_merging_an_uneven_dim_boxes_it_first(pl8):
    X = rng(4).normal(size=(12, 4)).astype(np.float32)
    f = sj.jit(lambda x: jnp.exp(x).reshape(48) * 2, placement=pl8, in_sbp=(S0,), out_sbp=(B,))
    x = sj.to_global(X, pl8, S0)
    assert_close(f(x).numpy(), np.exp(X).reshape(48) * 2, rtol=1e-6)
    e = f.explain(x)
    assert compiled_bytes(f, x) == e.bytes and e.bytes > 0


def test_uneven_inputs_outputs_and_constraints(pl8, pl24):
    X = rng(5).normal(size=(10, 6)).astype(np.float32)
    g = sj.jit(lambda x: sj.constrain(jnp.sin(x), S0) * 2, placement=pl8, in_sbp=(S1,), out_sbp=(S0,))
    y = g(X)
    assert y.sbp == (S0,)
    assert [p.shape for p in y.local_tensors().flat] == [(2, 6)] * 2 + [(1, 6)] * 6
    assert_close(y.numpy(), np.sin(X) * 2, rtol=1e-6)
    # nested uneven pieces over two axes: 10 -> 5, 5 -> 2,1,1,1 ...
    h = sj.jit(lambda x: jnp.tanh(x).sum(1), placement=pl24, in_sbp=((S0, S0),), out_sbp=(S0, S0))
    assert_close(h(X).numpy(), np.tanh(X).sum(1), rtol=1e-5)
    assert compiled_bytes(h, X) == h.explain(X).bytes == 0


# ---------------------------------------------------------------------------
# The rule that decides which signatures can run on uneven pieces
# ---------------------------------------------------------------------------


def test_fits_needs_every_member_of_an_axis_to_share_its_pieces():
    grid = (8,)
    assert uneven_dims((S0,), (12, 4), grid) == (0,)
    assert uneven_dims((S1,), (12, 16), grid) == ()
    assert fits([(S0,), (S0,)], [(12, 4), (12, 4)], grid)  # elementwise
    assert fits([(S0,), (B,), (S0,)], [(12, 4), (4, 3), (12, 3)], grid)  # x @ w, batch split
    assert fits([(S0,), (S0,), (P,)], [(12, 4), (12, 3), (4, 3)], grid)  # contraction: masked
    assert not fits([(S0,), (S0,)], [(12, 4), (48,)], grid)  # a reshape merging the dim
    assert not fits([(S0,), (S0,)], [(5, 4), (5, 4)], grid)  # devices with nothing to do
    assert fits([(S0,), (S0,)], [(16, 4), (64,)], grid)  # even: unchanged
