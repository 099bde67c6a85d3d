"""A Trainer run on a 2x4 placement; prints ``LOSSES <repr list>``.

Run once as one process with 8 simulated devices and once under
``python -m sbpjax.launch -n 2 --local-devices 4`` (tests/test_multihost.py
compares the two)."""

import os
import sys

import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flax"))
from mlp_model import MLP, loss_fn  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.flax as sjf  # noqa: E402
from sbpjax import B, S  # noqa: E402

RULES = {"fc1.kernel": (B, S(1)), "fc1.bias": (B, S(0)), "fc2.kernel": (B, S(0))}

pl = sj.placement((2, 4), ("x", "y"))
trainer = sjf.Trainer.create(
    lambda: sjf.annotate(MLP(nnx.Rngs(0), 16, 32), RULES), optax.adamw(1e-2), loss_fn, pl, batch_sbp=(S(0), B)
)
rng = np.random.default_rng(0)
losses = []
for _ in range(4):
    x = rng.normal(size=(8, 16)).astype(np.float32)
    losses.append(float(trainer.step((x, np.tanh(x)))))
print("LOSSES", repr(losses))
print("KERNEL", repr(float(np.abs(trainer.params["fc2"]["kernel"].numpy()).sum())))
