"""Whether an optimizer can run stage by stage.

A pipeline runs the optimizer on each stage's own parameters, where its
gradients are: each stage's update sees that stage's gradients only. That is
the single-device update for optimizers that treat each parameter on its own
(SGD, Adam, AdamW, Lion, Adafactor, LAMB: their statistics are per leaf), but
not for ones that compute a statistic over the whole model first:
``optax.clip_by_global_norm`` would clip each stage by its own norm (a 2-stage
MLP clipped at 0.1: global norm 0.72, the stages' 0.61 and 0.39), and
``optax.apply_if_finite`` would skip the update only of the stage with the
NaN.

:func:`check_stagewise` finds such optimizers before anything runs: it
traces ``optimizer.update`` on the whole model's parameters (shapes only,
nothing is computed or allocated) and follows, through the traced program,
which stages' gradients and parameters each stage's updates are computed
from.
"""

from __future__ import annotations

import jax
import jax.extend.core as jax_core
import numpy as np

from sbpjax._errors import SBPError

# the parameters that hold a call's body (jit, custom derivatives): followed into
_CALL_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def check_stagewise(optimizer, stage_params: list, stage_names: list) -> None:
    """Raise an SBPError where an update of one stage's parameters reads
    another stage's gradients or parameters."""

    def spec(t):
        return jax.ShapeDtypeStruct(np.shape(t), getattr(t, "dtype", np.float32))

    params = [jax.tree_util.tree_map(spec, p, is_leaf=_is_global) for p in stage_params]
    try:
        state = jax.eval_shape(optimizer.init, params)
        closed = jax.make_jaxpr(optimizer.update)(params, state, params)
    except Exception:  # noqa: BLE001 - an optimizer this cannot trace is left to the stages to run
        return
    owner = [i for i, p in enumerate(params) for _ in jax.tree_util.tree_leaves(p)]
    n_state = len(jax.tree_util.tree_leaves(state))
    masks = [1 << i for i in owner] + [0] * n_state + [1 << i for i in owner]  # grads, state, params
    out = _output_masks(closed.jaxpr, masks)
    for i, mask in zip(owner, out[: len(owner)]):  # the updates, one per parameter
        others = [j for j in range(len(params)) if mask >> j & 1 and j != i]
        if others:
            raise SBPError(
                f"Pipeline: the optimizer's update of stage {i} ({stage_names[i]!r}) is computed from stage "
                f"{others[0]} ({stage_names[others[0]]!r})'s gradients or parameters: it takes a statistic of the "
                "whole model (optax.clip_by_global_norm's norm, apply_if_finite's check). A pipeline runs the "
                "optimizer on each stage's own parameters, so each stage would see only its own: clipping by "
                "its own norm, not the model's. Use a transformation that treats each parameter on its own "
                "(optax.clip, optax.clip_by_block_rms, optax.adaptive_grad_clip), or accept per-stage "
                "statistics with Pipeline(..., stagewise_optimizer=True)."
            )


def _is_global(v) -> bool:
    return type(v).__name__ == "GlobalTensor"


def _output_masks(jaxpr, in_masks: list) -> list:
    """Per output of ``jaxpr``, the bitwise or of the masks of the inputs it
    is computed from. A call (jit, custom derivatives) and each branch of a
    cond (optax.MultiSteps) are followed into; any other equation (a loop
    included) is taken whole: each output from every input."""
    env: dict = {v: m for v, m in zip(jaxpr.invars, in_masks)}

    def read(a) -> int:
        return 0 if isinstance(a, jax_core.Literal) else env.get(a, 0)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        body = next((eqn.params[k] for k in _CALL_BODIES if k in eqn.params), None)
        inner = getattr(body, "jaxpr", body)
        if inner is not None and hasattr(inner, "eqns") and len(inner.invars) == len(ins):
            outs = _output_masks(inner, ins)
        elif eqn.primitive.name == "cond":  # any branch may run; the index decides which
            outs = [ins[0]] * len(eqn.outvars)
            for branch in eqn.params["branches"]:
                outs = [a | b for a, b in zip(outs, _output_masks(branch.jaxpr, ins[1:]))]
        else:
            every = 0
            for m in ins:
                every |= m
            outs = [every] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs):
            env[v] = m
    return [read(a) for a in jaxpr.outvars]
