"""ZeRO: the same model trained data parallel and with ZeRO; memory per device.

    python examples/zero.py                   # seconds on 8 CPU devices
    python examples/zero.py --bf16            # also ZeRO with bf16 compute
    python examples/zero.py --budget 0.5      # also layouts the solver picks under a memory budget
    python examples/zero.py --hidden 2048 --layers 8 --steps 500   # bigger

Plain data parallelism keeps a whole copy of every parameter and of its Adam
state (two more copies) on each of the 8 devices. ZeRO, as OneFlow's Fig. 14
writes it in SBP: the fp32 master weights and the optimizer state are stored
S(0) over the data axis, so each device holds an eighth; the loss sees each
weight boxed S(0) -> B (an all-gather) and its gradient, P(sum), is boxed to
S(0) (a reduce-scatter) instead of all-reduced to B. The same bytes cross the
wire (an all-reduce is a reduce-scatter plus an all-gather), the state per
device falls to 1/8, and the arithmetic is the same, so the losses agree.
With ``--bf16`` the weights are cast to bf16 before the all-gather (half the
bytes) and the model computes in bf16; master weights, gradients and
optimizer state stay fp32, and the losses agree to bf16 precision.
With ``--budget F`` a third trainer is given ``memory_budget``: F times the
bytes data parallelism holds per device in parameters and optimizer state,
plus the batch's share (the budget counts the step's arguments and results).
``sj.jit``'s solver then picks the cheapest layouts that fit, ZeRO's or its own.

The task is synthetic: regress the outputs of a fixed random "teacher"
network with the same architecture.
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

# -- model and data --------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, n_in: int, hidden: int, layers: int, n_out: int, rngs: nnx.Rngs):
        sizes = [n_in] + [hidden] * layers + [n_out]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


BATCH_SBP = (S(0),)  # inputs and targets split by example; no parameter is annotated (all B)


def build(n_in: int, hidden: int, layers: int, n_out: int, seed: int = 0) -> MLP:
    return MLP(n_in, hidden, layers, n_out, nnx.Rngs(seed))


class Teacher:
    """Batches (x, teacher(x)) for a random network of the student's shape."""

    def __init__(self, n_in: int, hidden: int, layers: int, n_out: int, seed: int = 1):
        self.net = build(n_in, hidden, layers, n_out, seed)
        self.n_in = n_in
        self.rng = np.random.default_rng(seed)

    def sample(self, n: int):
        x = self.rng.normal(size=(n, self.n_in)).astype(np.float32)
        return x, np.asarray(self.net(x))


def train(name, trainer, batches, log_every):
    print(f"{name}: {trainer.explain(batches[0]).summary()}")
    t0 = time.perf_counter()
    losses = []
    for i, batch in enumerate(batches):
        losses.append(trainer.step(batch))
        if i % log_every == 0 or i == len(batches) - 1:
            print(f"  step {i + 1:>5}/{len(batches)}  loss {losses[-1]:.5f}")
    print(f"  {len(batches) / (time.perf_counter() - t0):.0f} steps/s")
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--input-dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512, help="a multiple of the 8 devices (even ZeRO splits)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128, help="global batch; a multiple of the 8 devices")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bf16", action="store_true", help="also train ZeRO with bf16 compute")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="also train under memory_budget: this fraction of data parallel's state per device",
    )
    args = ap.parse_args(argv)

    shape = (args.input_dim, args.hidden, args.layers, args.input_dim)
    teacher = Teacher(*shape)
    batches = [teacher.sample(args.batch) for _ in range(args.steps)]
    pl = sj.placement(8, "data")
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(build(*shape), nnx.Param)))
    print(f"MLP {args.layers} hidden layers of {args.hidden}: {n_params} parameters, Adam; placement {pl!r}")

    runs = {"data parallel": {}, "ZeRO": {"zero": True}}
    if args.bf16:
        runs["ZeRO + bf16"] = {"zero": True, "compute_dtype": jnp.bfloat16}
    if args.budget is not None:
        runs[f"budget {args.budget:g}x"] = {"memory_budget": args.budget}
    losses, memory = {}, {}
    log_every = max(1, args.steps // 5)
    batch_share = sum(a.nbytes for a in batches[0]) // pl.size  # the batch is split by example
    for name, options in runs.items():
        if "memory_budget" in options:  # a fraction of data parallel's state, in bytes
            state = sum(memory["data parallel"].values())
            options = {"memory_budget": int(options["memory_budget"] * state) + batch_share}
            print(f"{name}: memory_budget={options['memory_budget']} B per device")
        trainer = sjf.Trainer(build(*shape), optax.adam(args.lr), loss_fn, pl, batch_sbp=BATCH_SBP, **options)
        memory[name] = trainer.state_bytes_per_device()
        losses[name] = train(name, trainer, batches, log_every)

    print("bytes per device (the most loaded device):")
    print(f"  {'':<15}{'parameters':>12}{'optimizer':>12}{'total':>12}{'vs data parallel':>18}")
    dp_total = sum(memory["data parallel"].values())
    for name, m in memory.items():
        total = m["params"] + m["opt_state"]
        print(f"  {name:<15}{m['params']:>12}{m['opt_state']:>12}{total:>12}{total / dp_total:>18.3f}")
    dp = np.asarray(losses["data parallel"])
    for name in runs:
        if name != "data parallel":
            diff = np.max(np.abs(np.asarray(losses[name]) - dp) / dp)
            print(
                f"losses, {name} vs data parallel: largest relative difference {diff:.1e} over {args.steps} steps"
            )
    print(f"loss: {dp[0]:.5f} -> {dp[-1]:.5f}")
    return losses, memory


if __name__ == "__main__":
    main()
