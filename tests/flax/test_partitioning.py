"""Models annotated for jax.sharding (nnx.with_partitioning with logical axis
names and rules, Linen nn.with_partitioning / nn.with_logical_partitioning)
train under sbpjax with no second annotation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, nnx_single_device
from flax import linen as nn
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S
from sbpjax.flax.partitioning import sbp_from_spec

VOCAB, EMBED, HEADS, MLP, SEQ, BATCH = 64, 32, 4, 64, 8, 8
# The Flax lm1b example's style: logical names on parameters, rules to the mesh.
RULES = [("batch", "x"), ("vocab", "y"), ("embed", None), ("heads", "y"), ("kv", None), ("mlp", "y")]


def part(init, names):
    return nnx.with_partitioning(init, names)


class DecoderLM(nnx.Module):
    """A one-block decoder LM annotated only with logical partitioning."""

    def __init__(self, rngs):
        dense = nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(
            VOCAB, EMBED, embedding_init=part(nnx.initializers.normal(0.02), ("vocab", "embed")), rngs=rngs
        )
        self.norm = nnx.LayerNorm(
            EMBED,
            scale_init=part(nnx.initializers.ones_init(), ("embed",)),
            bias_init=part(nnx.initializers.zeros_init(), ("embed",)),
            rngs=rngs,
        )
        self.qkv = nnx.LinearGeneral(
            EMBED,
            (3, HEADS, EMBED // HEADS),
            kernel_init=part(dense, ("embed", None, "heads", "kv")),
            use_bias=False,
            rngs=rngs,
        )
        self.out = nnx.LinearGeneral(
            (HEADS, EMBED // HEADS),
            EMBED,
            axis=(-2, -1),
            kernel_init=part(dense, ("heads", "kv", "embed")),
            use_bias=False,
            rngs=rngs,
        )
        self.fc1 = nnx.Linear(
            EMBED,
            MLP,
            kernel_init=part(dense, ("embed", "mlp")),
            bias_init=part(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=rngs,
        )
        self.fc2 = nnx.Linear(
            MLP,
            EMBED,
            kernel_init=part(dense, ("mlp", "embed")),
            bias_init=part(nnx.initializers.zeros_init(), ("embed",)),
            rngs=rngs,
        )

    def __call__(self, tokens):
        x = self.embed(tokens)
        q, k, v = jnp.moveaxis(self.qkv(self.norm(x)), 2, 0)
        mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        att = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(EMBED // HEADS), -1e9)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v))
        x = x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))
        return self.embed.attend(x)


def loss_fn(model, batch):
    tokens, targets = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def batches(n=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        t = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
        out.append((t[:, :-1], t[:, 1:]))
    return out


WANT = {
    "embed": {"embedding": (B, S(0))},
    "fc1": {"kernel": (B, S(1)), "bias": (B, S(0))},
    "fc2": {"kernel": (B, S(0)), "bias": (B, B)},
    "qkv": {"kernel": (B, S(2))},
    "out": {"kernel": (B, S(0))},
    "norm": {"scale": (B, B), "bias": (B, B)},
}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["eager_sharded_on_the_mesh", "rules_in_context"])
def test_lm_annotated_with_logical_partitioning_trains_like_one_device(how):
    pl = sj.placement((2, 4), ("x", "y"))
    if how == "eager_sharded_on_the_mesh":  # built as for jax.sharding: values already sharded
        with jax.set_mesh(pl.mesh), nnx.logical_axis_rules(RULES):
            model = DecoderLM(nnx.Rngs(0))
        assert sjf.get_sbp(model, pl) == WANT
        trainer = sjf.Trainer(model, optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0), B))
    else:  # plain arrays; the rules say what the logical names mean
        with nnx.use_eager_sharding(False):
            model = DecoderLM(nnx.Rngs(0))
        assert sjf.get_sbp(model, pl, rules=RULES) == WANT
        with nnx.logical_axis_rules(RULES):
            trainer = sjf.Trainer(model, optax.sgd(0.1), loss_fn, pl, batch_sbp=(S(0), B))
    data = batches()
    losses = [trainer.step(b) for b in data]
    with nnx.use_eager_sharding(False):
        reference = DecoderLM(nnx.Rngs(0))
    ref_losses, ref_params = nnx_single_device(reference, optax.sgd(0.1), loss_fn, data)
    assert_close(losses, ref_losses, rtol=1e-5)
    got = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(trainer.model(), nnx.Param)))
    scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(ref_params))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params)):
        assert_close(g, w, rtol=1e-5, scale=scale)


def test_linen_partitioned_and_logically_partitioned():
    pl = sj.placement((2, 4), ("x", "y"))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(
                16, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            )(x)
            return nn.Dense(4, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("y", None)))(
                x
            )

    params = Model().init(jax.random.key(0), jnp.ones((2, 8)))["params"]
    assert sjf.linen.get_sbp(params, pl, rules=[("embed", None), ("mlp", "y")]) == {
        "Dense_0": {"kernel": (B, S(1)), "bias": (B, B)},
        "Dense_1": {"kernel": (B, S(0)), "bias": (B, B)},
    }
    with nn.logical_axis_rules([("embed", "x"), ("mlp", "y")]):
        assert sjf.linen.get_sbp(params, pl)["Dense_0"]["kernel"] == (S(0), S(1))


def test_spec_mapping_and_its_errors():
    pl = sj.placement((2, 4), ("x", "y"))
    assert sbp_from_spec((("x", "y"), None), pl, 2) == (S(0), S(0))
    assert sbp_from_spec(("batch", None), pl, 2, [("batch", ("x", "y"))]) == (S(0), S(0))
    assert sbp_from_spec((None, "y"), pl, 3) == (B, S(1))
    with pytest.raises(sj.SBPError, match="placement axis order"):
        sbp_from_spec((("y", "x"),), pl, 1)
    with pytest.raises(sj.SBPError, match="uses placement axis 'x' twice"):
        sbp_from_spec(("x", "x"), pl, 2)
    with pytest.raises(sj.SBPError, match="neither an axis of the placement"):
        sbp_from_spec(("model",), pl, 1)
    with pytest.raises(sj.SBPError, match="3 entries for a parameter with 2 dims"):
        sbp_from_spec(("x", None, None), pl, 2)


def test_explicit_rules_naming_no_axis_are_an_error_not_a_fallback():
    """A rule given to get_sbp that maps a logical name to no axis of the
    placement (a misspelt axis) is an SBPError naming the rule, even where the
    parameter's own sharding could be read instead: that fallback is for
    models without rules, not for rules that do not resolve."""
    pl = sj.placement((2, 4), ("data", "model"))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", None))
    with jax.set_mesh(pl.mesh), nnx.logical_axis_rules([("mlp", "model")]):
        m = nnx.Linear(32, 4, kernel_init=init, rngs=nnx.Rngs(0))
    assert sjf.get_sbp(m, pl, rules=[("mlp", "data")])["kernel"] == (S(0), B)
    with pytest.raises(
        sj.SBPError, match=r"the rule \('mlp', 'modle'\) maps 'mlp' to 'modle', which is not an axis"
    ):
        sjf.get_sbp(m, pl, rules=[("mlp", "modle")])
    assert sjf.get_sbp(m, pl)["kernel"] == (B, S(0))  # no rules given: the value's own sharding
