"""Errors of the pipeline runtime: a failed action, a stalled step."""

from __future__ import annotations

from sbpjax._errors import SBPError


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
