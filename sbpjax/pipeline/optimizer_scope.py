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
from (JAX's dead-code elimination, as :mod:`sbpjax.pipeline.probe` uses it).
"""

from __future__ import annotations

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.pipeline.probe import used_by
from sbpjax.tensor import is_global


def check_stagewise(optimizer, stage_params: list, stage_names: list) -> None:
    """Raise an SBPError where an update of one stage's parameters reads
    another stage's gradients or parameters."""

    def spec(t):
        return jax.ShapeDtypeStruct(np.shape(t), getattr(t, "dtype", np.float32))

    params = [jax.tree_util.tree_map(spec, p, is_leaf=is_global) for p in stage_params]
    try:
        state = jax.eval_shape(optimizer.init, params)
        jaxpr = jax.make_jaxpr(optimizer.update)(params, state, params).jaxpr
    except Exception:  # noqa: BLE001 - an optimizer this cannot trace is left to the stages to run
        return
    owner = [i for i, p in enumerate(params) for _ in jax.tree_util.tree_leaves(p)]
    n_state = len(jax.tree_util.tree_leaves(state))
    # the update's inputs: the gradients, the state, the parameters (as params: a stage each)
    input_owner = owner + [None] * n_state + owner
    for i, name in enumerate(stage_names):
        # the stage's updates are the first outputs, one per parameter, in order
        used = used_by(jaxpr, [o == i for o in owner] + [False] * (len(jaxpr.outvars) - len(owner)))
        if used is None:
            return
        others = sorted({o for o, u in zip(input_owner, used) if u and o is not None and o != i})
        if others:
            raise SBPError(
                f"Pipeline: the optimizer's update of stage {i} ({name!r}) is computed from stage "
                f"{others[0]} ({stage_names[others[0]]!r})'s gradients or parameters: it takes a statistic of the "
                "whole model (optax.clip_by_global_norm's norm, apply_if_finite's check). A pipeline runs the "
                "optimizer on each stage's own parameters, so each stage would see only its own: clipping by "
                "its own norm, not the model's. Use a transformation that treats each parameter on its own "
                "(optax.clip, optax.clip_by_block_rms, optax.adaptive_grad_clip), or accept per-stage "
                "statistics with Pipeline(..., stagewise_optimizer=True)."
            )
