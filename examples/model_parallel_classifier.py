"""Model parallelism for many classes, as in InsightFace (OneFlow's Fig. 11).

    python examples/model_parallel_classifier.py                  # seconds on 8 CPU devices
    python examples/model_parallel_classifier.py --classes 65536 --steps 2000 --batch 512   # bigger

Face recognition trains a classifier over millions of identities: the class
weight matrix (features x classes) is too big for one device, and so are the
logits (batch x classes). The layouts, on one axis of 8 devices:

- the feature extractor is data parallel: the batch is split (S(0)), its
  parameters are whole (B);
- the class weights are split by class, S(1): each device scores every example
  against its eighth of the classes.

``sj.jit`` then gathers the features (S(0) -> B, a batch x features
all-gather), gets the logits S(1) from the matmul signature (B, S(1)) -> S(1),
and computes the softmax cross-entropy without ever gathering them: the max
and the sum over the split class dim are per-device partials (P(max), P(sum))
that an all-reduce of one number per example joins, exactly OneFlow's Fig. 11b
(two ``sj.constrain`` calls in the loss pin that choice; see its docstring).
On the way back, the features' gradient comes out P(sum) and is
reduce-scattered to the batch split. The example reads the collectives of
the compiled step and shows that none of them is anywhere near the logits'
size.

The data are synthetic: each class has a random centre in input space, and an
example is its centre plus noise. A cosine classifier (normalised features
and class weights, scaled, as InsightFace's heads) learns to tell them apart.
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
from sbpjax import B, S  # noqa: E402

# -- data ------------------------------------------------------------------------


class Identities:
    """``classes`` random centres in ``dim`` dimensions; an example of class c
    is centre c plus Gaussian noise of scale ``noise``."""

    def __init__(self, classes: int, dim: int, noise: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.centres = rng.normal(size=(classes, dim)).astype(np.float32)
        self.noise = noise
        self.rng = np.random.default_rng(seed + 1)

    def sample(self, n: int):
        labels = self.rng.integers(0, len(self.centres), size=n).astype(np.int32)
        noise = self.noise * self.rng.normal(size=(n, self.centres.shape[1])).astype(np.float32)
        return self.centres[labels] + noise, labels


# -- model -----------------------------------------------------------------------


def l2_normalize(x, axis):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-12)


class Backbone(nnx.Module):
    """The feature extractor (a ResNet in InsightFace; an MLP here)."""

    def __init__(self, n_in: int, hidden: int, features: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(n_in, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, features, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


class CosineClassifier(nnx.Module):
    """Logits ``scale * cos(feature, class weight)``: both normalised over the
    feature dim, which is never split, so the normalisation is local."""

    def __init__(self, n_in: int, hidden: int, features: int, classes: int, scale: float, rngs: nnx.Rngs):
        self.backbone = Backbone(n_in, hidden, features, rngs)
        self.classes = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (features, classes)))
        self.scale = scale

    def __call__(self, x):
        features = l2_normalize(self.backbone(x), axis=-1)
        return self.scale * features @ l2_normalize(self.classes[...], axis=0)


def softmax_cross_entropy(logits, labels):
    """Mean cross-entropy of class-split logits, written as OneFlow's Fig. 11b.

    The max and the sum over the split class dim are per-device partials; the
    two ``sj.constrain(..., B)`` make each one an all-reduce of one number per
    example. Without them (e.g. ``optax.softmax_cross_entropy_with_integer_labels``)
    sj.jit's greedy propagation splits the sum's gradient by batch, broadcasts
    it to batch x classes and then moves that logits-sized tensor back to the
    class split with an all-to-all. Outside sj.jit the constraints change nothing.
    """
    peak = sj.constrain(jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True)), (B,))
    shifted = logits - peak
    log_normalizer = jnp.log(sj.constrain(jnp.exp(shifted).sum(axis=-1), (B,)))
    label_logits = jnp.take_along_axis(shifted, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(log_normalizer - label_logits)


def loss_fn(model, batch):
    x, labels = batch
    return softmax_cross_entropy(model(x), labels)


def accuracy(model, x, labels) -> float:
    return float(np.mean(np.asarray(jnp.argmax(model(x), axis=-1)) == labels))


# Only the class weights are annotated; the backbone's parameters stay B.
RULES = {"classes": (S(1),)}  # split by class over the 8 devices
BATCH_SBP = (S(0),)  # inputs and labels split by example


def build(
    n_in: int, hidden: int, features: int, classes: int, scale: float = 16.0, seed: int = 0
) -> CosineClassifier:
    return sjf.annotate(CosineClassifier(n_in, hidden, features, classes, scale, nnx.Rngs(seed)), RULES)


def step_collectives(trainer, batch):
    """The collectives of the compiled train step (forward, backward, update)."""
    return sj.collectives(trainer.lower(batch).compile())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--classes", type=int, default=4096, help="a multiple of the 8 devices")
    ap.add_argument("--input-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--noise", type=float, default=0.5)
    ap.add_argument("--batch", type=int, default=256, help="global batch; a multiple of the 8 devices")
    ap.add_argument("--lr", type=float, default=1e-2)
    args = ap.parse_args(argv)

    data = Identities(args.classes, args.input_dim, args.noise)
    pl = sj.placement(8, "x")
    model = build(args.input_dim, args.hidden, args.features, args.classes)
    print(f"{args.classes} classes, class weights {args.features}x{args.classes} split S(1) over {pl!r}")
    trainer = sjf.Trainer(model, optax.adam(args.lr), loss_fn, pl, batch_sbp=BATCH_SBP)
    batch = data.sample(args.batch)
    print(trainer.explain(batch).summary())

    logits_bytes = args.batch * args.classes * 4
    print(
        f"collectives of the compiled step (the logits are {logits_bytes} B, {logits_bytes // 8} B per device):"
    )
    collectives = sorted(step_collectives(trainer, batch), key=lambda c: -c.bytes_per_device)
    for c in collectives:
        print(f"  {c.op:<15} {int(c.bytes_per_device):>9} B received per device  {c.shape}")
    print(
        f"largest collective: {int(collectives[0].bytes_per_device)} B per device, "
        f"{collectives[0].bytes_per_device / logits_bytes:.1%} of the logits"
    )

    t0 = time.perf_counter()
    losses = []
    for i in range(args.steps):
        losses.append(trainer.step(data.sample(args.batch)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"  step {i + 1:>5}/{args.steps}  loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    k = max(1, min(20, args.steps // 5))
    print(
        f"loss: first {k} steps {np.mean(losses[:k]):.3f} -> last {k} steps {np.mean(losses[-k:]):.3f} "
        f"(uniform guess: {np.log(args.classes):.3f}; {args.steps / seconds:.0f} steps/s)"
    )
    test_accuracy = accuracy(trainer.model(), *data.sample(4096))
    print(f"accuracy on fresh examples: {test_accuracy:.1%} (chance {1 / args.classes:.2%})")
    return losses, test_accuracy


if __name__ == "__main__":
    main()
