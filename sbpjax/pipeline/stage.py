"""A pipeline stage: a function of its parameters and input on its own
placement, with the parameters' layouts (and ZeRO's stored layouts).

    stages = [sjp.Stage(block, params_i, placement=pl_i, param_sbp=tp_layout) for i ...]

:class:`sbpjax.pipeline.pipeline.Pipeline` compiles each stage's programs
(:mod:`sbpjax.pipeline.programs`) and trains the stages together.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.arguments import is_nd_sbp
from sbpjax.flax.checks import batch_axis
from sbpjax.flax.train import zero_layout
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, Partial, Split, normalize_nd_sbp
from sbpjax.tensor import host_values, to_global


def _is_layout_leaf(v) -> bool:
    return isinstance(v, (str, Split, Broadcast, Partial)) or is_nd_sbp(v)


def _param_layouts(params, param_sbp, placement: Placement, where: str):
    """One nd-SBP per parameter leaf: ``None`` -> all B; one nd-SBP -> every leaf."""
    if param_sbp is None or _is_layout_leaf(param_sbp):
        spec = (Broadcast(),) * placement.ndim if param_sbp is None else param_sbp
        return jax.tree_util.tree_map(
            lambda x: normalize_nd_sbp(spec, placement.ndim, np.ndim(x), where), params
        )
    try:
        return jax.tree_util.tree_map(
            lambda s, x: normalize_nd_sbp(s, placement.ndim, np.ndim(x), where),
            param_sbp,
            params,
            is_leaf=_is_layout_leaf,
        )
    except (ValueError, TypeError) as e:
        if isinstance(e, SBPError):
            raise
        raise SBPError(
            f"{where}: param_sbp does not match the structure of the parameters ({e}); give one "
            "nd-SBP per parameter leaf in the same pytree, or a single nd-SBP for all."
        ) from None


def _zero_axis(zero, in_sbp: tuple, placement: Placement, name) -> int:
    """The axis a ZeRO stage stores its state split over."""
    if isinstance(zero, str):
        if zero not in placement.axis_names:
            raise SBPError(f"Stage {name!r}: zero={zero!r}; the placement's axes are {placement.axis_names}.")
        return placement.axis_names.index(zero)
    axis = batch_axis([in_sbp], placement)
    if axis is not None:
        return axis
    raise SBPError(
        f"Stage {name!r}: zero=True needs a data axis, one over which in_sbp splits the batch (S(0)); "
        f"in_sbp is {in_sbp}. Split the input over an axis, or name the axis: zero='dp'."
    )


class Stage:
    """One pipeline stage: ``fn(params, x) -> y`` on ``placement``.

    A Flax module is a stage as ``Stage(module.apply, variables, placement)``.
    ``param_sbp``: the parameters' nd-SBPs as the stage computes with them (a
    matching pytree, or one nd-SBP for all; default B). ``in_sbp`` /
    ``out_sbp``: nd-SBPs of ``x`` and ``y`` (default B). Inside,
    :func:`sbpjax.jit` chooses every other layout.

    ``zero``: ZeRO within the stage (OneFlow's Fig. 14, as
    :class:`sbpjax.flax.TrainStep` does it): ``True`` (the data axis is the one
    ``in_sbp`` splits dim 0 over) or an axis name. Parameters, their gradient
    accumulator and the optimizer state are then stored split over that axis
    (``stored_sbp``); each program gathers the weights to ``param_sbp`` where
    it uses them (the backward gathers them again rather than keeping a
    gathered copy per microbatch) and the gradient is reduce-scattered.
    """

    def __init__(
        self,
        fn: Callable,
        params,
        placement: Placement,
        *,
        param_sbp=None,
        in_sbp=None,
        out_sbp=None,
        zero=None,
        name: str | None = None,
    ):
        self.name = name or getattr(fn, "__name__", "stage")
        if not callable(fn):
            raise SBPError(
                f"Stage {self.name!r}: fn must be a function fn(params, x) -> y, got {type(fn).__name__}."
            )
        self.fn = fn
        self.placement = checked_placement(placement, f"Stage {self.name!r}")
        # global tensors (another stage's or pipeline's parameters, a restored checkpoint's) by
        # their values: this stage lays them out on its own placement
        host = jax.tree_util.tree_map(np.asarray, host_values(params))
        not_float = [
            (jax.tree_util.keystr(k), v.dtype)
            for k, v in jax.tree_util.tree_flatten_with_path(host)[0]
            if not jax.numpy.issubdtype(v.dtype, jax.numpy.inexact)  # bfloat16 too (no numpy float)
        ]
        if not_float:
            path, dtype = not_float[0]
            raise SBPError(
                f"Stage {self.name!r}: parameter {path or '(the whole tree)'} has dtype {dtype}; a stage's "
                "parameters are what its optimizer trains, so they are floating point (an integer has no "
                "gradient). Close over integer settings in fn, or pass them with the data."
            )
        self.param_sbp = _param_layouts(host, param_sbp, placement, f"Stage {self.name!r} param_sbp")
        rep = (Broadcast(),) * placement.ndim
        self.in_sbp = (
            rep
            if in_sbp is None
            else normalize_nd_sbp(in_sbp, placement.ndim, None, f"Stage {self.name!r} in_sbp")
        )
        self.out_sbp = (
            rep
            if out_sbp is None
            else normalize_nd_sbp(out_sbp, placement.ndim, None, f"Stage {self.name!r} out_sbp")
        )
        self.zero = zero
        self.stored_sbp = self.param_sbp
        if zero:
            axis = _zero_axis(zero, self.in_sbp, placement, self.name)
            self.stored_sbp = jax.tree_util.tree_map(
                lambda nd, p: zero_layout(nd, np.shape(p), placement, axis),
                self.param_sbp,
                host,
                is_leaf=is_nd_sbp,
            )
        self.params = jax.tree_util.tree_map(lambda p, s: to_global(p, placement, s), host, self.stored_sbp)
        self._compiled: dict = {}  # (loss, first?, optimizer, target layout) -> compiled programs

    def __repr__(self):
        return f"Stage({self.name!r}, {self.placement!r})"
