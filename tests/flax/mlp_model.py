"""The two-layer NNX MLP and its loss that several Trainer tests train (each at its own sizes)."""

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs, d: int, h: int):
        self.fc1 = nnx.Linear(d, h, rngs=rngs)
        self.fc2 = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)
