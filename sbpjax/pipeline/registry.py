"""Every schedule by name: what :func:`as_schedule` (and so ``Pipeline`` and
``simulate``) accepts, and what a search over schedules enumerates."""

from __future__ import annotations

from types import MappingProxyType

from sbpjax._errors import SBPError
from sbpjax.pipeline.schedule import GPipe, Interleaved1F1B, OneFOneB, Schedule
from sbpjax.pipeline.zero_bubble import DualPipeV, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV

SCHEDULES = MappingProxyType(
    {
        cls.name: cls
        for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1, ZeroBubbleH2, ZeroBubbleV, DualPipeV)
    }
)
"""Schedule name -> class (each constructible with no arguments): gpipe, 1f1b,
interleaved (2 chunks per device), zb-h1, zb-h2, zb-v, dualpipev."""


def as_schedule(schedule) -> Schedule:
    """A schedule object from an object or a name in :data:`SCHEDULES`."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str) and schedule.lower() in SCHEDULES:
        return SCHEDULES[schedule.lower()]()
    raise SBPError(
        f"unknown pipeline schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}, "
        "a Schedule object (e.g. Interleaved1F1B(chunks=v)) or ActionList(lists)."
    )
