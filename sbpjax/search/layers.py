"""What the search lays out: a chain of matmuls ``Y = X W``, one per weight.

Every layer kind becomes one or more :class:`MatmulOp` (AutoDDL 4.2: a layer is a
chain of computations and SBP redistributions): a dense layer is one; an
embedding is a matmul of one-hot tokens with the table (its input is the data,
so it costs no redistribution); attention is the fused Q/K/V projection and the
output projection, with the core (softmax over keys) in between, which needs
whole heads and whole sequences on each device; a convolution is its im2col
matmul whose data split may only cut the batch. Each op's output feeds the next
op of the list, after an elementwise function (activation, residual) that keeps
the layout. Layers are given as a list, built with :func:`transformer`,
:func:`mlp` and :func:`repeat`, or found by tracing a program with
:func:`from_program`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from sbpjax._errors import SBPError


@dataclasses.dataclass(frozen=True)
class MatmulOp:
    """``Y[m, n] = X[m, k] @ W[k, n]``.

    ``tie``: ops with the same tie share one choice (AutoDDL 4.5.1, repeated
    layers); ``param``: the parameter path of ``W`` (for annotation rules);
    ``batch``: the data split of ``m`` may only cut whole groups of ``m / batch``
    rows (sequences, images); ``heads``: the output's feature split must keep
    whole heads; ``edge_n``: features of the tensor handed to the next op when it
    is not ``n`` (the attention core turns Q/K/V, ``3h``, into ``h``);
    ``from_data``: the input is the program's data (no redistribution before it);
    ``itemsize``: bytes per element.
    """

    name: str
    m: int
    k: int
    n: int
    itemsize: int = 4
    tie: str | None = None
    param: str | None = None
    batch: int | None = None
    heads: int | None = None
    edge_n: int | None = None
    from_data: bool = False

    def __post_init__(self):
        for f in ("m", "k", "n"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise SBPError(f"MatmulOp {self.name!r}: {f} must be a positive int, got {v!r}.")

    @property
    def key(self) -> str:
        """The choice this op shares with its ties."""
        return self.tie or self.name

    @property
    def x_elems(self) -> int:
        return self.m * self.k

    @property
    def w_elems(self) -> int:
        return self.k * self.n

    @property
    def y_elems(self) -> int:
        return self.m * self.n

    @property
    def edge_elems(self) -> int:
        """Elements of the tensor that goes to the next op."""
        return self.m * (self.edge_n or self.n)

    def fits(self, p0: int, p1: int, p2: int) -> bool:
        """Every split divides its dim (balanced splits would be uneven otherwise)."""
        if self.m % p0 or self.k % p2 or self.n % p1:
            return False
        if self.batch is not None and self.batch % p0:
            return False
        return not (self.heads is not None and self.heads % p1)

    def out_fits(self, dim: int, p0: int, p1: int, p2: int) -> bool:
        """The output split with the row partials scattered onto ``dim`` divides evenly
        (and keeps whole sequences / heads where the next computation needs them)."""
        if dim == 0:
            return self.m % (p0 * p2) == 0 and (self.batch is None or self.batch % (p0 * p2) == 0)
        n = self.edge_n or self.n
        return n % (p1 * p2) == 0 and (self.heads is None or self.heads % (p1 * p2) == 0)


def dense(
    name: str,
    tokens: int,
    d_in: int,
    d_out: int,
    *,
    itemsize: int = 4,
    tie: str | None = None,
    param: str | None = None,
    from_data: bool = False,
) -> list[MatmulOp]:
    """A dense layer on ``tokens`` rows."""
    return [MatmulOp(name, tokens, d_in, d_out, itemsize, tie, param or name, from_data=from_data)]


def embedding(
    name: str, tokens: int, vocab: int, d_model: int, *, itemsize: int = 4, tie: str | None = None
) -> list[MatmulOp]:
    """A table lookup: a matmul of one-hot tokens with the ``vocab x d_model`` table;
    a vocabulary split (row role) gives partial sums."""
    return [MatmulOp(name, tokens, vocab, d_model, itemsize, tie, name, from_data=True)]


def attention(
    name: str, batch: int, seq: int, d_model: int, heads: int, *, itemsize: int = 4, tie: str | None = None
) -> list[MatmulOp]:
    """Self-attention: fused Q/K/V projection (``d -> 3d``), the core, output projection."""
    if d_model % heads:
        raise SBPError(f"attention {name!r}: d_model {d_model} is not a multiple of heads {heads}.")
    t = f"{tie}." if tie else None
    return [
        MatmulOp(
            f"{name}.qkv",
            batch * seq,
            d_model,
            3 * d_model,
            itemsize,
            t and t + "qkv",
            f"{name}.qkv",
            batch=batch,
            heads=heads,
            edge_n=d_model,
        ),
        MatmulOp(
            f"{name}.out",
            batch * seq,
            d_model,
            d_model,
            itemsize,
            t and t + "out",
            f"{name}.out",
            batch=batch,
        ),
    ]


def mlp(
    name: str, tokens: int, dims: Sequence[int], *, itemsize: int = 4, tie: str | None = None
) -> list[MatmulOp]:
    """Dense layers ``dims[0] -> dims[1] -> ...`` (AutoDDL's MLP: 32768, 16384, 4096, 2048, 512)."""
    if len(dims) < 2:
        raise SBPError(f"mlp {name!r}: give at least two dims (input and output), got {list(dims)}.")
    t = f"{tie}." if tie else None
    return [
        op
        for i in range(len(dims) - 1)
        for op in dense(
            f"{name}.{i}",
            tokens,
            dims[i],
            dims[i + 1],
            itemsize=itemsize,
            tie=t and f"{t}{i}",
            from_data=(i == 0),
        )
    ]


def conv(
    name: str,
    batch: int,
    height: int,
    width: int,
    c_in: int,
    c_out: int,
    kernel: int = 3,
    *,
    itemsize: int = 4,
    tie: str | None = None,
) -> list[MatmulOp]:
    """A 'same' convolution as its im2col matmul: rows are pixels (the data split cuts
    the batch only), the row role splits input channels x taps, the column role
    output channels."""
    return [
        MatmulOp(
            name, batch * height * width, c_in * kernel * kernel, c_out, itemsize, tie, name, batch=batch
        )
    ]


def transformer(
    name: str,
    batch: int,
    seq: int,
    d_model: int,
    heads: int,
    *,
    ffn: int = 4,
    itemsize: int = 4,
    tie: str | None = None,
) -> list[MatmulOp]:
    """One transformer layer: attention then a ``d -> ffn*d -> d`` MLP (layer norms
    and residual adds are elementwise on the residual stream and move nothing here)."""
    t = f"{tie}." if tie else None
    return (
        attention(f"{name}.attn", batch, seq, d_model, heads, itemsize=itemsize, tie=t and t + "attn")
        + dense(
            f"{name}.mlp.up", batch * seq, d_model, ffn * d_model, itemsize=itemsize, tie=t and t + "mlp.up"
        )
        + dense(
            f"{name}.mlp.down",
            batch * seq,
            ffn * d_model,
            d_model,
            itemsize=itemsize,
            tie=t and t + "mlp.down",
        )
    )


def repeat(make, n: int, prefix: str = "layers", tied: bool = True) -> list[MatmulOp]:
    """``n`` copies of ``make(name, tie)`` named ``prefix.0 ... prefix.{n-1}``; with
    ``tied`` all copies share their choices (AutoDDL 4.5.1)."""
    ops = []
    for i in range(n):
        ops += make(f"{prefix}.{i}", f"{prefix}.*" if tied else None)
    return ops


def gpt(
    n_layers: int, d_model: int, heads: int, batch: int, seq: int, vocab: int, *, itemsize: int = 2
) -> list[MatmulOp]:
    """A GPT: token embedding, ``n_layers`` tied transformer layers, the output head."""
    return (
        embedding("embed", batch * seq, vocab, d_model, itemsize=itemsize)
        + repeat(
            lambda nm, t: transformer(nm, batch, seq, d_model, heads, itemsize=itemsize, tie=t), n_layers
        )
        + dense("head", batch * seq, d_model, vocab, itemsize=itemsize)
    )


def from_program(fn, params, *args) -> list[MatmulOp]:
    """The matmuls of ``fn(params, *args)`` that multiply an activation by a 2-D
    parameter, in program order, each named by its parameter's path.

    Trace the forward function (or the loss), not a train step: gradients are
    the search's business. ``params`` may hold arrays or ``jax.ShapeDtypeStruct``.
    """
    import jax

    from sbpjax.compiler.trace import trace

    leaves, in_tree = jax.tree_util.tree_flatten(((params, *args), {}))
    avals = [
        jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        for x in leaves
    ]
    program = trace(fn, avals, in_tree)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    param_of = {id(v): paths[i] for i, v in enumerate(program.inputs[: len(paths)])}
    ops: list[MatmulOp] = []
    for node in program.nodes:
        if node.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = node.eqn.params["dimension_numbers"]
        x, w = node.ins
        if id(w) not in param_of or len(w.shape) != 2 or lb or rb:
            continue
        if tuple(rc) != (0,) or tuple(lc) != (len(x.shape) - 1,):
            raise SBPError(
                f"search.from_program: {node.source}: the product with parameter {param_of[id(w)]} "
                f"contracts dims {tuple(lc)} x {tuple(rc)}; the search models x @ w with x's last "
                "dim against w's first. Write it as x @ w, or list the layers by hand."
            )
        m = math.prod(x.shape[:-1])
        path = param_of[id(w)]
        ops.append(
            MatmulOp(
                path,
                m,
                int(w.shape[0]),
                int(w.shape[1]),
                np.dtype(w.dtype).itemsize,
                param=path,
                from_data=not ops and id(x) in {id(v) for v in program.inputs},
            )
        )
    if not ops:
        raise SBPError(
            "search.from_program: found no matmul of an activation with a 2-D parameter in the "
            "program; pass the parameters as the first argument, or list the layers by hand "
            "(sbpjax.search.dense / mlp / transformer)."
        )
    return ops
