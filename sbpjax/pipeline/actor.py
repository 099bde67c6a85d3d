"""Actors: one per operation, acting when their registers allow (OneFlow section 4).

An actor acts when every input register it reads holds a readable slot (its
*in counters* are non-zero) and every register it is about to write has a free
slot (its *out counters* are non-zero). After acting it sends a ``req`` to the
consumers of each slot it wrote and an ``ack`` to the producer of each slot it
has finished reading. Nothing else decides the order: no central scheduler.

:class:`ActorSystem` holds the protocol once; the threaded runtime
(:mod:`sbpjax.pipeline.runtime`) and the simulated clock
(:mod:`sbpjax.pipeline.simulate`) only differ in how an action's body runs and
when its messages arrive.
"""

from __future__ import annotations

import abc
import dataclasses
from collections import deque

from sbpjax._errors import SBPError
from sbpjax.pipeline.register import Register, RegisterSpec
from sbpjax.pipeline.timeline import RegisterStats

REQ, ACK = 0, 1  # message kinds: "this slot is readable" / "I am done with this slot"

KINDS = ("load", "put", "forward", "backward", "backward_input", "backward_weight", "transfer", "update")


@dataclasses.dataclass(frozen=True)
class ActorSpec:
    """What an actor is: its operation kind, where it runs, how often it acts.

    ``thread`` names the hardware queue (one OS thread each) the actor is bound
    to. The actor's ``k``-th action works on microbatch ``k`` unless
    ``per_step`` (the optimizer update acts once per step).
    """

    name: str
    kind: str
    stage: int | None
    thread: str
    actions: int
    per_step: bool = False

    def microbatch(self, k: int) -> int | None:
        """The microbatch of action ``k`` (None for a per-step action)."""
        return None if self.per_step else k


@dataclasses.dataclass(frozen=True)
class ActorGraph:
    """Actors, the registers between them, and optional per-thread action lists.

    ``orders`` maps a thread to the exact sequence ``(actor name, microbatch)``
    of the actors it lists (the explicit action-list form); actors a thread does
    not list act whenever their registers allow.
    """

    actors: tuple[ActorSpec, ...]
    registers: tuple[RegisterSpec, ...]
    orders: dict = dataclasses.field(default_factory=dict)

    def threads(self) -> list[str]:
        """Thread names in the order their actors first appear."""
        seen: dict[str, None] = {}
        for a in self.actors:
            seen.setdefault(a.thread, None)
        return list(seen)


class InBox:
    """A consumer's view of one input register: the slots announced by ``req``
    and not yet acked. ``len(readable)`` is the actor's in counter for it."""

    __slots__ = ("name", "producer", "readable", "register_index", "reuse")

    def __init__(self, register: Register, producer: int):
        self.name = register.spec.name
        self.register_index = register.index
        self.producer = producer  # actor index the ack goes back to
        self.reuse = register.spec.reuse
        self.readable: deque = deque()  # [slot, value, reads left] per announced slot

    def head(self):
        return self.readable[0][1]


class Actor:
    """The run-time state of one actor: in-boxes (in counters) and its registers."""

    __slots__ = ("done", "inboxes", "index", "ordered", "outputs", "spec")

    def __init__(self, spec: ActorSpec, index: int):
        self.spec = spec
        self.index = index
        self.done = 0
        self.inboxes: list[InBox] = []
        self.outputs: list[Register] = []  # registers it writes (their free slots are its out counters)
        self.ordered = False  # True when its thread's action list decides its turn

    @property
    def finished(self) -> bool:
        return self.done == self.spec.actions

    def ready(self) -> bool:
        if self.done == self.spec.actions:
            return False
        for box in self.inboxes:
            if not box.readable:
                return False
        k = self.done
        for reg in self.outputs:
            if not reg.free and reg.spec.writes_on(k):
                return False
        return True

    def waiting_for(self, actors: list[Actor]) -> str:
        """Why this actor cannot act now, in words (for the stall detector)."""
        if self.finished:
            return "finished"
        why = []
        for box in self.inboxes:
            if not box.readable:
                why.append(f"a req on {box.name!r} from {actors[box.producer].spec.name}")
        k = self.done
        for reg in self.outputs:
            if not reg.free and reg.spec.writes_on(k):
                holders = ", ".join(reg.spec.consumers)
                why.append(
                    f"an ack freeing one of the {reg.spec.count} slot(s) of {reg.spec.name!r} "
                    f"(held by {holders})"
                )
        return "waits for " + " and ".join(why) if why else "ready (not yet given its turn)"


class ActorSystem(abc.ABC):
    """The message protocol shared by every driver.

    A driver calls :meth:`start` once per thread and :meth:`handle` for each
    message that thread pops from its FIFO queue; it implements :meth:`execute`
    (run or simulate one action's body) and :meth:`send` (route a message to the
    queue of the receiver's thread).
    """

    def __init__(self, graph: ActorGraph):
        validate_graph(graph)
        self.graph = graph
        self.actors = [Actor(spec, i) for i, spec in enumerate(graph.actors)]
        by_name = {a.spec.name: a for a in self.actors}
        self._by_name = by_name
        self.registers = [Register(spec, i) for i, spec in enumerate(graph.registers)]
        for reg in self.registers:
            producer = by_name[reg.spec.producer]
            producer.outputs.append(reg)
            for c in reg.spec.consumers:
                by_name[c].inboxes.append(InBox(reg, producer.index))
        self._consumers = [[by_name[c] for c in reg.spec.consumers] for reg in self.registers]
        self.thread_names = graph.threads()
        self.thread_actors = {t: [a for a in self.actors if a.spec.thread == t] for t in self.thread_names}
        # explicit action lists: per thread, the (actor index, microbatch) sequence and a cursor
        self.orders = {t: [(by_name[n].index, k) for n, k in seq] for t, seq in graph.orders.items()}
        self.cursor = {t: 0 for t in self.orders}
        for seq in self.orders.values():
            for i, _ in seq:
                self.actors[i].ordered = True
        self.actions = sum(s.actions for s in graph.actors)
        # (stage, microbatch, "stash" | "kept") -> bytes a forward kept for its
        # backward, or a B for its W (the timeline replays them over time)
        self.held_bytes: dict = {}

    # -- driver hooks -----------------------------------------------------------
    @abc.abstractmethod
    def execute(self, actor: Actor, k: int, inputs: dict) -> dict:
        """Run (or simulate) action ``k`` of ``actor`` on ``{register name: value}``
        of its inputs; return ``{register name: value}`` for the registers it writes.
        The threaded runtime runs JAX work; the simulator advances a clock."""

    @abc.abstractmethod
    def send(self, dst: Actor, msg: tuple) -> None:
        """Deliver ``msg`` to the FIFO queue of ``dst``'s thread."""

    def nbytes(self, value) -> int:
        """Bytes a value holds (counted for activation registers only)."""
        return 0

    def stopping(self) -> bool:
        """True once the run is being abandoned (a failure elsewhere): no new
        action starts, even one that its registers would allow."""
        return False

    # -- protocol -----------------------------------------------------------------
    def start(self, thread: str) -> None:
        """A thread's first move: let every actor that needs no message act."""
        for actor in self.thread_actors[thread]:
            self._act_until_blocked(thread, actor)

    def handle(self, thread: str, msg: tuple) -> None:
        """Take one message off ``thread``'s queue: a ``req`` raises the receiver's
        in counter, an ``ack`` frees a slot of its register; then the receiver
        acts for as long as it can."""
        kind, dst, reg_index, slot, value = msg
        actor = self.actors[dst]
        if kind == REQ:
            for box in actor.inboxes:
                if box.register_index == reg_index:
                    box.readable.append([slot, value, box.reuse])
                    break
        else:
            self.registers[reg_index].ack(slot)
        self._act_until_blocked(thread, actor)

    def thread_finished(self, thread: str) -> bool:
        """Every actor bound to ``thread`` has done all its actions."""
        return all(a.finished for a in self.thread_actors[thread])

    def _may_act(self, thread: str, actor: Actor) -> bool:
        if actor.ordered:
            seq = self.orders[thread]
            c = self.cursor[thread]
            if c >= len(seq) or seq[c][0] != actor.index:
                return False
        return actor.ready()

    def _act_until_blocked(self, thread: str, actor: Actor) -> None:
        """Act while the actor stays ready (OneFlow's act-until-fail); on a thread
        with an action list, the actor whose turn comes next gets its chance too."""
        while not self.stopping():
            if self._may_act(thread, actor):
                self._act(thread, actor)
                continue
            seq = self.orders.get(thread)
            if seq is not None and self.cursor[thread] < len(seq):
                nxt = self.actors[seq[self.cursor[thread]][0]]
                if nxt is not actor and self._may_act(thread, nxt):
                    actor = nxt
                    continue
            return

    def _act(self, thread: str, actor: Actor) -> None:
        k = actor.done
        inputs = {box.name: box.head() for box in actor.inboxes}
        values = self.execute(actor, k, inputs)
        actor.done += 1
        if actor.ordered:
            self.cursor[thread] += 1
        for reg in actor.outputs:
            spec = reg.spec
            if not spec.writes_on(k):
                continue
            value = values.get(spec.name)
            nbytes = self.nbytes(value) if spec.activation or spec.kept else 0
            slot = reg.write(nbytes)
            if spec.activation or spec.kept:
                self.held_bytes[(actor.spec.stage, k, "kept" if spec.kept else "stash")] = nbytes
            for dst in self._consumers[reg.index]:
                self.send(dst, (REQ, dst.index, reg.index, slot, value))
        for box in actor.inboxes:
            head = box.readable[0]
            head[2] -= 1
            if head[2] == 0:
                box.readable.popleft()
                self.send(self.actors[box.producer], (ACK, box.producer, box.register_index, head[0], None))

    # -- reports ------------------------------------------------------------------
    def stall_report(self) -> str:
        """Which unfinished actors wait for what."""
        lines = []
        for t in self.thread_names:
            for a in self.thread_actors[t]:
                if not a.finished:
                    turn = ""
                    if a.ordered:
                        seq, c = self.orders[t], self.cursor[t]
                        if c < len(seq) and seq[c][0] != a.index:
                            nxt = self.actors[seq[c][0]]
                            turn = (
                                f"; the action list of thread {t!r} gives the turn to {nxt.spec.name} first"
                            )
                    lines.append(
                        f"  {a.spec.name} (thread {t!r}, {a.done}/{a.spec.actions} actions done) "
                        f"{a.waiting_for(self.actors)}{turn}"
                    )
        return "\n".join(lines)

    def register_stats(self) -> tuple[RegisterStats, ...]:
        """Per register: its count, and the most slots (and activation bytes) it held."""
        return tuple(
            RegisterStats(
                r.spec.name,
                r.spec.count,
                r.peak_live,
                r.peak_bytes,
                r.spec.activation,
                self._by_name[r.spec.producer].spec.stage,
                r.spec.kept,
            )
            for r in self.registers
        )


def validate_graph(graph: ActorGraph) -> None:
    """Names unique, registers between known actors, action lists consistent."""
    names = [a.name for a in graph.actors]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SBPError(f"actor graph: actor names must be unique; repeated: {dup}.")
    for a in graph.actors:
        if a.kind not in KINDS:
            raise SBPError(
                f"actor graph: actor {a.name!r} has kind {a.kind!r}; kinds are {', '.join(KINDS)}."
            )
        if a.actions < 0:
            raise SBPError(f"actor graph: actor {a.name!r} acts {a.actions} times; give a count >= 0.")
    known = set(names)
    by_name = {a.name: a for a in graph.actors}
    for r in graph.registers:
        for who in (r.producer, *r.consumers):
            if who not in known:
                raise SBPError(f"actor graph: register {r.name!r} names an unknown actor {who!r}.")
        if r.count < 1 or r.every < 1 or r.reuse < 1:
            raise SBPError(
                f"actor graph: register {r.name!r} needs count, every and reuse >= 1 "
                f"(got count={r.count}, every={r.every}, reuse={r.reuse})."
            )
    for thread, seq in graph.orders.items():
        seen: dict[str, int] = {}
        for pos, (name, k) in enumerate(seq):
            actor = by_name.get(name)
            if actor is None or actor.thread != thread:
                raise SBPError(
                    f"action list of thread {thread!r}, entry {pos}: {name!r} is not an actor "
                    f"bound to that thread."
                )
            if k != seen.get(name, 0):
                raise SBPError(
                    f"action list of thread {thread!r}, entry {pos}: {name} microbatch {k} comes "
                    f"out of order; each actor takes its microbatches 0, 1, 2, ... in turn "
                    f"(expected {seen.get(name, 0)})."
                )
            seen[name] = k + 1
        for name, n in seen.items():
            if n != by_name[name].actions:
                raise SBPError(
                    f"action list of thread {thread!r}: {name} is listed {n} times but acts "
                    f"{by_name[name].actions} times per step; list every microbatch once."
                )
