"""Schedules: register counts (GPipe, 1F1B) or explicit action lists (the others).

GPipe and 1F1B are not orders written down anywhere: they are the same actor
graph with different register counts, and the order follows from which actor
has its registers first.

* **1F1B**: the forward of stage ``i`` (of ``p``) keeps its residuals for the
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
work by hand, and the zero-bubble schedules (:mod:`sbpjax.pipeline.zero_bubble`)
order the two halves of each backward, B (input cotangent) and W (weight
cotangent), separately. :class:`ActionList` takes such a per-device order;
:func:`sbpjax.pipeline.validate.validate_action_lists` checks it before it runs.
"""

from __future__ import annotations

import abc

from sbpjax._errors import SBPError, is_count
from sbpjax.pipeline.validate import FUSED, SPLIT, action_entries, index_of, validate_action_lists


class Schedule(abc.ABC):
    """How a step's microbatches flow: register counts and, optionally, action lists."""

    name = "schedule"
    flush = False  # GPipe's batch-wide flush edge
    chunks = 1  # model stages per device group
    split_backward = False  # True: B and W are separate actions (zero-bubble schedules)

    def stages(self, devices: int) -> int:
        """Model stages for ``devices`` device groups."""
        return devices * self.chunks

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

    def kept_counts(self, devices: int, microbatches: int) -> list[int] | None:
        """Slots of each stage's B-to-W register (what B keeps for W), or None
        when the schedule runs each backward whole."""
        return None

    def action_lists(self, devices: int, microbatches: int) -> dict[int, list] | None:
        """Per device, the ordered ``(kind, stage, microbatch)`` it runs; None when
        the order emerges from register counts."""
        return None

    def theory_bubble(self, devices: int, microbatches: int) -> float | None:
        """Idle share of the devices' time with uniform stages and free communication
        (for split schedules: F, B and W of equal length)."""
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
    ``(kind, stage, microbatch)``, with kinds ``"forward"`` and ``"backward"``
    (each backward whole), or ``"forward"``, ``"backward_input"`` (B) and
    ``"backward_weight"`` (W) (zero-bubble style). ``stage_devices[s]`` is the
    device of stage ``s`` (default: round robin, stage ``s`` on device ``s % p``).

    A split list has every stage's W for every microbatch, the first stage's
    too (there B runs the whole backward and W only marks the microbatch
    done). Every list is validated before it runs (each action exactly once, on its
    stage's device, dependencies that can be met, register bounds). Each
    stage's forward keeps as many residuals, and each B as many kept values,
    as its list ever has outstanding; registers that cross devices get one slot
    per microbatch so they never block an order that is valid."""

    name = "action_list"

    def __init__(self, lists, *, stage_devices=None):
        if isinstance(lists, (list, tuple)):  # a list indexed by device
            lists = dict(enumerate(lists))
        self._lists = {index_of(d, "a device"): seq for d, seq in action_entries(lists, "ActionList").items()}
        self._stage_devices = (
            None
            if stage_devices is None
            else tuple(index_of(d, "stage_devices entry") for d in stage_devices)
        )
        self.split_backward = any(kind in SPLIT[1:] for seq in self._lists.values() for kind, _, _ in seq)

    def action_lists(self, devices, microbatches):
        return self._lists

    def stages(self, devices):
        if self._stage_devices is not None:
            return len(self._stage_devices)
        return 1 + max((s for seq in self.action_lists(devices, 1).values() for _, s, _ in seq), default=0)

    def device_of(self, stage, devices):
        if self._stage_devices is not None and 0 <= stage < len(self._stage_devices):
            return self._stage_devices[stage]
        return stage % devices

    def check(self, devices, microbatches):
        self.validate(devices, microbatches)

    def validate(
        self,
        devices,
        microbatches,
        *,
        stash_counts=None,
        kept_counts=None,
        slot_bytes=None,
        memory_budget=None,
    ):
        """Check the lists (see :func:`~sbpjax.pipeline.validate.validate_action_lists`)."""
        n = self.stages(devices)
        validate_action_lists(
            self.action_lists(devices, microbatches),
            devices,
            microbatches,
            [self.device_of(s, devices) for s in range(n)],
            stash_counts=stash_counts,
            kept_counts=kept_counts,
            slot_bytes=slot_bytes,
            memory_budget=memory_budget,
            name=repr(self),
        )

    def stash_counts(self, devices, microbatches):
        return self._outstanding(devices, microbatches, "forward", (FUSED[1], SPLIT[1]))

    def kept_counts(self, devices, microbatches):
        if not self.split_backward:
            return None
        return self._outstanding(devices, microbatches, SPLIT[1], (SPLIT[2],))

    def _outstanding(self, devices, microbatches, opens: str, closes: tuple) -> list[int]:
        """Per stage, the most actions of kind ``opens`` not yet followed by their ``closes``."""
        counts = [0] * self.stages(devices)
        for seq in self.action_lists(devices, microbatches).values():
            live = [0] * len(counts)
            for kind, s, _ in seq:
                if kind == opens:
                    live[s] += 1
                elif kind in closes:
                    live[s] -= 1
                counts[s] = max(counts[s], live[s])
        return [max(c, 1) for c in counts]

    def __repr__(self):
        return f"ActionList({len(self._lists)} devices)"


class Interleaved1F1B(ActionList):
    """Megatron-LM's interleaved 1F1B: ``chunks`` model stages per device (stage
    ``c * p + d`` on device ``d``), microbatches in groups of ``p``."""

    name = "interleaved"

    def __init__(self, chunks: int = 2):
        if not is_count(chunks):
            raise SBPError(
                f"Interleaved1F1B(chunks={chunks!r}): chunks is the number of model stages per "
                "device, an int >= 1."
            )
        self.chunks = int(chunks)
        self._stage_devices = None

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
    Needs ``m % p == 0`` (microbatches in groups of ``p``).
    """
    if not (is_count(p) and is_count(v) and is_count(m)) or m % p:
        raise SBPError(
            f"megatron_interleaved(p={p!r}, v={v!r}, m={m!r}): give ints >= 1 with m % p == 0; the order "
            "takes microbatches in groups of p."
        )
    p, v, m = int(p), int(v), int(m)  # NumPy's ints: the actions hold Python's
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
