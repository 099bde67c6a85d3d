"""The actor graph of one training step, built from a schedule."""

from __future__ import annotations

import dataclasses

from sbpjax._errors import SBPError, is_count
from sbpjax.pipeline.actor import ActorGraph, ActorSpec
from sbpjax.pipeline.register import RegisterSpec
from sbpjax.pipeline.schedule import ActionList, Schedule


@dataclasses.dataclass(frozen=True)
class StageThreads:
    """Thread names: one per device group, plus the host loader and the host-to-device queue."""

    per_stage: tuple[str, ...]
    loader: str = "host"
    copy: str = "h2d"


def _counts(given, default, n: int, what: str, where: str) -> list[int]:
    counts = list(given) if given is not None else default
    if len(counts) != n or not all(is_count(c) for c in counts):
        raise SBPError(f"{where}: {what} {counts} needs one int >= 1 per stage ({n} stages).")
    return [int(c) for c in counts]


def build_graph(
    schedule: Schedule,
    devices: int,
    microbatches: int,
    threads: StageThreads | None = None,
    *,
    data_registers: int = 2,
    activation_registers: int = 2,
    stash_counts: list[int] | None = None,
    kept_counts: list[int] | None = None,
    slot_bytes: dict | None = None,
    memory_budget: float | None = None,
    where: str = "pipeline",
) -> ActorGraph:
    """The actor graph of one training step.

    Data: for each feed (``inputs`` to the first stage, ``targets`` to the
    last), a loader actor on the host thread and a host-to-device put actor on
    the copy thread, each with ``data_registers`` slots. Per stage: forward,
    backward and update actors, the backward as one actor or, for schedules
    that split it, as ``backward_input`` (B) and ``backward_weight`` (W) with a
    ``kept`` register between them (what B keeps for W, ``kept_counts`` slots);
    between stages, transfer actors bound to the *consumer's* thread (OneFlow
    inserts the pulling actor at the consumer's side).

    An action list is validated first (with the register counts, and with
    ``slot_bytes`` / ``memory_budget`` when given: see
    :func:`~sbpjax.pipeline.validate.validate_action_lists`). ``where``
    names the caller in the errors (``simulate`` builds the same graph)."""
    m = microbatches
    if not is_count(m):
        raise SBPError(f"{where}: microbatches must be an int >= 1, got {m!r}.")
    m = int(m)
    for name, v in (("data_registers", data_registers), ("activation_registers", activation_registers)):
        # checked whether or not this schedule reads it: a setting that works
        # only with some schedules would break when the schedule is swapped
        if not is_count(v):
            raise SBPError(f"{where}: {name} must be an int >= 1 (slots of a register), got {v!r}.")
    schedule.check(devices, m)
    n = schedule.stages(devices)
    if threads is None:
        threads = StageThreads(tuple(f"device{schedule.device_of(s, devices)}" for s in range(n)))
    if len(threads.per_stage) != n:
        raise SBPError(f"{where}: {n} stages but {len(threads.per_stage)} stage threads.")
    lists = schedule.action_lists(devices, m)
    stash = _counts(stash_counts, schedule.stash_counts(devices, m), n, "stash_counts", where)
    if schedule.flush and min(stash) < m:
        raise SBPError(
            f"{where}: {schedule!r} runs every forward before any backward, so each stage holds all {m} "
            f"microbatches' residuals; stash_counts {stash} would stall the step at the flush. Give each "
            f"stage at least {m} slots, or use 1f1b, which holds at most p per stage."
        )
    split = schedule.split_backward
    if kept_counts is not None and not split:
        # refused rather than ignored: a bound the user set on W's buffers that
        # silently does nothing would let them grow unseen once the schedule changes back
        raise SBPError(
            f"{where}: kept_counts bounds the values B keeps for W, but {schedule.name!r} runs each stage's "
            f"backward as one action and keeps none; drop kept_counts, or use a schedule that splits the "
            f"backward (zb-h1, zb-h2, zb-v, dualpipev)."
        )
    kept = _counts(kept_counts, schedule.kept_counts(devices, m), n, "kept_counts", where) if split else None
    if isinstance(schedule, ActionList) and (
        stash_counts is not None or kept_counts is not None or memory_budget is not None
    ):
        schedule.validate(
            devices,
            m,
            stash_counts=stash,
            kept_counts=kept,
            slot_bytes=slot_bytes,
            memory_budget=memory_budget,
        )
    # An explicit order decides when things are consumed; registers across
    # devices then get a slot per microbatch so a valid order can never block on them.
    between = m if lists is not None else activation_registers
    actors, regs = _feeds(threads, n, m, data_registers)
    for s in range(n):
        more_actors, more_regs = _stage(s, n, m, threads, split, stash, kept, between)
        actors += more_actors
        regs += more_regs
    if schedule.flush:
        regs.append(RegisterSpec("flush", f"forward{n - 1}", (f"backward{n - 1}",), 1, every=m, reuse=m))
    orders = {}
    if lists is not None:  # each device's list orders the actors on that device's thread
        thread_of = {schedule.device_of(s, devices): threads.per_stage[s] for s in range(n)}
        orders = {thread_of[d]: [(f"{kind}{s}", k) for kind, s, k in seq] for d, seq in lists.items()}
    return ActorGraph(tuple(actors), tuple(regs), orders)


def _feeds(threads: StageThreads, n: int, m: int, data_registers: int) -> tuple[list, list]:
    """For each feed (``inputs`` to the first stage, ``targets`` to the last):
    a loader actor on the host thread and a put actor on the copy thread."""
    actors: list[ActorSpec] = []
    regs: list[RegisterSpec] = []
    for feed, stage in (("inputs", 0), ("targets", n - 1)):
        actors += [
            ActorSpec(f"load:{feed}", "load", None, threads.loader, m),
            ActorSpec(f"put:{feed}", "put", stage, threads.copy, m),
        ]
        regs += [
            RegisterSpec(f"host:{feed}", f"load:{feed}", (f"put:{feed}",), data_registers),
            RegisterSpec(feed, f"put:{feed}", (f"forward{stage}",), data_registers),
        ]
    return actors, regs


def _stage(s: int, n: int, m: int, threads: StageThreads, split: bool, stash, kept, between: int):
    """Stage ``s``'s actors (forward, backward or B and W, update, and the
    transfers into it from its neighbours) and registers."""
    t = threads.per_stage[s]
    b, w = (f"backward_input{s}", f"backward_weight{s}") if split else (f"backward{s}", f"backward{s}")
    actors = [ActorSpec(f"forward{s}", "forward", s, t, m)]
    regs: list[RegisterSpec] = []
    if split:
        actors += [ActorSpec(b, "backward_input", s, t, m), ActorSpec(w, "backward_weight", s, t, m)]
        # the first stage's B keeps nothing (an empty marker per microbatch): a slot
        # per microbatch, so that its kept_counts entry bounds nothing, as it holds nothing
        regs.append(RegisterSpec(f"kept{s}", b, (w,), kept[s] if s > 0 else m, kept=True))
    else:
        actors.append(ActorSpec(b, "backward", s, t, m))
    actors.append(ActorSpec(f"update{s}", "update", s, t, 1, per_step=True))
    regs += [
        RegisterSpec(f"stash{s}", f"forward{s}", (b,), stash[s], activation=True),
        RegisterSpec(f"grads{s}", w, (f"update{s}",), 1, every=m),
    ]
    if s < n - 1:
        send = f"transfer:act{s}->{s + 1}"
        actors.append(ActorSpec(send, "transfer", s + 1, threads.per_stage[s + 1], m))
        regs += [
            RegisterSpec(f"out{s}", f"forward{s}", (send,), between),
            RegisterSpec(f"in{s + 1}", send, (f"forward{s + 1}",), between),
        ]
    if s > 0:
        send = f"transfer:grad{s}->{s - 1}"
        actors.append(ActorSpec(send, "transfer", s - 1, threads.per_stage[s - 1], m))
        regs += [
            RegisterSpec(f"dx{s}", b, (send,), between),
            RegisterSpec(
                f"dy{s - 1}", send, (f"{'backward_input' if split else 'backward'}{s - 1}",), between
            ),
        ]
    return actors, regs
