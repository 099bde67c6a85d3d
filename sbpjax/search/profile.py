"""What the pipeline search knows of each layer: its flops, its matmuls, its
parameters and the bytes it hands on.

    profiles = ss.profile(chain)                                   # a sbpjax.pipeline.LayerChain
    profiles = ss.gpt_profiles(64, d_model=4096, heads=32, seq=2048, vocab=50304, examples=8)

A :class:`LayerProfile` is measured on ``examples`` examples and scales
linearly with them (:meth:`LayerProfile.at`): flops, bytes and the rows of every
matmul. From a real chain the flops are XLA's count of the compiled forward and
backward (machine independent), the matmuls are those of the layer's program
that multiply an activation by a 2-D parameter (:func:`sbpjax.search.from_program`;
their layouts are what the search chooses), and the bytes are the layer's
input and output.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.search.layers import MatmulOp, from_program, transformer


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer of a chain, on ``examples`` examples.

    ``flops``: (forward, backward) of the whole layer; ``ops``: its matmuls with a
    parameter (names unique in the chain; ``param`` is the parameter's path in
    the layer's own tree); ``param_elems``: every parameter element (those not
    in ``ops``, e.g. norms and embedding tables, stay replicated); ``in_bytes``
    / ``out_bytes``: the layer's input and output (logical); ``saved_bytes``:
    what one microbatch of the layer holds from its forward for its backward
    (its input and JAX's residuals: a layernorm's statistics, a GELU's input,
    as the pipeline's stash counts them; logical; None where not traced, as in
    :func:`gpt_profiles`); ``tie``: layers with the same tie are alike and
    share their layouts."""

    name: str
    examples: int
    flops: tuple[float, float]
    ops: tuple[MatmulOp, ...]
    param_elems: int
    in_bytes: float
    out_bytes: float
    tie: str | None = None
    saved_bytes: float | None = None

    def at(self, examples: int) -> LayerProfile:
        """The same layer on ``examples`` examples (raises :class:`SBPError` when a
        matmul's rows do not scale to a whole number)."""
        if examples == self.examples:
            return self
        ops = []
        for op in self.ops:
            rows = op.m * examples
            if rows % self.examples:
                raise SBPError(
                    f"LayerProfile {self.name!r}: matmul {op.name!r} has {op.m} rows for {self.examples} "
                    f"examples, which do not scale to {examples} examples."
                )
            batch = None if op.batch is None else op.batch * examples // self.examples
            ops.append(dataclasses.replace(op, m=rows // self.examples, batch=batch))
        r = examples / self.examples
        return dataclasses.replace(
            self,
            examples=examples,
            flops=(self.flops[0] * r, self.flops[1] * r),
            ops=tuple(ops),
            in_bytes=self.in_bytes * r,
            out_bytes=self.out_bytes * r,
            saved_bytes=None if self.saved_bytes is None else self.saved_bytes * r,
        )

    @property
    def other_saved_bytes(self) -> float:
        """Saved bytes beyond its matmuls' inputs and outputs (which
        :func:`~sbpjax.search.cost.op_memory` counts at their layouts' shares)."""
        if self.saved_bytes is None:
            return 0.0
        return max(self.saved_bytes - sum((op.x_elems + op.y_elems) * op.itemsize for op in self.ops), 0.0)

    @property
    def op_param_elems(self) -> int:
        return sum(op.w_elems for op in self.ops)


def _nbytes(avals) -> float:
    """Bytes of a value's leaves (the last layer's output may be a pytree)."""
    return float(
        sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(avals))
    )


def profile(chain) -> list[LayerProfile]:
    """Profiles of every layer of a :class:`sbpjax.pipeline.LayerChain` on its
    sample (alike layers, ``LayerChain.ties``, are traced and compiled once)."""
    from sbpjax.pipeline.cut import layer_flops

    flops = layer_flops(chain)
    shapes = chain.boundaries()
    out: list[LayerProfile] = []
    ops_of: dict = {}
    saved_of: dict = {}
    for i, (layer, tie, x, y, f) in enumerate(
        zip(chain.layers, chain.ties(shapes=shapes), shapes, shapes[1:], flops)
    ):
        key = tie if tie is not None else ("layer", i)
        if key not in ops_of:
            ops_of[key] = _layer_ops(layer, x)
            saved_of[key] = _saved_bytes(layer, x)
        prefix = f"{i}:{layer.name}"
        ops = tuple(
            dataclasses.replace(
                op,
                name=f"{prefix}/{op.name}",
                tie=None if tie is None else f"{tie}/{op.name}",
                from_data=i == 0 and op.from_data,
            )
            for op in ops_of[key]
        )
        elems = sum(int(np.size(v)) for v in jax.tree_util.tree_leaves(layer.params))
        out.append(
            LayerProfile(
                layer.name, chain.examples, f, ops, elems, _nbytes(x), _nbytes(y), tie, saved_of[key]
            )
        )
    return out


def _saved_bytes(layer, x) -> float:
    """The layer's input and the residuals its VJP keeps: the stash of a
    pipeline stage of this layer alone, counted by the runtime's own
    :meth:`sbpjax.pipeline.programs.StageVJP.slot_bytes`."""
    from sbpjax.pipeline.programs import StageVJP

    differentiable = bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))  # not for token ids
    stash, _ = StageVJP(layer.apply, differentiable).slot_bytes(layer.params, x, ())
    return float(stash)


def _layer_ops(layer, x) -> tuple[MatmulOp, ...]:
    """The layer's matmuls with a 2-D parameter; none when its program has no such
    product (an embedding lookup) or multiplies in a form the layout search does
    not model (the parameters then stay replicated)."""
    try:
        return tuple(from_program(layer.apply, layer.params, x))
    except SBPError:
        return ()


def gpt_profiles(
    n_layers: int, d_model: int, heads: int, seq: int, vocab: int, *, examples: int = 1, itemsize: int = 2
) -> list[LayerProfile]:
    """A GPT's layers without a model: embedding, ``n_layers`` tied transformer
    layers (flops ``2 m k n`` per matmul forward, twice that backward, plus the
    attention core ``4 seq^2 d`` per sequence forward) and the output head; for
    planning on devices that are not here."""
    tokens = examples * seq
    act = float(tokens * d_model * itemsize)

    def matmul_flops(ops):
        f = sum(2.0 * op.m * op.k * op.n for op in ops)
        return f, 2 * f

    # the lookup is a gather, not a matmul, in the program: its table stays replicated
    # and its flops are negligible (its gradient is a scatter-add of the same size)
    layers = [LayerProfile("embed", examples, (0.0, 0.0), (), vocab * d_model, float(tokens * 4), act)]
    for i in range(n_layers):
        ops = tuple(
            transformer(f"{i}:layers.{i}", examples, seq, d_model, heads, itemsize=itemsize, tie="layers")
        )
        f, b = matmul_flops(ops)
        core = 4.0 * examples * seq * seq * d_model
        params = sum(op.w_elems for op in ops) + 4 * d_model  # two layer norms
        layers.append(
            LayerProfile(f"layers.{i}", examples, (f + core, b + 2 * core), ops, params, act, act, "layers")
        )
    head = (MatmulOp(f"{n_layers + 1}:head", tokens, d_model, vocab, itemsize, param="head"),)
    f, b = matmul_flops(head)
    layers.append(
        LayerProfile("head", examples, (f, b), head, d_model * vocab, act, float(tokens * vocab * itemsize))
    )
    return layers
