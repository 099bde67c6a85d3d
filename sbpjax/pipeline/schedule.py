"""Schedules: register counts (GPipe, 1F1B) or explicit action lists (interleaved 1F1B).

GPipe and 1F1B are not orders written down anywhere: they are the same actor
graph with different register counts, and the order follows from which actor
has its registers first.

* **1F1B**: the forward of stage ``i`` (of ``p``) keeps its inputs for the
  backward in a register of ``p - i`` slots (OneFlow's buffer op on the edge from
  forward to backward; the last stage needs one slot because its backward
  follows its forward at once). With all slots held, the forward waits for the
  backward to free one, so in the steady state forwards and backwards alternate.
* **GPipe**: the same register has ``m`` slots, and the last stage's backward
  also reads a ``flush`` register its forward writes once, after the ``m``-th
  microbatch: GPipe's synchronous flush (the batch's forward ends before any
  backward starts).

Some schedules are not a matter of counts: interleaved 1F1B (Narayanan et al.,
SC'21, section 2.2) puts ``v`` model chunks on each device and orders the chunks'
work by hand. :class:`ActionList` takes such a per-device order;
:class:`Interleaved1F1B` builds Megatron-LM's.
"""

from __future__ import annotations

import abc
import dataclasses

from sbpjax._errors import SBPError
from sbpjax.pipeline.actor import ActorGraph, ActorSpec
from sbpjax.pipeline.register import RegisterSpec


class Schedule(abc.ABC):
    """How a step's microbatches flow: register counts and, optionally, action lists."""

    name = "schedule"
    flush = False  # GPipe's batch-wide flush edge

    def stages(self, devices: int) -> int:
        """Model stages for ``devices`` device groups."""
        return devices

    def device_of(self, stage: int, devices: int) -> int:
        """The device group that runs ``stage`` (round robin, for interleaving)."""
        return stage % devices

    def check(self, devices: int, microbatches: int) -> None:
        """Raise :class:`SBPError` if the schedule cannot run this configuration."""
        return None  # a hook: by default every configuration runs; schedules with limits override it

    @abc.abstractmethod
    def stash_counts(self, devices: int, microbatches: int) -> list[int]:
        """Slots of each stage's forward-to-backward register (what makes GPipe
        or 1F1B: each schedule answers this)."""

    def action_lists(self, devices: int, microbatches: int) -> dict[int, list] | None:
        """Per device, the ordered ``(kind, stage, microbatch)`` it runs; None when
        the order emerges from register counts."""
        return None

    def theory_bubble(self, devices: int, microbatches: int) -> float | None:
        """Idle share of the devices' time with uniform stages and free communication."""
        return None

    def __repr__(self):
        return f"{type(self).__name__}()"


class GPipe(Schedule):
    """All forwards, then all backwards: ``m`` stash slots per stage plus the flush register."""

    name = "gpipe"
    flush = True

    def stash_counts(self, devices, microbatches):
        return [microbatches] * self.stages(devices)

    def theory_bubble(self, devices, microbatches):
        # makespan (m + p - 1)(F + B) for busy time m(F + B) per device (GPipe, Huang et al. 2019)
        return (devices - 1) / (microbatches + devices - 1)


class OneFOneB(Schedule):
    """One forward, one backward: stage ``i`` keeps at most ``min(p - i, m)`` activations."""

    name = "1f1b"

    def stash_counts(self, devices, microbatches):
        p = self.stages(devices)
        return [min(p - i, microbatches) for i in range(p)]

    def theory_bubble(self, devices, microbatches):
        # same makespan as GPipe, (m + p - 1)(F + B) (Narayanan et al., PipeDream-Flush, 2021)
        return (devices - 1) / (microbatches + devices - 1)


class ActionList(Schedule):
    """An explicit order: ``lists[d]`` is device ``d``'s sequence of
    ``("forward" | "backward", stage, microbatch)``. Stage ``s`` runs on device
    ``s % p``. Each stage's forward keeps as many activations as its list ever
    has outstanding; registers that cross devices get one slot per microbatch so
    they never block an order that is valid."""

    name = "action_list"

    def __init__(self, lists):
        items = lists.items() if isinstance(lists, dict) else enumerate(lists)
        self._lists = {int(d): [(str(kind), int(s), int(k)) for kind, s, k in seq] for d, seq in items}

    def action_lists(self, devices, microbatches):
        return self._lists

    def stages(self, devices):
        return 1 + max((s for seq in self.action_lists(devices, None).values() for _, s, _ in seq), default=0)

    def check(self, devices, microbatches):
        lists = self.action_lists(devices, microbatches)
        if sorted(lists) != list(range(devices)):
            raise SBPError(
                f"ActionList: lists are given for devices {sorted(lists)} but the pipeline "
                f"has {devices} device groups; give one list per device 0..{devices - 1}."
            )
        for d, seq in lists.items():
            for pos, (kind, s, k) in enumerate(seq):
                if kind not in ("forward", "backward"):
                    raise SBPError(
                        f"ActionList: device {d}, entry {pos}: kind {kind!r}; use 'forward' or "
                        "'backward' (transfers, data and updates act on their own)."
                    )
                if s % devices != d:
                    raise SBPError(
                        f"ActionList: device {d}, entry {pos}: stage {s} runs on device "
                        f"{s % devices} (stage s lives on device s % {devices}); move the entry."
                    )
                if not 0 <= k < microbatches:
                    raise SBPError(
                        f"ActionList: device {d}, entry {pos}: microbatch {k} is outside "
                        f"0..{microbatches - 1}."
                    )
        listed = {(kind, s) for seq in lists.values() for kind, s, _ in seq}
        missing = [
            f"{kind} {s}"
            for s in range(self.stages(devices))
            for kind in ("forward", "backward")
            if (kind, s) not in listed
        ]
        if missing:
            raise SBPError(
                f"ActionList: {', '.join(missing)} never appear; list every stage's forward and "
                f"backward for microbatches 0..{microbatches - 1}."
            )

    def stash_counts(self, devices, microbatches):
        counts = [0] * self.stages(devices)
        for seq in self.action_lists(devices, microbatches).values():
            live = [0] * len(counts)
            for kind, s, _ in seq:
                live[s] += 1 if kind == "forward" else -1
                counts[s] = max(counts[s], live[s])
        return [max(c, 1) for c in counts]

    def __repr__(self):
        return f"ActionList({len(self._lists)} devices)"


class Interleaved1F1B(ActionList):
    """Megatron-LM's interleaved 1F1B: ``chunks`` model stages per device (stage
    ``c * p + d`` on device ``d``), microbatches in groups of ``p``."""

    name = "interleaved"

    def __init__(self, chunks: int = 2):
        if not isinstance(chunks, int) or chunks < 1:
            raise SBPError(
                f"Interleaved1F1B(chunks={chunks!r}): chunks is the number of model stages per "
                "device, an int >= 1."
            )
        self.chunks = chunks

    def stages(self, devices):
        return devices * self.chunks

    def check(self, devices, microbatches):
        if microbatches % devices:
            raise SBPError(
                f"Interleaved1F1B: {microbatches} microbatches do not divide into groups of {devices} "
                f"(one per device); the interleaved order needs m % p == 0: use m = "
                f"{-(-microbatches // devices) * devices} or a non-interleaved schedule."
            )
        super().check(devices, microbatches)

    def action_lists(self, devices, microbatches):
        return megatron_interleaved(devices, self.chunks, microbatches)

    def theory_bubble(self, devices, microbatches):
        # Narayanan et al. SC'21 section 2.2.2: the bubble shrinks by v, (p - 1)(t_f + t_b) / v for
        # per-device stage times t_f, t_b; with per-chunk times f = t_f / v, b = t_b / v the makespan
        # is (v m + p - 1)(f + b) against v m (f + b) of work per device.
        v = self.chunks
        return (devices - 1) / (v * microbatches + devices - 1)

    def __repr__(self):
        return f"Interleaved1F1B(chunks={self.chunks})"


def megatron_interleaved(p: int, v: int, m: int) -> dict[int, list]:
    """Megatron-LM's interleaved 1F1B order, per device.

    Device ``d`` runs ``v * m`` chunk-forwards: the ``k``-th is chunk
    ``(k mod pv) // p`` of microbatch ``(k // pv) p + k mod p``; backwards take
    the chunks in reverse. It warms up with ``2 (p - d - 1) + (v - 1) p``
    forwards, then alternates one forward and one backward, then drains.
    """
    total = m * v

    def item(kind, k, d):
        group = k % (p * v)
        chunk = group // p if kind == "forward" else v - 1 - group // p
        return (kind, chunk * p + d, (k // (p * v)) * p + k % p)

    lists = {}
    for d in range(p):
        warm = min(2 * (p - d - 1) + (v - 1) * p, total)
        seq = [item("forward", k, d) for k in range(warm)]
        for j in range(total - warm):
            seq += [item("forward", warm + j, d), item("backward", j, d)]
        seq += [item("backward", j, d) for j in range(total - warm, total)]
        lists[d] = seq
    return lists


def as_schedule(schedule) -> Schedule:
    """A schedule object from an object or a name ('gpipe', '1f1b')."""
    if isinstance(schedule, Schedule):
        return schedule
    names = {"gpipe": GPipe, "1f1b": OneFOneB}
    if isinstance(schedule, str) and schedule.lower() in names:
        return names[schedule.lower()]()
    raise SBPError(
        f"unknown pipeline schedule {schedule!r}; use 'gpipe', '1f1b', Interleaved1F1B(chunks=v) "
        "or ActionList(lists)."
    )


@dataclasses.dataclass(frozen=True)
class StageThreads:
    """Thread names: one per device group, plus the host loader and the host-to-device queue."""

    per_stage: tuple[str, ...]
    loader: str = "host"
    copy: str = "h2d"


def build_graph(
    schedule: Schedule,
    devices: int,
    microbatches: int,
    threads: StageThreads | None = None,
    *,
    data_registers: int = 2,
    activation_registers: int = 2,
    stash_counts: list[int] | None = None,
) -> ActorGraph:
    """The actor graph of one training step.

    Data: for each feed (``inputs`` to the first stage, ``targets`` to the
    last), a loader actor on the host thread and a host-to-device put actor on
    the copy thread, each with ``data_registers`` slots. Per stage: forward,
    backward and update actors; between stages, transfer actors bound to the
    *consumer's* thread (OneFlow inserts the pulling actor at the consumer's side).
    """
    m = microbatches
    if not isinstance(m, int) or m < 1:
        raise SBPError(f"pipeline: microbatches must be an int >= 1, got {m!r}.")
    schedule.check(devices, m)
    n = schedule.stages(devices)
    if threads is None:
        threads = StageThreads(tuple(f"device{schedule.device_of(s, devices)}" for s in range(n)))
    if len(threads.per_stage) != n:
        raise SBPError(f"pipeline: {n} stages but {len(threads.per_stage)} stage threads.")
    lists = schedule.action_lists(devices, m)
    stash = list(stash_counts) if stash_counts is not None else schedule.stash_counts(devices, m)
    if len(stash) != n or any((not isinstance(c, int)) or c < 1 for c in stash):
        raise SBPError(f"pipeline: stash_counts {stash} needs one int >= 1 per stage ({n} stages).")
    # An explicit order decides when things are consumed; registers across
    # devices then get a slot per microbatch so a valid order can never block on them.
    between = m if lists is not None else activation_registers
    last = n - 1
    actors: list[ActorSpec] = []
    regs: list[RegisterSpec] = []
    for feed, stage in (("inputs", 0), ("targets", last)):
        actors += [
            ActorSpec(f"load:{feed}", "load", None, threads.loader, m),
            ActorSpec(f"put:{feed}", "put", stage, threads.copy, m),
        ]
        regs += [
            RegisterSpec(f"host:{feed}", f"load:{feed}", (f"put:{feed}",), data_registers),
            RegisterSpec(feed, f"put:{feed}", (f"forward{stage}",), data_registers),
        ]
    for s in range(n):
        t = threads.per_stage[s]
        actors += [
            ActorSpec(f"forward{s}", "forward", s, t, m),
            ActorSpec(f"backward{s}", "backward", s, t, m),
            ActorSpec(f"update{s}", "update", s, t, 1, per_step=True),
        ]
        regs += [
            RegisterSpec(f"stash{s}", f"forward{s}", (f"backward{s}",), stash[s], activation=True),
            RegisterSpec(f"grads{s}", f"backward{s}", (f"update{s}",), 1, every=m),
        ]
        if s < last:
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
                RegisterSpec(f"dx{s}", f"backward{s}", (send,), between),
                RegisterSpec(f"dy{s - 1}", send, (f"backward{s - 1}",), between),
            ]
    if schedule.flush:
        regs.append(RegisterSpec("flush", f"forward{last}", (f"backward{last}",), 1, every=m, reuse=m))
    orders = {}
    if lists is not None:  # stage d runs on device d, so its thread is device d's
        orders = {threads.per_stage[d]: [(f"{kind}{s}", k) for kind, s, k in seq] for d, seq in lists.items()}
    return ActorGraph(tuple(actors), tuple(regs), orders)
