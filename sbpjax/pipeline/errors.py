"""Errors of the pipeline runtime: a failed action, a stalled step."""

from __future__ import annotations

import jax

from sbpjax._errors import SBPError
from sbpjax.tensor import is_global


class PipelineError(SBPError):
    """An action failed; every actor was stopped. ``__cause__`` is the original
    exception; ``actor``, ``kind``, ``stage`` and ``microbatch`` say where.

    An :class:`SBPError` like every error sbpjax raises, so one
    ``except sj.SBPError`` covers a pipeline step too."""

    def __init__(
        self,
        message: str,
        actor: str | None = None,
        kind: str | None = None,
        stage: int | None = None,
        microbatch: int | None = None,
    ):
        super().__init__(message)
        self.actor, self.kind, self.stage, self.microbatch = actor, kind, stage, microbatch


class PipelineStall(PipelineError):
    """No actor can act and the step is not finished: register counts or action
    lists leave some actor waiting forever. The message names who waits for what."""


class PipelineTimeout(PipelineError):
    """An action ran past its deadline (``Pipeline(action_timeout=...)``): a
    stage that blocks. Every actor was stopped; the message names the stage,
    microbatch and action."""


def action_failed(
    spec, k: int, error: BaseException, stopped: str, inputs: dict | None = None
) -> PipelineError:
    """The error of an action that raised: which actor, stage and microbatch,
    the original error (as ``__cause__``), the shapes and dtypes of its
    ``inputs`` where the error may be about them (a TypeError or ValueError:
    a stage fed another shape than it takes fails at its first op), and
    ``stopped``: what the runtime did about it."""
    mb = spec.microbatch(k)
    where = f"stage {spec.stage}" if spec.stage is not None else "the host"
    what = f"microbatch {mb}" if mb is not None else "the step's update"
    shapes = _shapes(inputs) if inputs and isinstance(error, (TypeError, ValueError)) else ""
    given = (
        f" Its inputs: {shapes} (a shape error here is most often the stage before returning another "
        "shape than this stage takes)."
        if shapes
        else ""
    )
    err = PipelineError(
        f"pipeline: {spec.kind} actor {spec.name!r} failed on {where}, {what}: "
        f"{type(error).__name__}: {str(error).rstrip('.')}.{given} {stopped}",
        spec.name,
        spec.kind,
        spec.stage,
        mb,
    )
    err.__cause__ = error
    return err


def _shapes(inputs: dict) -> str:
    """``name dtype[shape]`` of each array in an action's inputs (the first six)."""
    leaves = jax.tree_util.tree_flatten_with_path(inputs, is_leaf=is_global)[0]
    parts = [
        f"{path[0].key}{jax.tree_util.keystr(path[1:])} {getattr(v.dtype, 'name', v.dtype)}{list(v.shape)}"
        for path, v in leaves
        if hasattr(v, "shape") and hasattr(v, "dtype")
    ]
    return ", ".join(parts[:6]) + (f" and {len(parts) - 6} more" if len(parts) > 6 else "")
