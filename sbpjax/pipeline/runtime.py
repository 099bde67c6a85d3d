"""The threaded runtime: one OS thread per hardware queue, each with a FIFO queue.

As in OneFlow (paper section 5), every device group's stage is a hardware
queue with its own thread; the host loader and the host-to-device copies have
theirs. A thread pops messages from its queue in arrival order and hands each
to its actor, which acts as long as its registers allow. Threads never look at
each other's actors; messages are the only link, so there is no central
scheduler. The caller's thread only starts the threads, sleeps until they are
all done or one reports a failure or a stall, and joins them.

Failures: the first action that raises stops every thread (each finishes the
action it is in, starts no other, then exits) and the caller gets a
:class:`PipelineError` that names the actor, its stage and microbatch.

Stalls are detected exactly, with no timeout and no polling: a message is *in
flight* from the moment it is queued until its handling ends, and only a thread
that is not waiting on its queue sends one. So when every thread that still has
work waits on its queue and nothing is in flight, nothing can ever happen again;
the last thread to wait (or to leave) says so, and the caller gets a :class:`PipelineStall` naming
what each unfinished actor waits for.

Deadlines: a stage that blocks (a hung collective, a body waiting on something
that never comes) is not a stall, since its thread is not waiting on its queue.
``action_timeout(spec)`` gives each action a deadline; the caller's thread
checks the actions in progress a few times a second and, past a deadline,
stops every thread and raises :class:`PipelineTimeout` naming the stage,
microbatch and action. Ctrl-C (``KeyboardInterrupt`` in the caller's thread)
stops every thread the same way and is re-raised.

No thread outlives :meth:`ThreadedSystem.run`, except one stuck inside an
action body: Python cannot stop a thread, so after ``grace_s`` seconds it is
left behind (a daemon, named in the error); it starts no other action and
nothing it produces is used. At the interpreter's exit such threads are
waited for, up to ``EXIT_WAIT_S`` seconds: a daemon thread still inside an
XLA program when the interpreter finalizes aborts the process (SIGABRT,
exit code 134) after the script has ended normally. Not those a Ctrl-C left:
whoever pressed it wants the process gone.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable

from sbpjax._errors import SBPError
from sbpjax.pipeline.actor import ActorGraph, ActorSpec, ActorSystem
from sbpjax.pipeline.errors import PipelineError, PipelineStall, PipelineTimeout, action_failed
from sbpjax.pipeline.timeline import ActionRecord, Timeline

THREAD_PREFIX = "sbpjax-pipeline:"
# How long the interpreter's exit waits for threads left inside an action (the
# module docstring). A step's own deadline has already passed once more than
# that: an action still running a minute later is taken as hung, and the exit
# then aborts as it would have without the wait.
EXIT_WAIT_S = 60.0
_left_behind: list = []


@atexit.register
def _wait_for_left_behind() -> None:
    until = time.perf_counter() + EXIT_WAIT_S
    for th in _left_behind:
        th.join(max(0.0, until - time.perf_counter()))


_STOP = None  # the message that tells a thread to leave


class _Abandoned(Exception):
    """An action not run because its step had already failed."""


class _ActionFailed(Exception):
    def __init__(self, spec: ActorSpec, k: int, error: BaseException, inputs: dict):
        super().__init__(str(error))
        self.spec, self.k, self.error, self.inputs = spec, k, error, inputs


Body = Callable[[int, dict], dict]


class ThreadedSystem(ActorSystem):
    """Runs an actor graph for real: ``bodies[actor name](k, inputs) -> outputs``.

    ``before_action(spec, k)``, if given, is called on the actor's thread just
    before each action body (tests use it for random delays and injected faults).
    ``nbytes(value)`` counts the bytes of values written to activation registers.
    ``action_timeout(spec) -> seconds or None``: each action's deadline (None:
    none). ``grace_s``: how long a stopped step waits for its threads to finish
    the action they are in before leaving a stuck one behind.
    """

    POLL_S = 0.05  # how often the caller's thread looks at the deadlines

    def __init__(
        self,
        graph: ActorGraph,
        bodies: dict[str, Body],
        *,
        nbytes: Callable | None = None,
        before_action: Callable | None = None,
        action_timeout: Callable | None = None,
        grace_s: float = 2.0,
    ):
        super().__init__(graph)
        missing = [a.spec.name for a in self.actors if a.spec.name not in bodies]
        if missing:
            raise SBPError(
                f"ThreadedSystem: no body for actors {missing}; give bodies[name](k, inputs) -> "
                "outputs for every actor of the graph."
            )
        self._bodies = [bodies[a.spec.name] for a in self.actors]
        self._nbytes = nbytes
        self._before = before_action
        self._queues: dict[str, queue.SimpleQueue[tuple | None]] = {
            t: queue.SimpleQueue() for t in self.thread_names
        }
        self._thread_of = [a.spec.thread for a in self.actors]
        # per thread, written only by that thread (read by the caller after join)
        self._records: dict[str, list[ActionRecord]] = {t: [] for t in self.thread_names}
        self._busy_s = {t: 0.0 for t in self.thread_names}  # handling messages, bodies included
        self._body_s = {t: 0.0 for t in self.thread_names}
        # shared between threads, under _lock: who still runs, who waits, what is in flight
        self._lock = threading.Lock()
        self._live = set(self.thread_names)  # threads with unfinished actors
        self._waiting = 0  # live threads blocked on their queue
        self._in_flight = 0  # messages queued to a live thread and not yet handled
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self._wake = threading.Event()  # set when every thread has left, or on a failure or a stall
        self._local = threading.local()
        self._t0 = 0.0
        self._timeout = action_timeout
        self._grace_s = grace_s
        self._running: dict = {}  # thread -> (spec, k, start) of its action in progress, under _lock

    # -- driver hooks -------------------------------------------------------------
    def nbytes(self, value) -> int:
        return self._nbytes(value) if self._nbytes is not None else 0

    def stopping(self) -> bool:
        return self._failed.is_set()

    def send(self, dst, msg):
        thread = self._thread_of[dst.index]
        with self._lock:
            # A thread whose actors are all done has left; what it is sent now is an
            # ack for a register nobody will write again, so it is dropped.
            if thread in self._live:
                self._in_flight += 1
                self._queues[thread].put(msg)

    def execute(self, actor, k, inputs):
        spec = actor.spec
        thread = self._local.name
        start = time.perf_counter()
        with self._lock:
            self._running[thread] = (spec, k, start)
        try:
            if self._before is not None:
                self._before(spec, k)
            if self._failed.is_set():
                # the step failed (or passed a deadline) while this action waited: its
                # caller has returned, so the body would only hold a device for nothing
                raise _Abandoned(f"{spec.name} #{k}")
            out = self._bodies[actor.index](k, inputs)
        except BaseException as e:
            raise _ActionFailed(spec, k, e, inputs) from e
        finally:
            with self._lock:
                self._running.pop(thread, None)
        end = time.perf_counter()
        self._body_s[thread] += end - start
        self._records[thread].append(
            ActionRecord(
                spec.name, spec.kind, spec.stage, spec.microbatch(k), thread, start - self._t0, end - self._t0
            )
        )
        return out

    # -- threads ------------------------------------------------------------------
    def _thread_main(self, name: str) -> None:
        self._local.name = name
        q = self._queues[name]
        busy = 0.0
        try:
            t = time.perf_counter()
            self.start(name)
            busy += time.perf_counter() - t
            while not self.thread_finished(name) and not self._failed.is_set():
                if self._wait_would_stall():
                    self._stalled()
                    break
                msg = q.get()
                t = time.perf_counter()
                with self._lock:
                    self._waiting -= 1
                if msg is _STOP:
                    break
                self.handle(name, msg)
                with self._lock:
                    self._in_flight -= 1
                busy += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self._fail(e)
        finally:
            self._busy_s[name] = busy
            self._leave(name)

    def _wait_would_stall(self) -> bool:
        """Count this thread as waiting; True if that leaves nothing that can move."""
        with self._lock:
            self._waiting += 1
            return self._waiting == len(self._live) and self._in_flight == 0

    def _leave(self, name: str) -> None:
        with self._lock:
            self._live.discard(name)
            # messages still queued to it are no longer in flight (see send)
            q = self._queues[name]
            while not q.empty():
                if q.get() is not _STOP:
                    self._in_flight -= 1
            done = not self._live
            stalled = not done and self._waiting == len(self._live) and self._in_flight == 0
        if done:
            self._wake.set()
        elif stalled and not self._failed.is_set():
            self._stalled()

    def _stalled(self) -> None:
        # every live thread waits on an empty queue, so the actors' state is still
        self._fail(
            PipelineStall(
                "pipeline stalled: no actor can act and the step is not finished. Unfinished actors:\n"
                f"{self.stall_report()}\nGive the registers named above more slots "
                "(stash_counts / activation_registers / data_registers) or fix the action lists."
            )
        )

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failed.is_set():
                return
            self._failure = error
            self._failed.set()
            for q in self._queues.values():
                q.put(_STOP)
        self._wake.set()

    def run(self) -> Timeline:
        """Run the step; return its timeline, or raise what went wrong."""
        threads = [
            threading.Thread(target=self._thread_main, args=(t,), name=THREAD_PREFIX + t, daemon=True)
            for t in self.thread_names
        ]
        started = []
        self._t0 = time.perf_counter()
        try:
            for th in threads:
                th.start()
                started.append(th)
            # a timed wait, so deadlines are checked and Ctrl-C lands at once
            while not self._wake.wait(self.POLL_S):
                self._check_deadlines()
        except BaseException as e:  # e.g. KeyboardInterrupt in the caller: stop every thread first
            self._fail(e)
            self._join(started, wait_at_exit=False)  # whoever pressed Ctrl-C wants out
            raise
        stuck = self._join(started)
        if self._failure is not None:
            err = self._describe(self._failure)
            if stuck:
                err.args = (
                    f"{err.args[0]} Left behind, still inside an action (Python cannot stop a thread; "
                    f"nothing it produces is used): {', '.join(stuck)}.",
                )
            raise err
        records = sorted((r for rs in self._records.values() for r in rs), key=lambda r: r.start)
        overhead = sum(self._busy_s.values()) - sum(self._body_s.values())
        return Timeline(
            tuple(records), self.register_stats(), tuple(self.thread_names), overhead, dict(self.held_bytes)
        )

    def _join(self, threads, wait_at_exit: bool = True) -> list[str]:
        """Join every thread; after a failure wait at most ``grace_s`` in all and
        return the names of the actions whose threads are still inside them
        (``wait_at_exit``: the interpreter's exit waits for them)."""
        if not self._failed.is_set():
            for th in threads:
                th.join()
            return []
        until = time.perf_counter() + self._grace_s
        for th in threads:
            th.join(max(0.0, until - time.perf_counter()))
        stuck = [th for th in threads if th.is_alive()] if wait_at_exit else []
        _left_behind[:] = [th for th in _left_behind if th.is_alive()] + stuck
        with self._lock:
            return [
                f"{spec.name} on thread {t}"
                for t, (spec, _, _) in self._running.items()
                if any(th.is_alive() and th.name == THREAD_PREFIX + t for th in threads)
            ]

    def _check_deadlines(self) -> None:
        if self._timeout is None:
            return
        now = time.perf_counter()
        with self._lock:
            running = list(self._running.values())
        for spec, k, start in running:
            limit = self._timeout(spec)
            if limit is not None and now - start > limit:
                mb = spec.microbatch(k)
                where = f"stage {spec.stage}" if spec.stage is not None else "the host"
                what = f"microbatch {mb}" if mb is not None else "the step's update"
                self._fail(
                    PipelineTimeout(
                        f"pipeline: {spec.kind} actor {spec.name!r} on {where}, {what} has run {now - start:.3g} s, "
                        f"past its deadline of {limit:.3g} s; every actor was stopped. If the action is legitimately "
                        "this slow (a first compile, a large batch), raise Pipeline(action_timeout=...); otherwise "
                        "look for what it waits on.",
                        spec.name,
                        spec.kind,
                        spec.stage,
                        mb,
                    )
                )
                return

    def _describe(self, error: BaseException) -> BaseException:
        if isinstance(error, _ActionFailed):
            return action_failed(error.spec, error.k, error.error, "Every actor was stopped.", error.inputs)
        if isinstance(error, PipelineError):
            return error
        err = PipelineError(f"pipeline runtime failed: {type(error).__name__}: {error}")
        err.__cause__ = error
        return err
