"""A nanoGPT pipelined without writing a stage: stages cut from the model, then one search
over the whole pipeline configuration.

    python examples/auto_pipeline.py                # about a minute on 8 CPU devices
    python examples/auto_pipeline.py --quick        # fewer steps
    python examples/auto_pipeline.py --budget 2e6   # a tighter memory budget per device

The model is a plain Flax NNX GPT (token and position embedding, a list of
transformer blocks, a final norm and the output head) with Megatron's layouts
written on its blocks for one tensor-parallel axis. Two ways to pipeline it:

1. ``sjp.cut``: the blocks are found in the model, the layers are balanced by
   XLA's flop counts with an exact dynamic program, and each of 2 stages runs
   on its own 4 devices with the blocks' own layouts. The first step is
   checked against the single-device step.
2. ``ss.search_pipeline``: the cost model is calibrated on these devices (seen
   as 2 nodes of 4), and
   one search picks the device groups, the schedule, the microbatch count,
   remat, the layouts inside each stage and the cut under a memory budget per
   device; ``plan.build`` makes the pipeline, which then trains until the loss
   falls. On CPU the 8 "devices" share the machine's cores, so the measured
   step is not the prediction; the point is that nothing was written by hand.
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
import sbpjax.pipeline as sjp  # noqa: E402
import sbpjax.search as ss  # noqa: E402
from sbpjax import S  # noqa: E402

TEXT = "stages are cut from the model and the search picks the rest of the pipeline. "
VOCAB = sorted(set(TEXT))
V = -(-len(VOCAB) // 8) * 8  # padded to a multiple of 8


def split_init(sbp):
    return sjf.with_sbp(nnx.initializers.lecun_normal(), sbp)


class Block(nnx.Module):
    """Pre-norm attention and MLP; Megatron's layout over a stage's ``tp`` axis:
    input projections split by columns, output projections by rows."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=split_init((S(1),)), rngs=rngs)
        self.out = nnx.Linear(d, d, kernel_init=split_init((S(0),)), rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=split_init((S(1),)), rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=split_init((S(0),)), rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads)
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9), axis=-1)
        x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NanoGPT(nnx.Module):
    def __init__(self, layers: int, d: int, heads: int, seq: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d)))
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def batch(rows: int, seq: int, seed: int):
    """Windows of the repeated sentence at random offsets: next-character prediction."""
    ids = np.array([VOCAB.index(c) for c in TEXT * 4], np.int32)
    starts = np.random.default_rng(seed).integers(0, len(TEXT), size=rows)
    windows = np.stack([ids[s : s + seq + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def largest_gradient_error(model, tokens, labels, grads) -> float:
    """The pipeline's gradients (in the model's own tree) against one jitted
    value_and_grad of the whole model on one device."""
    want = nnx.to_pure_dict(nnx.jit(nnx.grad(lambda m: cross_entropy(m(tokens), labels)))(model))
    return max(
        float(np.max(np.abs(g - np.asarray(w))))
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want))
    )


def cut_from_the_model(model, tokens, labels):
    """Part 1: 2 stages x 4-way tensor parallel, cut by the flop counts."""
    pl = sj.placement((2, 4), ("pp", "tp"))
    c = sjp.cut(model, pl, axis="pp", sample=tokens)
    print(f"1. sjp.cut: {len(c.chain)} layers ({', '.join(l.name for l in c.chain.layers)}) into 2 stages")
    print(c)
    pipe = sjp.Pipeline(c.stages, cross_entropy, optax.adam(3e-3), microbatches=4)
    r = pipe.step(tokens, labels)
    want = float(nnx.jit(lambda m: cross_entropy(m(tokens), labels))(model))
    err = largest_gradient_error(model, tokens, labels, c.model_params(r.grads))
    assert abs(r.loss - want) < 1e-5 * max(1.0, abs(want)) and err < 1e-4, (r.loss, want, err)
    print(
        f"   first step equals the single-device step: loss {r.loss:.5f}, largest gradient difference {err:.1e}"
    )
    return c.chain


def searched(chain, args, rows: int):
    """Part 2: the whole configuration searched on a calibrated cost model."""
    pl = sj.placement((2, 4), ("node", "gpu"))
    t0 = time.perf_counter()
    cost_model = ss.calibrate_transfer(sj.calibrate(pl, sizes=(1 << 12, 1 << 18), repeats=3), pl)
    # each axis whole (refine=False): a layer's devices along an axis take one role
    # (data, column or row parallel), which keeps every stage's program small to compile
    grid = ss.Grid.from_placement(pl, cost_model=cost_model, refine=False)
    compute = ss.calibrate_compute(pl)
    print(
        f"\n2. calibrated in {time.perf_counter() - t0:.1f}s: {compute.flops_per_s / 1e9:.1f} GFLOP/s per device, "
        f"{compute.action_s * 1e6:.0f} us per action, collectives {cost_model.axis_beta('gpu'):.2e} s/byte, "
        f"transfers {cost_model.transfer_alpha * 1e6:.0f} us + {cost_model.transfer_beta:.2e} s/byte"
    )
    plan = ss.search_pipeline(chain, grid, batch=rows, memory=args.budget, compute=compute)
    print(plan)
    pipe = plan.build(chain, cross_entropy, optax.adam(3e-3), placement=pl)
    first = None
    times = []
    for step in range(args.steps):
        tokens, labels = batch(rows, args.seq, seed=100 + step)
        t0 = time.perf_counter()
        r = pipe.step(tokens, labels)
        times.append(time.perf_counter() - t0)
        first = r.loss if first is None else first
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"   step {step:3d}: loss {r.loss:.4f}")
    assert r.loss < first, "the loss should fall"
    print(
        f"   measured {np.median(times[1:]) * 1e3:.1f} ms per step (median after the first, which compiles), "
        f"predicted {plan.step_s * 1e3:.1f} ms; memory predicted {plan.peak_memory / 1e6:.2f} MB per device"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; --quick: 2)")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--rows", type=int, default=16, help="sequences per step")
    ap.add_argument("--budget", type=float, default=4e6, help="bytes per device")
    args = ap.parse_args()
    args.steps = args.steps or (4 if args.quick else 20)
    args.layers = args.layers or (2 if args.quick else 4)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8")
    model = NanoGPT(args.layers, args.d_model, args.heads, args.seq, nnx.Rngs(0))
    tokens, labels = batch(args.rows, args.seq, seed=0)
    chain = cut_from_the_model(model, tokens, labels)
    searched(chain, args, args.rows)


if __name__ == "__main__":
    main()
