"""A GPT-2-style model trained on 8 devices with a data x tensor (2x4) layout.

    python examples/gpt_hybrid.py                  # about a minute on 8 CPU devices
    python examples/gpt_hybrid.py --steps 2000 --layers 6 --d-model 256 --heads 8 --seq 128   # bigger

The model is written as for one device (Flax NNX). A handful of annotations say
how the parameters are laid out: Megatron's column then row split of every
attention and MLP pair over the tensor axis ``y``, the token embedding split by
vocabulary, the output head split by classes (so the softmax cross-entropy is
model-parallel and the logits are never gathered). The batch is split over
the data axis ``x``. ``sj.jit`` infers every other layout, inserts the
collectives, and compiles the whole train step (forward, backward, AdamW) into
one ``shard_map``. The text is the Python standard library's own
documentation, so it runs offline; the model learns it character by
character.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sbpjax as sj  # noqa: E402
import sbpjax.flax as sjf  # noqa: E402
from sbpjax import B, S  # noqa: E402

# -- data ------------------------------------------------------------------------

_MODULES = [
    "collections",
    "functools",
    "itertools",
    "json",
    "pathlib",
    "re",
    "string",
    "textwrap",
    "argparse",
    "logging",
    "unittest",
    "typing",
    "dataclasses",
    "heapq",
    "bisect",
    "random",
]


def load_text() -> str:
    """The docstrings of some standard library modules: English text that
    every Python installation has."""
    import importlib
    import inspect

    parts = []
    for name in _MODULES:
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, n) for n in sorted(dir(mod)) if not n.startswith("_")]:
            doc = (
                inspect.getdoc(obj)
                if (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj))
                else None
            )
            if doc and len(doc) > 80:
                parts.append(doc)
    text = "\n\n".join(dict.fromkeys(parts))  # drop repeats, keep the order
    return "".join(c for c in text if c.isascii())


class CharData:
    """Character-level batches of ``seq`` tokens with next-token labels."""

    def __init__(self, text: str, seq: int, batch: int, seed: int = 0):
        self.chars = sorted(set(text))
        self.ids = np.array([self.chars.index(c) for c in text], np.int32)
        self.seq, self.batch = seq, batch
        self.rng = np.random.default_rng(seed)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def next(self):
        start = self.rng.integers(0, len(self.ids) - self.seq - 1, size=self.batch)
        idx = start[:, None] + np.arange(self.seq + 1)[None, :]
        tok = self.ids[idx]
        return tok[:, :-1], tok[:, 1:]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


# -- model -----------------------------------------------------------------------


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        # separate q, k, v projections: a column split of each keeps whole heads
        # on one device (a fused qkv matrix split by columns would mix q, k and v)
        self.q, self.k, self.v = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (m(x).reshape(b, t, h, d // h) for m in (self.q, self.k, self.v))
        att = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
        y = jnp.einsum("bhqk,bkhc->bqhc", att, v).reshape(b, t, d)
        return self.proj(y)


class MLP(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = Attention(d, heads, rngs)
        self.mlp = MLP(d, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int, rngs: nnx.Rngs):
        self.wte = nnx.Embed(vocab, d, rngs=rngs)
        self.wpe = nnx.Embed(seq, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, batch):
    tokens, labels = batch
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Megatron over the tensor axis y (the second placement axis); the data axis x
# keeps parameters whole (B). Column-split layers cut their output features,
# row-split ones their input features, whose partial sums one all-reduce joins.
HYBRID_RULES = {
    "blocks.*.attn.[qkv].kernel": (B, S(1)),
    "blocks.*.attn.[qkv].bias": (B, S(0)),
    "blocks.*.attn.proj.kernel": (B, S(0)),
    "blocks.*.mlp.fc1.kernel": (B, S(1)),
    "blocks.*.mlp.fc1.bias": (B, S(0)),
    "blocks.*.mlp.fc2.kernel": (B, S(0)),
    "wte.embedding": (B, S(0)),  # split by vocabulary: the lookup gives partial sums
    "head.kernel": (B, S(1)),  # split by classes: a model-parallel softmax
}
BATCH_SBP = (S(0), B)  # tokens and labels split by batch over x


def build(vocab: int, seq: int, d: int, heads: int, layers: int, seed: int = 0) -> GPT:
    # The vocabulary is split 4 ways (embedding rows, head columns) and sj.jit
    # needs even splits: pad it to a multiple of 8, as nanoGPT pads GPT-2's
    # 50257 to 50304. The padding classes never occur in the labels.
    return GPT(-(-vocab // 8) * 8, seq, d, heads, layers, nnx.Rngs(seed))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--zero", action="store_true", help="ZeRO: optimizer state split over the data axis")
    ap.add_argument("--show-plan", action="store_true", help="print the full per-op plan table")
    args = ap.parse_args(argv)

    data = CharData(load_text(), args.seq, args.batch)
    pl = sj.placement((2, 4), ("x", "y"))
    print(f"text: {len(data.ids)} characters, vocabulary {data.vocab}; placement {pl!r}")
    model = build(data.vocab, args.seq, args.d_model, args.heads, args.layers)
    sjf.annotate(model, HYBRID_RULES)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {n_params} parameters")

    trainer = sjf.Trainer(
        model, optax.adamw(args.lr, weight_decay=0.01), loss_fn, pl, batch_sbp=BATCH_SBP, zero=args.zero
    )
    explanation = trainer.explain(data.next())
    print(explanation.summary())
    if args.show_plan:
        print(explanation)

    losses = []
    # tqdm's disable=None: a bar on a terminal, nothing when the output is a pipe or a log
    with tqdm(range(args.steps), desc="train", unit="step", disable=None, file=sys.stdout) as bar:
        for i in bar:
            losses.append(trainer.step(data.next()))
            if i % 10 == 0 or i == args.steps - 1:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
    k = max(1, min(20, args.steps // 5))
    print(
        f"loss: first {k} steps {np.mean(losses[:k]):.3f} -> last {k} steps {np.mean(losses[-k:]):.3f} "
        f"(uniform guess: {np.log(data.vocab):.3f})"
    )
    return losses


if __name__ == "__main__":
    main()
