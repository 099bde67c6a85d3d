"""sbpjax for Flax: SBP layouts on NNX and Linen modules, and training steps.

import sbpjax.flax as sjf
sjf.annotate(model, {"blocks.*.mlp.fc1.kernel": (B, S(1)), "blocks.*.mlp.fc2.kernel": (B, S(0))})
trainer = sjf.Trainer(model, optax.adamw(3e-4), loss_fn, pl, batch_sbp=(S(0), B), zero=True)
loss = trainer.step(batch)
# or born sharded, for a model larger than one device:
trainer = sjf.Trainer.create(lambda: sjf.annotate(Model(nnx.Rngs(0)), rules), optax.adamw(3e-4), loss_fn, pl,
                             batch_sbp=(S(0), B))
"""

from sbpjax.flax import linen
from sbpjax.flax.annotate import annotate, get_sbp, place, sbp_module, unplace, with_sbp
from sbpjax.flax.train import TrainStep, init_global, spread_layout, zero_layout
from sbpjax.flax.trainer import Trainer, bytes_per_device

__all__ = [
    "with_sbp",
    "annotate",
    "get_sbp",
    "place",
    "unplace",
    "sbp_module",
    "TrainStep",
    "Trainer",
    "bytes_per_device",
    "init_global",
    "spread_layout",
    "zero_layout",
    "linen",
]
