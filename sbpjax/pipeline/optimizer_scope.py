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

_ACCEPT = (
    "Use a transformation that treats each parameter on its own (optax.clip, optax.clip_by_block_rms, "
    "optax.adaptive_grad_clip), or accept per-stage statistics with Pipeline(..., stagewise_optimizer=True)."
)


def check_stagewise(optimizer, stage_params: list, stage_names: list) -> None:
    """Raise an SBPError where an update of one stage's parameters reads
    another stage's gradients or parameters, where the optimizer's state
    carries a statistic of several stages to the next step (an average of
    the global norm), or where the optimizer cannot be traced on the whole
    model at all (then nothing shows it is stagewise: the user says so)."""

    def spec(t):
        return jax.ShapeDtypeStruct(np.shape(t), getattr(t, "dtype", np.float32))

    params = [jax.tree_util.tree_map(spec, p, is_leaf=is_global) for p in stage_params]
    try:
        state = jax.eval_shape(optimizer.init, params)
        jaxpr = jax.make_jaxpr(optimizer.update)(params, state, params).jaxpr
    except Exception as e:  # noqa: BLE001 - whatever the optimizer raises, the check cannot run
        raise SBPError(
            "Pipeline: the optimizer cannot be traced on the whole model's parameters (a list of the "
            f"stages' parameter trees): {type(e).__name__}: {str(e).splitlines()[0][:200]}. A pipeline runs "
            "it on each stage's own parameters, and without that trace nothing shows that one stage's "
            "update reads only its own gradients (a mask written for one stage's tree fails here). If it "
            "treats each stage on its own, say so with Pipeline(..., stagewise_optimizer=True)."
        ) from None
    owner = [i for i, p in enumerate(params) for _ in jax.tree_util.tree_leaves(p)]
    n_state = len(jax.tree_util.tree_leaves(state))
    # the update's inputs: the gradients, the state, the parameters (as params: a stage each)
    input_owner = owner + [None] * n_state + owner
    n_out = len(jaxpr.outvars)

    def stages_read(outputs) -> list | None:
        used = used_by(jaxpr, [k in outputs for k in range(n_out)])
        return None if used is None else sorted({o for o, u in zip(input_owner, used) if u and o is not None})

    for i, name in enumerate(stage_names):
        # the stage's updates are the first outputs, one per parameter, in order
        read = stages_read({k for k, o in enumerate(owner) if o == i})
        if read is None:
            return
        others = [o for o in read if o != i]
        if others:
            raise SBPError(
                f"Pipeline: the optimizer's update of stage {i} ({name!r}) is computed from stage "
                f"{others[0]} ({stage_names[others[0]]!r})'s gradients or parameters: it takes a statistic of the "
                "whole model (optax.clip_by_global_norm's norm, apply_if_finite's check). A pipeline runs the "
                "optimizer on each stage's own parameters, so each stage would see only its own: clipping by "
                f"its own norm, not the model's. {_ACCEPT}"
            )
    # the new state (after the updates): a leaf made from several stages is a statistic
    # of the whole model the next step reads, where each stage would keep its own
    for k in range(len(owner), n_out):
        read = stages_read({k})
        if read is not None and len(read) > 1:
            raise SBPError(
                f"Pipeline: the optimizer's state carries a statistic of several stages ({read}: "
                f"{[stage_names[o] for o in read]}) to the next step (state leaf {k - len(owner)}, e.g. an "
                "average of the global gradient norm). A pipeline keeps each stage's state apart, so each "
                f"would carry its own. {_ACCEPT}"
            )
