"""Write the notebooks in this folder from the cells below.

    python notebooks/build.py             # sources only
    python notebooks/build.py --execute   # run them and keep the outputs (pictures included)

The notebooks are kept as plain cell lists here so a change reads as a Python
diff; the tests check the .ipynb files match and execute them
(tests/test_notebooks.py).
"""

import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = """%matplotlib inline
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 CPU devices on a laptop
import numpy as np
import jax, jax.numpy as jnp
import sbpjax as sj
from sbpjax import S, B, P
print(jax.devices())"""

BASICS = [
    (
        "md",
        """# SBP basics

A **global tensor** is a logical tensor laid out over a **placement** (a grid of
devices) by an **nd-SBP**: one of Split(dim) / Broadcast / Partial-value per
placement axis. This notebook builds a few, draws what each device holds, boxes
between layouts and reads what the boxing costs.""",
    ),
    ("code", SETUP),
    (
        "md",
        "## A placement and a split tensor\n`S(0)` over an axis splits dim 0 in balanced pieces, in device order.",
    ),
    (
        "code",
        """pl = sj.placement((2, 4), ("x", "y"))
x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
t = sj.to_global(x, pl, (S(0), S(1)))
print(t)
sj.show(t)""",
    ),
    (
        "md",
        "Nested splits: `(S(0), S(0))` splits dim 0 over `x`, then each half over `y`. Uneven sizes give the first pieces one more row.",
    ),
    (
        "code",
        """sj.show(sj.to_global(np.arange(10 * 4, dtype=np.float32).reshape(10, 4), pl, (S(0), S(0))))""",
    ),
    (
        "md",
        "## Partial values\nWith `P` every device holds a term; the logical tensor is their sum. Pictures hatch partial terms.",
    ),
    (
        "code",
        """u = t.to_global(sbp=(P, B))
print(u.local_tensors()[0, 0][:2], "...")
assert np.array_equal(u.numpy(), x)
fig = sj.show(u, kind="figure")
fig""",
    ),
    (
        "md",
        "## Boxing and its cost\nEvery conversion is planned over the cheapest sequence of collectives; the bytes follow OneFlow's Table 2 (bytes received, summed over devices).",
    ),
    (
        "code",
        """for src, dst in [((S(0), S(1)), (B, B)), ((S(0), S(1)), (S(1), S(0))), ((P, B), (S(0), B))]:
    plan = sj.plan_boxing(x.shape, x.dtype, pl, src, dst)
    print(plan, end="\\n\\n")""",
    ),
    (
        "md",
        "## Checking a plan against XLA\nThe compiled program's collectives are read back and their bytes compared with the plan.",
    ),
    (
        "code",
        """from sbpjax.boxing.lower import boxing_fn
plan = sj.plan_boxing(x.shape, x.dtype, pl, (S(0), S(1)), (B, B))
compiled = boxing_fn(plan).lower(t.physical).compile()
measured = sum(c.bytes for c in sj.collectives(compiled))
print(sj.collectives(compiled))
assert measured == plan.bytes, (measured, plan.bytes)""",
    ),
    (
        "md",
        "## A whole program: `sj.jit`\nA matmul chain `U @ V @ W` with U S(1), V S(0), W B keeps the partial sum between the products: one all-reduce at the end.",
    ),
    (
        "code",
        """pl8 = sj.placement(8, "x")
rng = np.random.default_rng(0)
U, V, W = (rng.normal(size=(64, 64)).astype(np.float32) for _ in range(3))
f = sj.jit(lambda u, v, w: u @ v @ w, placement=pl8, in_sbp=((S(1),), (S(0),), (B,)), out_sbp=(B,))
y = f(U, V, W)
np.testing.assert_allclose(y.numpy(), U @ V @ W, rtol=1e-4, atol=1e-3)
print(f.explain(U, V, W))""",
    ),
]

HYBRID = [
    (
        "md",
        """# Hybrid parallel training of a Flax model

A GPT-style model from `examples/gpt_hybrid.py`, annotated with Megatron's
column/row splits over the tensor axis `y`, trained with the batch split over
the data axis `x` of a 2x4 placement. `sj.jit` infers every other layout.""",
    ),
    (
        "code",
        SETUP
        + """
import sys, optax
from flax import nnx
import sbpjax.flax as sjf
sys.path.insert(0, os.path.abspath("../examples"))
import gpt_hybrid as gpt""",
    ),
    (
        "md",
        "## The annotations\nPath patterns set the `sbp` metadata of parameters; everything unannotated is B.",
    ),
    ("code", """gpt.HYBRID_RULES"""),
    (
        "code",
        """data = gpt.CharData(gpt.load_text(), seq=32, batch=16)
model = gpt.build(data.vocab, seq=32, d=64, heads=4, layers=2)
sjf.annotate(model, gpt.HYBRID_RULES)
pl = sj.placement((2, 4), ("x", "y"))
sjf.get_sbp(model, pl)["blocks"][0]["mlp"]""",
    ),
    (
        "md",
        "## What each device holds\nThe first MLP's weight is split by columns over `y` and whole over `x`.",
    ),
    (
        "code",
        """sjf.place(model, pl)
kernel = model.blocks[0].mlp.fc1.kernel.get_value()
sj.show(kernel)
fig = sj.show(kernel, kind="figure")
fig""",
    ),
    ("code", """sjf.unplace(model)  # back to plain arrays; the Trainer places it again"""),
    (
        "md",
        "## The plan of one train step\nForward, backward and AdamW compile into one `shard_map`; the summary lists its collectives.",
    ),
    (
        "code",
        """trainer = sjf.Trainer(model, optax.adamw(3e-3), gpt.loss_fn, pl, batch_sbp=gpt.BATCH_SBP)
print(trainer.explain(data.next()).summary())""",
    ),
    ("md", "## Train"),
    (
        "code",
        """losses = [trainer.step(data.next()) for _ in range(40)]
print(f"loss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f}")
assert np.mean(losses[-5:]) < losses[0]""",
    ),
    (
        "code",
        """import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(losses)
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.set_title("GPT on 2x4 (data x tensor)");""",
    ),
    (
        "md",
        "## ZeRO\nThe same training with the optimizer state and master weights split over the data axis: each device holds 1/2 of what data parallelism over `x` alone holds for the B parameters.",
    ),
    (
        "code",
        """zero = sjf.Trainer(gpt.build(data.vocab, 32, 64, 4, 2), optax.adamw(3e-3), gpt.loss_fn, pl,
                   batch_sbp=gpt.BATCH_SBP, zero=True)
dp = sjf.Trainer(gpt.build(data.vocab, 32, 64, 4, 2), optax.adamw(3e-3), gpt.loss_fn, pl, batch_sbp=gpt.BATCH_SBP)
print("ZeRO", zero.state_bytes_per_device(), "\\nplain", dp.state_bytes_per_device())""",
    ),
]


def notebook(cells):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
        for kind, src in cells
    ]
    return nb


def execute(nb):
    """Run ``nb`` in a fresh kernel that sees 8 CPU devices; returns it with outputs."""
    from nbclient import NotebookClient

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # inherited by the kernel
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    return nb


NOTEBOOKS = {"01_sbp_basics.ipynb": BASICS, "02_flax_hybrid_parallel.ipynb": HYBRID}

if __name__ == "__main__":
    for name, cells in NOTEBOOKS.items():
        nb = notebook(cells)
        if "--execute" in sys.argv:
            nb = execute(nb)
        nbformat.write(nb, os.path.join(HERE, name))
