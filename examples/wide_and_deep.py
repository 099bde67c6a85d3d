"""Wide & Deep on synthetic clicks: embedding tables split by vocabulary and by hidden dim.

    python examples/wide_and_deep.py                    # seconds on 8 CPU devices
    python examples/wide_and_deep.py --vocab-per-field 65536 --dim 64 --steps 3000 --batch 4096   # bigger

Click-through models look up one id per categorical field (user, item, ad,
...) in embedding tables far larger than one device's memory (OneFlow's
Wide & Deep against HugeCTR, Sec. 6.3.2). The layouts, on one axis of 8
devices:

- the wide table (one weight per id) is split by vocabulary, S(0): each
  device looks up only the ids it holds and writes zeros for the others, so
  the lookup comes out P(sum) and the wide logit is a partial sum that is
  reduced once, at the end (one number per example);
- the deep table (a vector per id) is split by hidden dim, S(1): each device
  looks up every id but holds 1/8 of each vector, and the first dense layer
  takes that split as its contraction split ((S(1), S(0)) -> P(sum));
- the batch is split by example (S(0)): the ids are all-gathered (a few
  integers per example) for the lookups, and the dense tower after the first
  layer runs data parallel.

On the way back sj.jit's greedy propagation, choosing op by op, computes
both tables' gradients as P(sum) over the whole table and reduce-scatters
them (the two largest reduce-scatters in the plan summary), where gathering
the batch-sized gradient of the lookups first would give them split
directly. ``sj.constrain`` sets forward layouts only, so the example cannot
pin the backward one; the values are right either way.

Why one axis of 8 and not 2x4: the tables are what does not fit, and on one
axis each device holds 1/8 of them; a 2x4 placement (batch over 2, tables over
4) would keep two copies of every table to save gathering ids that are tiny
next to the embeddings.

The clicks are synthetic: each id has a hidden weight (what the wide part can
memorise) and a hidden latent vector, and pairs of fields interact through
them (what the deep part must learn); the label is a coin flip with the
resulting probability. The AUC of the true probabilities is printed as the
ceiling.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.flax as sjf  # noqa: E402
from sbpjax import S  # noqa: E402

# -- data ------------------------------------------------------------------------


class Clicks:
    """``fields`` categorical fields of ``vocab_per_field`` ids each, numbered
    into one shared vocabulary (field f owns ids f*V .. f*V+V-1). The true
    logit of an example is the sum of its ids' weights plus the dot products
    of the latent vectors of every pair of its fields."""

    def __init__(self, fields: int, vocab_per_field: int, latent: int = 4, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fields, self.vocab_per_field = fields, vocab_per_field
        vocab = fields * vocab_per_field
        self.weight = (0.5 * rng.normal(size=vocab)).astype(np.float32)
        self.latent = (rng.normal(size=(vocab, latent)) / np.sqrt(latent * fields)).astype(np.float32)
        self.bias = -1.0  # most ads are not clicked
        self.rng = np.random.default_rng(seed + 1)

    def sample(self, n: int):
        """Ids (n, fields), click labels (n,) and the true click probabilities."""
        ids = self.rng.integers(0, self.vocab_per_field, size=(n, self.fields))
        ids = (ids + self.vocab_per_field * np.arange(self.fields)).astype(np.int32)
        v = self.latent[ids].sum(axis=1)
        pairs = 0.5 * ((v * v).sum(-1) - (self.latent[ids] ** 2).sum(axis=(1, 2)))  # sum over f < g
        logit = self.bias + self.weight[ids].sum(axis=1) + 2.0 * pairs
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (self.rng.random(n) < p).astype(np.float32)
        return ids, labels, p


def auc(scores, labels) -> float:
    """Area under the ROC curve: the chance that a random click scores above a
    random non-click (the Mann-Whitney statistic, ties counted half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = np.asarray(scores)[order]
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, count in zip(first, counts):
        ranks[order[start : start + count]] = start + (count + 1) / 2
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# -- model -----------------------------------------------------------------------


class WideAndDeep(nnx.Module):
    def __init__(self, vocab: int, fields: int, dim: int, hidden: int, rngs: nnx.Rngs):
        self.wide = nnx.Embed(vocab, 1, embedding_init=nnx.initializers.zeros, rngs=rngs)
        self.deep = nnx.Embed(vocab, dim, rngs=rngs)
        # the first dense layer contracts over (field, dim) at once, so the dim
        # split of the deep embeddings is its contraction split
        self.fc1 = nnx.Param(
            nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)(rngs.params(), (fields, dim, hidden))
        )
        self.fc1_bias = nnx.Param(jnp.zeros(hidden))
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, ids):
        wide = self.wide(ids).sum(axis=(1, 2))  # (batch,)
        h = jnp.einsum("bfd,fdh->bh", self.deep(ids), self.fc1[...]) + self.fc1_bias[...]
        h = jax.nn.relu(self.fc2(jax.nn.relu(h)))
        return wide + self.out(h)[:, 0]  # the click logit


def loss_fn(model, batch):
    ids, labels = batch
    return optax.sigmoid_binary_cross_entropy(model(ids), labels).mean()


RULES = {
    "wide.embedding": (S(0),),  # split by vocabulary: the lookup gives P(sum)
    "deep.embedding": (S(1),),  # split by hidden dim: the lookup gives S(2) of (batch, field, dim)
    "fc1": (S(1),),  # the matching contraction split: (S(2), S(1)) -> P(sum)
}
BATCH_SBP = (S(0),)  # ids and labels split by example


def build(fields: int, vocab_per_field: int, dim: int, hidden: int, seed: int = 0) -> WideAndDeep:
    return sjf.annotate(WideAndDeep(fields * vocab_per_field, fields, dim, hidden, nnx.Rngs(seed)), RULES)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fields", type=int, default=8)
    ap.add_argument("--vocab-per-field", type=int, default=1024, help="fields x this: a multiple of 8")
    ap.add_argument("--dim", type=int, default=16, help="deep embedding size; a multiple of 8")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=512, help="global batch; a multiple of the 8 devices")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)

    data = Clicks(args.fields, args.vocab_per_field)
    pl = sj.placement(8, "x")
    vocab = args.fields * args.vocab_per_field
    print(
        f"{args.fields} fields, vocabulary {vocab}: wide table {vocab}x1 split S(0), deep table "
        f"{vocab}x{args.dim} split S(1), over {pl!r}"
    )
    model = build(args.fields, args.vocab_per_field, args.dim, args.hidden)
    trainer = sjf.Trainer(model, optax.adam(args.lr), loss_fn, pl, batch_sbp=BATCH_SBP)
    ids, labels, _ = data.sample(args.batch)
    print(trainer.explain((ids, labels)).summary())

    t0 = time.perf_counter()
    losses = []
    for i in range(args.steps):
        ids, labels, _ = data.sample(args.batch)
        losses.append(trainer.step((ids, labels)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"  step {i + 1:>5}/{args.steps}  loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    k = max(1, min(20, args.steps // 5))
    print(
        f"loss: first {k} steps {np.mean(losses[:k]):.3f} -> last {k} steps {np.mean(losses[-k:]):.3f} "
        f"({args.steps / seconds:.0f} steps/s)"
    )
    ids, labels, p_true = data.sample(20000)
    logits = np.asarray(trainer.model()(ids))
    test_auc = auc(logits, labels)
    print(
        f"held-out AUC {test_auc:.3f} (true probabilities: {auc(p_true, labels):.3f}); "
        f"accuracy {np.mean((logits > 0) == (labels > 0.5)):.1%} (always 'no click': {1 - labels.mean():.1%})"
    )
    return losses, test_auc


if __name__ == "__main__":
    main()
