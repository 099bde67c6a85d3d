"""A small GPT trained with pipeline parallelism: 4 stages x 2-way tensor parallel on 8 devices.

    python examples/pipeline_gpt.py                 # 40 steps, 1F1B, 8 microbatches
    python examples/pipeline_gpt.py --quick         # 6 steps
    python examples/pipeline_gpt.py --schedule gpipe --png gpt_gpipe.png
    python examples/pipeline_gpt.py --schedule zb-h1   # zero bubble: each backward split into B and W

Each stage is one transformer block (the first also embeds, the last also
projects to the vocabulary) on its own pair of devices, laid out Megatron-style
with SBP: attention and MLP input weights S(1), output weights S(0), so the
stage's program (compiled by sj.jit) ends each half with a partial sum. The
actor runtime moves activations and gradients between the pairs; its loader
actor prepares microbatch k + 1 while stage 0 works on k.

The script checks the first step against the non-pipelined step (one jitted
value_and_grad on the whole batch, whole model on one device), trains on a
repeated sentence until the loss falls, prints the timeline summary, compares
the memory GPipe, 1F1B and ZB-H1 hold between actions (residuals, and what
ZB-H1's B keeps for its W) with the same stages, and writes the Gantt chart PNG.
Runs on a laptop: 8 simulated CPU devices.
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.pipeline as sjp  # noqa: E402

TEXT = "the actors pass registers down the pipeline and the acks come back up. "
VOCAB = sorted(set(TEXT))
V = -(-len(VOCAB) // 8) * 8  # padded so the head's S(1) splits evenly over the 2 devices
D, HEADS, T = 32, 4, 16


def layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g


def block(p, x):
    b, t, _ = x.shape
    h = layernorm(x, p["g1"])
    q, k, v = ((h @ p[w]).reshape(b, t, HEADS, D // HEADS) for w in ("wq", "wk", "wv"))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
    att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, D) @ p["wo"]
    return x + jax.nn.gelu(layernorm(x, p["g2"]) @ p["w1"]) @ p["w2"]


def first_stage(p, tokens):
    return block(p["block"], p["emb"][tokens] + p["pos"])


def last_stage(p, x):
    return layernorm(block(p["block"], x), p["g"]) @ p["head"]


def cross_entropy(logits, labels):
    lp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(lp, labels[..., None], axis=-1))


STAGE_FNS = [first_stage, block, block, last_stage]

# Megatron's tensor-parallel layout, written as SBP over the stage's "tp" axis
BLOCK_SBP = {
    "wq": sj.S(1),
    "wk": sj.S(1),
    "wv": sj.S(1),
    "wo": sj.S(0),
    "w1": sj.S(1),
    "w2": sj.S(0),
    "g1": sj.B,
    "g2": sj.B,
}
STAGE_SBP = [
    {"block": BLOCK_SBP, "emb": sj.B, "pos": sj.B},
    BLOCK_SBP,
    BLOCK_SBP,
    {"block": BLOCK_SBP, "g": sj.B, "head": sj.S(1)},
]


def init_params(seed=0):
    r = np.random.default_rng(seed)

    def w(*shape):
        return (r.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)

    def blk():
        return {
            "wq": w(D, D),
            "wk": w(D, D),
            "wv": w(D, D),
            "wo": w(D, D) / 2,
            "w1": w(D, 4 * D),
            "w2": w(4 * D, D) / 2,
            "g1": np.ones(D, np.float32),
            "g2": np.ones(D, np.float32),
        }

    return [
        {"block": blk(), "emb": w(V, D), "pos": (0.1 * r.normal(size=(T, D))).astype(np.float32)},
        blk(),
        blk(),
        {"block": blk(), "g": np.ones(D, np.float32), "head": w(D, V)},
    ]


def batch(rows, seed):
    """Windows of the repeated sentence at random offsets: next-character prediction."""
    ids = np.array([VOCAB.index(c) for c in TEXT * 4], np.int32)
    starts = np.random.default_rng(seed).integers(0, len(TEXT), size=rows)
    windows = np.stack([ids[s : s + T + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def reference_step(params, tokens, labels):
    """The non-pipelined step: the whole model, one jitted value_and_grad on the whole batch."""

    def loss(ps):
        h = tokens
        for f, p in zip(STAGE_FNS, ps):
            h = f(p, h)
        return cross_entropy(h, labels)

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), grads


def build(schedule, microbatches, params, opt, load_delay):
    devices = jax.devices()
    if len(devices) < 8:
        raise SystemExit("needs 8 devices; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8")
    stages = [
        sjp.Stage(
            fn,
            p,
            sj.Placement(np.array(devices[2 * i : 2 * i + 2]), ("tp",)),
            param_sbp=sbp,
            name=f"stage{i}",
        )
        for i, (fn, p, sbp) in enumerate(zip(STAGE_FNS, params, STAGE_SBP))
    ]

    def slow_loader(delay):  # a loader with some per-microbatch work, as tokenisation would be
        def before(spec, k):
            if spec.kind == "load":
                time.sleep(delay)

        return before

    return sjp.Pipeline(
        stages,
        cross_entropy,
        opt,
        microbatches=microbatches,
        schedule=schedule,
        before_action=slow_loader(load_delay) if load_delay else None,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zb-h1", "zb-h2"])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4, help="sequences per microbatch")
    ap.add_argument("--png", default="pipeline_gpt_timeline.png")
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 40)
    m = args.microbatches
    opt = optax.adam(3e-3)
    params = init_params()

    pipe = build(args.schedule, m, params, opt, load_delay=0.001)
    print(
        f"{len(pipe.stages)} stages x 2-way tensor parallel, schedule {args.schedule}, {m} microbatches "
        f"of {args.rows} sequences of {T} tokens"
    )
    for st in pipe.stages:
        print(f"  {st.name}: {st.placement!r}")

    tokens, labels = batch(m * args.rows, seed=0)
    want_loss, want_grads = reference_step(params, tokens, labels)
    t0 = time.perf_counter()
    first = pipe.step(tokens, labels)
    print(f"step 0 (compiles every stage): {time.perf_counter() - t0:.1f}s, loss {first.loss:.5f}")
    worst = max(
        float(np.max(np.abs(np.asarray(g.numpy()) - w)))
        for gs, ws in zip(first.grads, want_grads)
        for g, w in zip(
            jax.tree_util.tree_leaves(gs, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)),
            jax.tree_util.tree_leaves(ws),
        )
    )
    assert abs(first.loss - want_loss) < 1e-5 * max(1.0, abs(want_loss)), (first.loss, want_loss)
    assert worst < 1e-4, worst
    print(f"  equals the non-pipelined step: loss {want_loss:.5f}, largest gradient difference {worst:.2e}")

    t0 = time.perf_counter()
    for step in range(1, steps):
        result = pipe.step(*batch(m * args.rows, seed=step))
        if step % max(1, steps // 8) == 0 or step == steps - 1:
            print(f"step {step:3d}: loss {result.loss:.4f}")
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    assert result.loss < first.loss, "the loss should fall"
    tl = result.timeline
    print(f"\n{per_step * 1e3:.1f} ms per step; last step's {tl}")
    print(
        f"runtime overhead {1e6 * tl.overhead_per_action_s:.1f} us per action "
        f"(mean action {1e3 * sum(a.duration for a in tl.actions) / len(tl.actions):.2f} ms)"
    )
    load = [a for a in tl.actions if a.kind == "load" and a.actor == "load:inputs"]
    fwd0 = [a for a in tl.actions if a.actor == "forward0"]
    overlaps = sum(any(lo.start < f.end and f.start < lo.end for f in fwd0) for lo in load)
    print(f"loader overlapped stage 0's forward on {overlaps} of {len(load)} microbatches")

    # memory: the same stages (their programs are reused) under GPipe, 1F1B and ZB-H1
    for name in ("gpipe", "1f1b", "zb-h1"):
        if name == args.schedule:
            t = tl
        else:  # one step more (it trains the same stages)
            t = (
                sjp.Pipeline(pipe.stages, cross_entropy, opt, microbatches=m, schedule=name)
                .step(tokens, labels)
                .timeline
            )
        peaks = t.peak_live_activations()
        kept = t.peak_kept_bytes()
        print(
            f"{name:>6}: peak live activation registers per stage {[peaks[i] for i in range(4)]}, "
            f"bytes {[t.peak_activation_bytes()[i] for i in range(4)]}"
            + (f", bytes kept for W {[kept[i] for i in range(4)]}" if kept else "")
        )
    sim = pipe.simulate({"forward": 1.0, "backward": 2.0})
    p = len(pipe.stages)
    if args.schedule.startswith("zb"):
        print(
            f"simulated with F=B=W=1: makespan {sim.makespan:g} = m(F + B + W) + (p - 1)F = {3 * m + p - 1:g} "
            f"(1F1B: {3 * (m + p - 1)}), bubble {sim.bubble:.3f}"
        )
    else:
        print(
            f"simulated with F=1, B=2: makespan {sim.makespan:g} = (m + p - 1)(F + B) = {(m + p - 1) * 3:g}, "
            f"bubble {sim.bubble:.3f}"
        )
    print(f"timeline written to {tl.gantt(args.png, title=f'pipeline_gpt: {args.schedule}, m={m}')}")


if __name__ == "__main__":
    main()
