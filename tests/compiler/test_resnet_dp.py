"""A data-parallel ResNet with BatchNorm and max pooling: the training step
moves no more than GSPMD's (it once moved 19x: a partial gradient was
broadcast to activation size before its reduction), runs nothing whole on
every device, and equals the single-device step."""

import warnings

import jax
import numpy as np
import optax
import pytest
from conftest import assert_close, xla_peak
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import sbpjax as sj
from sbpjax._errors import SBPWarning


class Block(nnx.Module):
    def __init__(self, c, rngs):
        self.conv1, self.bn1 = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.BatchNorm(c, rngs=rngs)
        self.conv2, self.bn2 = nnx.Conv(c, c, (3, 3), rngs=rngs), nnx.BatchNorm(c, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(x + self.bn2(self.conv2(h)))


class ResNet(nnx.Module):
    def __init__(self, rngs):
        self.stem, self.bn = nnx.Conv(3, 16, (3, 3), rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.blocks = (
            nnx.List([Block(16, rngs), Block(16, rngs)])
            if hasattr(nnx, "List")
            else [Block(16, rngs), Block(16, rngs)]
        )
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.bn(self.stem(x))), (2, 2), (2, 2))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


def _sgd_step(batch, size):
    """The model's parameters and BatchNorm statistics, a batch of ``batch``
    ``size`` x ``size`` images with labels, and one SGD step on them."""
    graphdef, params, stats = nnx.split(ResNet(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    p, s = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, size, size, 3)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int32)

    def loss(p, s, x, y):
        model = nnx.merge(graphdef, p, s)
        ce = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        return ce, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

    def step(p, s, x, y):
        (value, new_s), g = jax.value_and_grad(loss, has_aux=True)(p, s, x, y)
        return value, jax.tree.map(lambda a, b: a - 0.1 * b, p, g), new_s

    return (p, s, x, y), step


def test_data_parallel_resnet_with_batchnorm_moves_no_more_than_gspmd(pl8):
    (p, s, x, y), step = _sgd_step(16, 16)

    B, S0 = sj.B, sj.S(0)
    p_sbp, s_sbp = jax.tree.map(lambda _: (B,), p), jax.tree.map(lambda _: (B,), s)
    f = sj.jit(step, placement=pl8, in_sbp=(p_sbp, s_sbp, (S0,), (S0,)), out_sbp=((B,), p_sbp, s_sbp))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        value, new_p, new_s = f(p, s, x, y)
        compiled = f.lower(p, s, x, y).compile()
    want_value, want_p, want_s = jax.jit(step)(p, s, x, y)
    assert_close(value.numpy(), want_value, rtol=1e-5)
    # one scale for the whole model: the conv biases before a BatchNorm have an
    # analytically zero gradient, so their updates are rounding noise
    scale = max(float(np.abs(w).max()) for w in jax.tree.leaves((want_p, want_s)))
    for got, want in zip(
        jax.tree.leaves((new_p, new_s), is_leaf=lambda v: isinstance(v, sj.GlobalTensor)),
        jax.tree.leaves((want_p, want_s)),
    ):
        assert_close(got.numpy(), want, rtol=1e-5, scale=scale)

    ours = sum(c.bytes for c in sj.collectives(compiled))
    assert ours == f.explain(p, s, x, y).bytes
    shard = lambda spec: NamedSharding(pl8.mesh, spec)  # noqa: E731
    rep = lambda tree: jax.tree.map(lambda _: shard(PS()), tree)  # noqa: E731
    g = jax.jit(
        step,
        in_shardings=(rep(p), rep(s), shard(PS("x")), shard(PS("x"))),
        out_shardings=(shard(PS()), rep(p), rep(s)),
    )
    theirs = sum(c.bytes for c in sj.collectives(g.lower(p, s, x, y).compile()))
    assert ours <= theirs, (ours, theirs)


@pytest.mark.slow
def test_height_split_resnet_holds_no_more_than_gspmd(pl24):
    """Batch on x, image height on y. A zero-fill of a split activation into a
    partial moves no byte, so the byte-optimal plan once kept BatchNorm's
    backward activations as full-size (P, P) partials: 1.5x GSPMD's peak
    memory for 0.5% fewer bytes. The zero-fill's growth is priced now."""
    (p, s, x, y), step = _sgd_step(8, 32)

    B, S0, S1 = sj.B, sj.S(0), sj.S(1)
    p_sbp, s_sbp = jax.tree.map(lambda _: (B, B), p), jax.tree.map(lambda _: (B, B), s)
    f = sj.jit(step, placement=pl24, in_sbp=(p_sbp, s_sbp, (S0, S1), (S0, B)), out_sbp=((B, B), p_sbp, s_sbp))
    value, new_p, _ = f(p, s, x, y)
    compiled = f.lower(p, s, x, y).compile()
    want_value, want_p, _ = jax.jit(step)(p, s, x, y)
    assert_close(value.numpy(), want_value, rtol=1e-5)
    scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(want_p))
    for got, want in zip(
        jax.tree.leaves(new_p, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)), jax.tree.leaves(want_p)
    ):
        assert_close(got.numpy(), want, rtol=1e-5, scale=scale)

    shard = lambda spec: NamedSharding(pl24.mesh, spec)  # noqa: E731
    rep = lambda tree: jax.tree.map(lambda _: shard(PS()), tree)  # noqa: E731
    g = (
        jax.jit(
            step,
            in_shardings=(rep(p), rep(s), shard(PS("x", "y")), shard(PS("x"))),
            out_shardings=(shard(PS()), rep(p), rep(s)),
        )
        .lower(p, s, x, y)
        .compile()
    )
    ours, theirs = sum(c.bytes for c in sj.collectives(compiled)), sum(c.bytes for c in sj.collectives(g))
    assert ours == f.explain(p, s, x, y).bytes
    assert ours <= theirs, (ours, theirs)
    assert xla_peak(compiled) <= 1.05 * xla_peak(g), (xla_peak(compiled), xla_peak(g))
