"""What a train step accepts, checked when it is built: the loss its function
returns, the batch's layouts and the axis they split the batch over, the
optimizer and the compute dtype. Bad input is an SBPError that names what
was given and how to fix it (``sbpjax.flax.train.TrainStep``,
``sbpjax.flax.trainer.Trainer`` and the pipeline's stages share them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.arguments import is_nd_sbp
from sbpjax.placement import Placement
from sbpjax.sbp import Split, normalize_nd_sbp


def checked_loss(loss, loss_fn, has_aux: bool, aux_hint: str | None = None):
    """The loss a train step differentiates: one float scalar. Anything else
    is an SBPError naming what ``loss_fn`` returned (a tuple means metrics
    without ``has_aux``; an integer loss has no gradient, where casting it
    would train on zeros)."""
    if isinstance(loss, float):
        loss = jnp.asarray(loss, jnp.float32)
    ok = hasattr(loss, "dtype") and np.shape(loss) == () and jnp.issubdtype(loss.dtype, jnp.floating)
    if ok:
        return loss
    if isinstance(loss, (tuple, list)):
        what = f"a {type(loss).__name__} of {len(loss)} values"
        hint = aux_hint or (
            "To return metrics with the loss, pass has_aux=True and return (loss, aux)."
            if not has_aux
            else "With has_aux=True return exactly (loss, aux)."
        )
    elif hasattr(loss, "dtype"):
        what = f"an array of shape {tuple(np.shape(loss))} and dtype {loss.dtype}"
        hint = (
            "An integer or boolean loss has no gradient: compute it in floating point."
            if np.shape(loss) == ()
            else "Reduce it to one value, e.g. jnp.mean over the examples."
        )
    else:
        what, hint = f"a {type(loss).__name__}", ""
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    raise SBPError(
        f"train step: loss_fn {name!r} returned {what}; it must return one float scalar. {hint}".strip()
    )


def batch_layouts(batch_sbp, placement: Placement, where: str) -> list:
    """``batch_sbp``'s nd-SBPs, each read (text parsed, entries counted against
    the placement's axes) when the step is built, not at its first call.
    Its leaves are as jit's in_sbp takes them: an nd-SBP, its text, or a bare
    SBP on a 1-D placement, where (S(0), S(0)) is two leaves' layouts (None /
    AUTO leaves name no layout)."""

    def leaf(v) -> bool:
        return isinstance(v, (Split, str)) or (is_nd_sbp(v) and len(v) == placement.ndim)

    out = []
    for nd in jax.tree.leaves(batch_sbp, is_leaf=leaf):
        if not leaf(nd):
            continue
        try:
            out.append(normalize_nd_sbp(nd, placement.ndim, where=f"{where} batch_sbp"))
        except SBPError as e:
            message = str(e) if "batch_sbp" in str(e) else f"{where}: batch_sbp={batch_sbp!r}: {e}"
            raise SBPError(message) from None
    return out


def batch_axis(layouts, placement: Placement) -> int | None:
    """The axis that ``layouts`` (a batch's nd-SBPs) split dim 0 over: one of
    more than one device first, else one of one device (code written for N
    devices run on one: ZeRO then has nothing to split); None where none does."""
    batch = [a for nd in layouts for a, s in enumerate(nd) if isinstance(s, Split) and s.dim == 0]
    return next((a for a in batch if placement.shape[a] > 1), batch[0] if batch else None)


def checked_optimizer(value, where: str):
    """``value`` if it is an optax ``GradientTransformation`` (``init`` and
    ``update``), else an SBPError naming ``where``."""
    if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
        return value
    raise SBPError(
        f"{where}: optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-3)), got "
        f"{type(value).__name__} ({value!r:.60})."
    )


def checked_compute_dtype(value, where: str):
    """``value`` as a floating NumPy dtype, or None; else an SBPError naming
    ``where`` (an integer compute dtype would cast the weights to integers
    and train nothing)."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise SBPError(
            f"{where}: compute_dtype must be a floating dtype (jnp.bfloat16, jnp.float16, jnp.float32, or "
            f"their names such as 'bfloat16'), got {value!r}."
        )
    return dtype
