"""Pipelines whose stages live in different processes (``jax.distributed``).

The threaded runtime (:mod:`sbpjax.pipeline.runtime`) lets each thread act as
soon as its registers allow, so the order of actions differs from run to run.
Across processes that order matters: a transfer between stages on different
processes is a collective (:func:`sbpjax.boxing.transfer.transfer_across_processes`)
that every process of both stages must call, and two processes calling their
collectives in different orders wait for each other forever.

So every process runs the same actor graph on the simulated clock
(:mod:`sbpjax.pipeline.simulate`: deterministic, the same in every process,
with the schedule's register counts and action lists) and performs the
actions in the order the simulation takes them: the forward, backward and
update of its own stages, every transfer that touches its devices, and
nothing for the other processes' stages (their results are handles: global
tensors with no shards here). The processes run at once and wait for each
other only inside a transfer, so stage 0 computes microbatch 2 while stage 1
computes microbatch 1, as in the threaded runtime; within one process the
actions run one after another (each process drives one device group).
"""

from __future__ import annotations

import time

import jax

from sbpjax._errors import SBPError
from sbpjax.compiler.processes import processes_differing
from sbpjax.pipeline.actor import ActorGraph
from sbpjax.pipeline.errors import PipelineError, action_failed
from sbpjax.pipeline.simulate import _SimulatedSystem, duration_function
from sbpjax.pipeline.timeline import ActionRecord, Timeline


def check_same_step_in_every_process(pipe, processes, shapes, refused=None) -> None:
    """Every process must run the same step: a process with another microbatch
    count, schedule or microbatch shape would send other sizes in its
    transfers and abort or stall the others in gloo. Compared as one
    fingerprint before anything runs, as ``sj.jit`` compares its calls
    (``sbpjax.compiler.processes.processes_differing``); ``shapes``: one microbatch's shapes
    (None for function feeds, whose shapes are not known before they run).
    ``refused``: the SBPError this process's own checks of the batch raised,
    raised here after the exchange, so that the other processes hear of it
    rather than wait in the exchange for this one. Only where the pipeline
    spans every process (an all-gather over every process: the others would
    not join it)."""
    if len(processes) != jax.process_count():
        if refused is not None:
            raise refused
        return
    desc = (pipe.microbatches, pipe.schedule.name, len(pipe.stages), len(pipe.groups), shapes, str(refused))
    differ = processes_differing(repr(desc))
    if refused is not None:
        raise refused
    if differ:
        raise SBPError(
            f"Pipeline.step: process(es) {differ} run another step than process 0, or refused their batch "
            f"(their own error says why) (this is process "
            f"{jax.process_index()}: {pipe.microbatches} microbatches of {shapes if shapes else 'a function feed'}, "
            f"schedule {pipe.schedule.name!r}, {len(pipe.stages)} stages). Every process must build the same "
            "pipeline and step it on a batch of the same shape: the transfers between stages in different "
            "processes are collectives of every process."
        )


class LockstepSystem(_SimulatedSystem):
    """Runs ``bodies[actor name](k, inputs) -> outputs`` in the simulated order.

    ``durations`` only decides the order (default: forward 1, backward 2);
    the returned :class:`Timeline` holds the real times of this process.
    There are no per-action deadlines here (a process waiting in a transfer
    cannot be interrupted from Python); a process that fails or dies ends the
    others through ``jax.distributed``'s coordinator or the launcher."""

    def __init__(self, graph: ActorGraph, bodies: dict, durations=None, before_action=None):
        super().__init__(graph, duration_function(durations))
        self._before = before_action
        missing = [a.spec.name for a in self.actors if a.spec.name not in bodies]
        if missing:
            raise PipelineError(f"LockstepSystem: no body for actors {missing}.")
        self._bodies = [bodies[a.spec.name] for a in self.actors]
        self._t0 = time.perf_counter()
        self._real: list[ActionRecord] = []

    def execute(self, actor, k, inputs):
        super().execute(actor, k, inputs)  # the simulated clock: it decides what comes next
        spec = actor.spec
        start = time.perf_counter()
        try:
            if self._before is not None:
                self._before(spec, k)
            out = self._bodies[actor.index](k, inputs)
        except Exception as e:
            raise action_failed(
                spec,
                k,
                e,
                "This process stops; the others stop when their next transfer finds it gone "
                "(or jax.distributed's coordinator ends them).",
                inputs,
            ) from e
        end = time.perf_counter()
        self._real.append(
            ActionRecord(
                spec.name,
                spec.kind,
                spec.stage,
                spec.microbatch(k),
                spec.thread,
                start - self._t0,
                end - self._t0,
            )
        )
        return out

    def run(self) -> Timeline:
        self._t0 = time.perf_counter()
        simulated = super().run()
        return Timeline(
            tuple(self._real), simulated.registers, simulated.threads, held_bytes=simulated.held_bytes
        )
