"""Registers: fixed quotas of memory that actors write and read (OneFlow's regst).

A register belongs to the actor that writes it. It has a fixed number of
slots (its *count*, chosen before the run): the producer's *out counter* is the
number of free slots, so a producer whose slots are all referenced cannot act,
which is back-pressure (OneFlow paper section 4.2-4.3). Each written slot gets
a *reference counter* equal to the number of consumers it was announced to;
every consumer's ``ack`` lowers it and the slot is free again at zero.

Two generalisations OneFlow also has, written as plain numbers on the spec:

* ``every``: the producer writes on every ``every``-th action only (a gradient
  accumulator emits once per ``m`` microbatches);
* ``reuse``: each consumer reads one written slot for ``reuse`` consecutive
  actions before it acks (GPipe's flush: every backward of the last stage
  reads the one register that says the whole batch's forward is done).
"""

from __future__ import annotations

import dataclasses
from collections import deque


@dataclasses.dataclass(frozen=True)
class RegisterSpec:
    """What a register is: who writes it, who reads it, how many slots it has."""

    name: str
    producer: str
    consumers: tuple[str, ...]
    count: int
    every: int = 1
    reuse: int = 1
    # True for the activations a forward keeps for its backward: the figure
    # the schedules are about (peak live activation registers per stage).
    activation: bool = False
    # True for what a B keeps for its W (zero-bubble schedules): bounded by the
    # count, so a W must run before more than ``count`` microbatches' values pile up.
    kept: bool = False

    def writes_on(self, action_index: int) -> bool:
        """Whether the producer's ``action_index``-th action (0-based) writes a slot."""
        return (action_index + 1) % self.every == 0


class Register:
    """The producer-side state of one register: free slots and reference counters."""

    __slots__ = ("spec", "index", "free", "refs", "nbytes", "live", "peak_live", "live_bytes", "peak_bytes")

    def __init__(self, spec: RegisterSpec, index: int):
        self.spec = spec
        self.index = index
        self.free = deque(range(spec.count))  # the out counter is len(free)
        self.refs = [0] * spec.count  # reference counter per slot
        self.nbytes = [0] * spec.count
        self.live = 0
        self.peak_live = 0
        self.live_bytes = 0
        self.peak_bytes = 0

    def write(self, nbytes: int) -> int:
        """Take a free slot for a new value referenced by every consumer."""
        slot = self.free.popleft()
        n = len(self.spec.consumers)
        self.nbytes[slot] = nbytes
        self.live += 1
        self.live_bytes += nbytes
        self.peak_live = max(self.peak_live, self.live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if n == 0:  # nobody reads it: written and released at once
            self._release(slot)
        else:
            self.refs[slot] = n
        return slot

    def ack(self, slot: int) -> None:
        """One consumer is done with ``slot``; recycle it when the last one is."""
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._release(slot)

    def _release(self, slot: int) -> None:
        self.live -= 1
        self.live_bytes -= self.nbytes[slot]
        self.free.append(slot)
