"""A model as a chain of layers, the form a pipeline cuts.

    chain = sjp.LayerChain.from_functions([embed, block, block, head], params, sample=tokens)
    chain = sjp.LayerChain.from_model(nnx_model, sample=tokens)      # see sbpjax.pipeline.from_nnx
    chain(chain.params, tokens)          # the whole model, one layer after the other

Each :class:`Layer` is ``apply(params, x) -> y`` with its own parameters; the
output of one layer is the input of the next, so any contiguous run of layers
is a stage function (:meth:`LayerChain.stage_fn`) and the chain's parameters
are the stages' parameters side by side. Dim 0 of the input and of every value
between layers is the batch (microbatches split it).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from sbpjax._errors import SBPError, SBPWarning
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Partial, Split, normalize_nd_sbp
from sbpjax.tensor import host_values


@dataclasses.dataclass(frozen=True)
class Layer:
    """One link of a :class:`LayerChain`.

    ``apply(params, x) -> y``; ``params``: its parameters (a pytree of arrays);
    ``layouts(placement)``: a pytree like ``params`` of nd-SBPs on ``placement``
    (the model's own annotations; None: all B); ``tie``: layers with the same
    tie have the same function and parameter shapes; those that also read
    inputs of one shape and dtype (:meth:`LayerChain.ties`) are alike: their
    costs are measured once and a search gives them one layout; ``kind``:
    "before" (embedding), "block", "after" (head) or "layer"."""

    name: str
    apply: Callable
    params: Any
    layouts: Callable[[Placement], Any] | None = None
    tie: str | None = None
    kind: str = "layer"

    def param_sbp(self, placement: Placement):
        """One nd-SBP per parameter leaf on ``placement`` (B where not annotated)."""
        rep = (Broadcast(),) * placement.ndim
        given = None if self.layouts is None else self.layouts(placement)
        if given is None:
            return jax.tree_util.tree_map(lambda _: rep, self.params)
        if is_layout(given):  # one layout for every leaf
            return jax.tree_util.tree_map(
                lambda p: normalize_nd_sbp(given, placement.ndim, np.ndim(p), self.name), self.params
            )
        return jax.tree_util.tree_map(
            lambda s, p: rep if s is None else normalize_nd_sbp(s, placement.ndim, np.ndim(p), self.name),
            given,
            self.params,
            is_leaf=lambda v: v is None or is_layout(v),
        )


def _stage_fn(applies: Sequence[Callable], name: str) -> Callable:
    def stage(params, x):
        for apply, p in zip(applies, params):
            x = apply(p, x)
        return x

    stage.__name__ = name
    return stage


def _warn_shared_arrays(fns, params, names) -> None:
    """One array object among the parameters of layers with different functions
    is most likely a tied weight (an embedding read by the head), which a
    pipeline cannot keep tied: say so. Layers of one function given one array
    (``[init] * n``) are alike layers from one initial value: no warning."""
    first: dict = {}
    for i, (fn, p) in enumerate(zip(fns, params)):
        for path, v in jax.tree_util.tree_flatten_with_path(p)[0]:
            if np.ndim(v) == 0:
                continue
            j = first.setdefault(id(v), (i, path))[0]
            if j != i and fns[j] is not fn:
                warnings.warn(
                    SBPWarning(
                        f"LayerChain.from_functions: layers {names[j]!r} and {names[i]!r} are given the same "
                        f"array ({jax.tree_util.keystr(path)}): each layer's parameters are its own, so they are "
                        "trained as two copies that drift apart. A pipeline cannot keep weights tied across "
                        "stages: read the weight in one layer, or pass a copy to silence this."
                    ),
                    stacklevel=3,
                )
                return


def _not_one_array(sample) -> str | None:
    """What ``sample`` is when it is no array of rank >= 1 (None when it is)."""
    if sample is None:
        return "None"
    if isinstance(sample, (dict, tuple)):
        return f"a {type(sample).__name__}"
    try:
        rank = np.ndim(sample)
    except ValueError:  # a ragged list: several arrays
        return "a list of arrays of different shapes"
    return "a scalar" if rank == 0 else None


def check_sample(sample, source: str) -> None:
    """An SBPError unless ``sample`` is one array of rank >= 1; ``source``:
    the constructor's name after ``LayerChain`` (``".from_model"``)."""
    what = _not_one_array(sample)
    if what is not None:
        # the pipeline feeds one array to the first stage (sbpjax.pipeline.feeds says why)
        raise SBPError(
            f"LayerChain{source}: the sample is {what}; a chain's input is one array with the "
            "examples along dim 0, as the pipeline feeds it to the first stage. Pack several inputs "
            "into one array (concatenate a mask as a channel), or compute what the first layer "
            "needs from it (a padding mask from the token ids)."
        )


class LayerChain:
    """Layers run one after the other on one example input ``sample``.

    ``to_model(per_layer_params)``: how the chain's parameters go back into
    the model's own tree (default: the list itself)."""

    def __init__(
        self, layers: Sequence[Layer], sample, *, to_model: Callable | None = None, source: str = ""
    ):
        self.layers = tuple(layers)
        if not self.layers:
            raise SBPError(f"LayerChain{source}: no layers; give at least one layer function.")
        check_sample(sample, source)
        self.sample = sample
        self.flops_cache: dict = {}  # examples -> per-layer (forward, backward) flops (sbpjax.pipeline.cut)
        self._to_model = to_model
        self.source = source

    @classmethod
    def from_functions(
        cls,
        fns: Sequence[Callable],
        params: Sequence,
        sample,
        *,
        param_sbp: Sequence | None = None,
        names: Sequence[str] | None = None,
    ) -> LayerChain:
        """A chain of ``fns[i](params[i], x) -> y``. ``param_sbp[i]``: layer ``i``'s
        parameter layouts (a pytree of nd-SBPs like ``params[i]``, one nd-SBP for
        all, or a function ``placement -> pytree``); None: B. Layers with the same
        function and parameter shapes are tied. Each layer's parameters are its
        own: one array given to layers of different functions (an embedding
        table the head reads too) is trained as two copies, with an
        SBPWarning (stages own their parameters; keep tied weights in one
        layer)."""
        fns, params = list(fns), list(params)
        if len(fns) != len(params):
            raise SBPError(
                f"LayerChain.from_functions: {len(fns)} functions but {len(params)} parameter trees; "
                "give one parameter tree per layer function (an empty dict for a layer without any)."
            )
        bad = [i for i, f in enumerate(fns) if not callable(f)]
        if bad:
            raise SBPError(
                f"LayerChain.from_functions: entries {bad} are not functions; each layer is fn(params, x) -> y."
            )
        sbps = list(param_sbp) if param_sbp is not None else [None] * len(fns)
        if len(sbps) != len(fns):
            raise SBPError(f"LayerChain.from_functions: {len(sbps)} param_sbp entries for {len(fns)} layers.")
        names = list(names) if names is not None else [f"layer{i}" for i in range(len(fns))]
        _warn_shared_arrays(fns, params, names)
        # global tensors (a trained pipeline's parameters, cut again) by their values, as the layer
        # functions take them under jax.jit (a stage lays them out on its own placement)
        params = [host_values(p) for p in params]
        layers = []
        for i, (fn, p, s) in enumerate(zip(fns, params, sbps)):
            shapes = tuple((np.shape(v), str(np.asarray(v).dtype)) for v in jax.tree_util.tree_leaves(p))
            tie = f"{getattr(fn, '__qualname__', 'fn')}@{id(fn)}:{hash(shapes)}"
            layers.append(Layer(names[i], fn, p, _as_layouts(s, p), tie))
        return cls(layers, sample, source=".from_functions")

    @classmethod
    def from_model(cls, model, sample, *, blocks: str | None = None, check: bool = True) -> LayerChain:
        """A Flax NNX model's layers: see :func:`sbpjax.pipeline.from_nnx.chain_of`."""
        from sbpjax.pipeline.from_nnx import chain_of

        return chain_of(model, sample, blocks=blocks, check=check)

    # -- the chain as a program -----------------------------------------------------
    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i) -> Layer:
        return self.layers[i]

    @property
    def params(self) -> list:
        """Per layer, its parameters."""
        return [layer.params for layer in self.layers]

    @property
    def examples(self) -> int:
        """Examples in ``sample`` (its dim 0)."""
        return int(np.shape(self.sample)[0])

    def __call__(self, params: Sequence, x):
        return _stage_fn([layer.apply for layer in self.layers], "chain")(params, x)

    def stage_fn(self, lo: int, hi: int, *, remat: bool = False) -> Callable:
        """``fn(params, x) -> y`` of layers ``lo .. hi - 1`` (``params``: their list);
        ``remat``: each layer under ``jax.checkpoint`` (its backward recomputes it
        from its input, which is all its forward keeps)."""
        applies = [jax.checkpoint(layer.apply) if remat else layer.apply for layer in self.layers[lo:hi]]
        return _stage_fn(applies, f"layers_{lo}_{hi - 1}" if hi - lo > 1 else self.layers[lo].name)

    def ties(self, examples: int | None = None, shapes: list | None = None) -> list:
        """Per layer, the key of the layers alike to it: its tie and its
        input's shape and dtype (None where it has no tie). One function with
        parameters of one shape costs more on a larger input (a convolution at
        each resolution of a U-Net, a block after a stride-2 one), so the tie
        alone does not make layers alike. ``shapes``: ``boundaries(examples)``
        where the caller has it."""
        shapes = self.boundaries(examples) if shapes is None else shapes
        return [
            None if layer.tie is None else f"{layer.tie}<-{x.shape}:{x.dtype}"
            for layer, x in zip(self.layers, shapes)
        ]

    def boundaries(self, examples: int | None = None) -> list:
        """``jax.ShapeDtypeStruct`` of the chain's input and of every layer's output
        (``len(self) + 1`` entries) for ``examples`` examples (default: the sample's)."""
        x = jax.ShapeDtypeStruct(np.shape(self.sample), np.asarray(self.sample).dtype)
        if examples is not None:
            x = jax.ShapeDtypeStruct((examples, *x.shape[1:]), x.dtype)
        out = [x]
        for i, layer in enumerate(self.layers):
            x = jax.eval_shape(layer.apply, layer.params, x)
            # the last layer's output goes to the loss in the last stage's own
            # program, never between stages, so it may be any pytree (logits and
            # an auxiliary loss); every other one crosses a cut as one array
            if i < len(self.layers) - 1 and not isinstance(x, jax.ShapeDtypeStruct):
                raise SBPError(
                    f"LayerChain: layer {layer.name!r} (layer {i} of {len(self.layers)}) returns "
                    f"{type(x).__name__}; a layer passes one array to the next, so pack several values "
                    "into one array (only the last layer, whose output goes to the loss, may return a "
                    "tuple or dict)."
                )
            out.append(x)
        return out

    def model_params(self, per_layer: Sequence):
        """The chain's parameters (one tree per layer; global tensors are read
        back) in the model's own form (an NNX model: its ``nnx.to_pure_dict`` tree,
        blocks stacked again where they were stacked)."""
        per_layer = list(per_layer)
        if len(per_layer) != len(self.layers):
            raise SBPError(
                f"LayerChain.model_params: {len(per_layer)} parameter trees for {len(self.layers)} layers; "
                "flatten the stages' lists first (sum(pipe.params, []) or cut.layer_params(...))."
            )
        host = [jax.tree_util.tree_map(np.asarray, host_values(p)) for p in per_layer]
        return self._to_model(host) if self._to_model is not None else host

    def __repr__(self):
        return f"LayerChain({len(self.layers)} layers: {', '.join(l.name for l in self.layers)})"


def is_layout(v) -> bool:
    """An SBP, SBP text or an nd-SBP tuple (a leaf of a layout tree)."""
    if isinstance(v, (str, Split, Broadcast, Partial)):
        return True
    return isinstance(v, tuple) and bool(v) and all(isinstance(s, (Split, Broadcast, Partial)) for s in v)


def _as_layouts(sbp, params) -> Callable | None:
    """``param_sbp`` of one layer as a function of the placement."""
    if sbp is None or callable(sbp):
        return sbp
    return lambda pl: sbp
