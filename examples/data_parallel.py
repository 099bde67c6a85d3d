"""Data parallelism: a small classifier on scikit-learn's digits, over 8 devices.

    python examples/data_parallel.py                        # a few seconds on 8 CPU devices
    python examples/data_parallel.py --steps 2000 --hidden 512 --batch 256   # bigger

The 8x8 handwritten digits ship inside scikit-learn (``pip install
'sbpjax[examples]'``), so this runs offline. The layouts are the simplest
there are: the batch is split over the 8 devices (S(0)) and every parameter
is whole on each (B, the default for an unannotated parameter). ``sj.jit``
derives the rest: activations come out S(0), the gradient of each B
parameter comes out P(sum) (each device summed over its own examples), and
one all-reduce per parameter makes it B again before the optimizer update,
the classic data-parallel step. The plan summary printed first says so.
"""

from __future__ import annotations

import argparse
import os
import sys
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


def load_digits(test_fraction: float = 0.25, seed: int = 0):
    """Train and test arrays: 1797 images of 8x8 pixels (0..16, scaled to
    0..1) with labels 0..9, split at random."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        sys.exit(
            "data_parallel.py needs scikit-learn for the digits data set: "
            "pip install 'sbpjax[examples]' (or pip install scikit-learn)."
        )
    digits = sklearn_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def batches(x, y, batch: int, seed: int = 0):
    """Endless random batches of exactly ``batch`` examples (a fixed size, so
    the step compiles once and the batch splits evenly over the devices)."""
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.choice(len(x), size=batch, replace=False)
        yield x[idx], y[idx]


# -- model -----------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, n_in: int, hidden: int, n_classes: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(n_in, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, n_classes, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.fc1(x))
        x = jax.nn.relu(self.fc2(x))
        return self.out(x)


def loss_fn(model, batch):
    x, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()


def accuracy(model, x, labels) -> float:
    return float(np.mean(np.asarray(jnp.argmax(model(x), axis=-1)) == labels))


# No parameter rules: every parameter stays B. Only the batch is split.
BATCH_SBP = (S(0),)  # images and labels split by example over the 8 devices


def build(hidden: int, seed: int = 0) -> MLP:
    return MLP(64, hidden, 10, nnx.Rngs(seed))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="global batch; a multiple of the 8 devices")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = load_digits()
    pl = sj.placement(8, "data")
    print(f"digits: {len(x_train)} train / {len(x_test)} test images; placement {pl!r}")
    model = build(args.hidden)
    trainer = sjf.Trainer(model, optax.adam(args.lr), loss_fn, pl, batch_sbp=BATCH_SBP)
    data = batches(x_train, y_train, args.batch)
    print(trainer.explain(next(data)).summary())

    t0 = time.perf_counter()
    losses = []
    for i in range(args.steps):
        losses.append(trainer.step(next(data)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"  step {i + 1:>5}/{args.steps}  loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    k = max(1, min(20, args.steps // 5))
    print(
        f"loss: first {k} steps {np.mean(losses[:k]):.3f} -> last {k} steps {np.mean(losses[-k:]):.3f} "
        f"({args.steps / seconds:.0f} steps/s)"
    )
    trained = trainer.model()
    test_accuracy = accuracy(trained, x_test, y_test)
    print(f"accuracy: train {accuracy(trained, x_train, y_train):.1%}, test {test_accuracy:.1%}")
    return losses, test_accuracy


if __name__ == "__main__":
    main()
