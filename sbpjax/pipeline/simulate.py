"""The simulated clock: the same actor graph, given action durations, no JAX work.

Each thread is a serial resource with a FIFO message queue, as in the real
runtime: a message that arrives while its thread is busy waits, and messages
are taken in the order they arrived. An action that starts at ``t`` and lasts
``d`` sends its ``req``/``ack`` messages at ``t + d``. Ties are broken by
arrival time, then by the order in which messages were sent, so a simulation
is exactly reproducible: it verifies schedules to the last digit and plans
register counts before any device is touched.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping

from sbpjax._errors import SBPError, is_count
from sbpjax.pipeline.actor import KINDS, ActorGraph, ActorSystem
from sbpjax.pipeline.errors import PipelineStall
from sbpjax.pipeline.graph import build_graph
from sbpjax.pipeline.registry import as_schedule
from sbpjax.pipeline.timeline import ActionRecord, Timeline

Durations = Mapping[str, float] | Callable[[str, "int | None", "int | None"], float]


class _SimulatedSystem(ActorSystem):
    def __init__(self, graph: ActorGraph, duration: Callable):
        super().__init__(graph)
        self._duration = duration
        self._now = 0.0
        self._seq = 0
        self._queue: list = []  # (time the message can be handled, arrival time, send order, thread, message)
        self._free_at = {t: 0.0 for t in self.thread_names}
        self._thread_of = [a.spec.thread for a in self.actors]
        self.records: list[ActionRecord] = []

    def execute(self, actor, k, inputs):
        spec = actor.spec
        given = self._duration(spec.kind, spec.stage, spec.microbatch(k))
        try:
            d = float(given)
        except (TypeError, ValueError):
            d = math.nan
        if not (math.isfinite(d) and d >= 0):  # NaN passed a test of d < 0, and gave a makespan of 0
            raise SBPError(
                f"simulate: duration of {spec.name} microbatch {k} is {given!r}; durations must be "
                "finite numbers of seconds >= 0."
            )
        start, self._now = self._now, self._now + d
        self.records.append(
            ActionRecord(spec.name, spec.kind, spec.stage, spec.microbatch(k), spec.thread, start, self._now)
        )
        return {}

    def send(self, dst, msg):
        self._seq += 1
        heapq.heappush(self._queue, (self._now, self._now, self._seq, self._thread_of[dst.index], msg))

    def run(self) -> Timeline:
        for t in self.thread_names:
            self._now = 0.0
            self.start(t)
            self._free_at[t] = self._now
        while self._queue:
            when, arrived, seq, thread, msg = heapq.heappop(self._queue)
            if self._free_at[thread] > when:  # the thread is busy: the message waits its turn
                heapq.heappush(self._queue, (self._free_at[thread], arrived, seq, thread, msg))
                continue
            self._now = when
            self.handle(thread, msg)
            self._free_at[thread] = self._now
        if not all(a.finished for a in self.actors):
            raise PipelineStall(
                "simulate: the step cannot finish; nothing is left to act on:\n" + self.stall_report()
            )
        return Timeline(
            tuple(self.records),
            self.register_stats(),
            tuple(self.thread_names),
            held_bytes=dict(self.held_bytes),
        )


def duration_function(durations: Durations | None) -> Callable:
    """``durations``: ``{kind: seconds}`` or a function ``(kind, stage, microbatch)
    -> seconds``. Kinds: ``forward``, ``backward`` (a whole backward),
    ``backward_input`` (B) and ``backward_weight`` (W) of a split backward,
    ``load``, ``put``, ``transfer``, ``update``. Missing kinds take 0, except
    B and W: each takes half of ``backward`` when not given, so one table
    serves every schedule. Default: forward 1, backward 2 (B 1, W 1)."""
    if durations is None:
        durations = {"forward": 1.0, "backward": 2.0}
    if callable(durations):
        return durations
    unknown = set(durations) - set(KINDS)
    if unknown:
        raise SBPError(
            f"simulate: unknown action kinds {sorted(unknown)} in durations; kinds are {', '.join(KINDS)}."
        )
    table = dict(durations)
    half = table.get("backward", 0.0) / 2
    table.setdefault("backward_input", half)
    table.setdefault("backward_weight", half)
    return lambda kind, stage, microbatch: table.get(kind, 0.0)


def simulate_graph(graph: ActorGraph, durations: Durations | None = None) -> Timeline:
    """Run an actor graph on the simulated clock."""
    return _SimulatedSystem(graph, duration_function(durations)).run()


def simulate(
    schedule,
    devices: int,
    microbatches: int,
    durations: Durations | None = None,
    *,
    data_registers: int = 2,
    activation_registers: int = 2,
    stash_counts: list[int] | None = None,
    kept_counts: list[int] | None = None,
) -> Timeline:
    """Simulate one training step of ``schedule`` on ``devices`` device groups.

    ``schedule``: a name in :data:`~sbpjax.pipeline.SCHEDULES` ('gpipe', '1f1b',
    'interleaved', 'zb-h1', 'zb-h2', 'zb-v', 'dualpipev') or a :class:`Schedule`
    (:class:`Interleaved1F1B`, :class:`ActionList`, ...). ``durations``: see
    :func:`duration_function`. Returns the :class:`Timeline` (makespan, bubble,
    peak live registers, Gantt chart).
    """
    sched = as_schedule(schedule)
    if not is_count(devices):
        raise SBPError(f"simulate: devices must be an int >= 1, got {devices!r}.")
    devices = int(devices)
    graph = build_graph(
        sched,
        devices,
        microbatches,
        data_registers=data_registers,
        activation_registers=activation_registers,
        stash_counts=stash_counts,
        kept_counts=kept_counts,
        where="simulate",
    )
    return simulate_graph(graph, durations)
