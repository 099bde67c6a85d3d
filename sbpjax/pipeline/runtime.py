"""The threaded runtime: one OS thread per hardware queue, each with a FIFO queue.

As in OneFlow (paper section 5), every device group's stage is a hardware
queue with its own thread; the host loader and the host-to-device copies have
theirs. A thread pops messages from its queue in arrival order and hands each
to its actor, which acts as long as its registers allow. Threads never look at
each other's actors; messages are the only link, so there is no central
scheduler. The caller's thread only starts the threads, watches for failures
and stalls, and joins them.

Failures: the first action that raises stops every thread (each finishes the
action it is in, then exits) and the caller gets a :class:`PipelineError` that
names the actor, its stage and microbatch. Stalls: when no thread has handled
a message for ``stall_timeout`` seconds and all of them wait on empty queues,
the caller gets a :class:`PipelineStall` naming what each actor waits for.
Either way no thread outlives :meth:`ThreadedSystem.run`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from sbpjax.pipeline.actor import ActorGraph, ActorSpec, ActorSystem
from sbpjax.pipeline.errors import PipelineError, PipelineStall
from sbpjax.pipeline.timeline import ActionRecord, Timeline

THREAD_PREFIX = "sbpjax-pipeline:"
_STOP = None  # the message that tells a thread to leave


class _ActionFailed(Exception):
    def __init__(self, spec: ActorSpec, k: int, error: BaseException):
        super().__init__(str(error))
        self.spec, self.k, self.error = spec, k, error


Body = Callable[[int, dict], dict]


class ThreadedSystem(ActorSystem):
    """Runs an actor graph for real: ``bodies[actor name](k, inputs) -> outputs``.

    ``before_action(spec, k)``, if given, is called on the actor's thread just
    before each action body (tests use it for random delays and injected faults).
    ``nbytes(value)`` counts the bytes of values written to activation registers.
    """

    def __init__(self, graph: ActorGraph, bodies: dict[str, Body], *, nbytes: Callable | None = None,
                 before_action: Callable | None = None, stall_timeout: float = 30.0, poll: float = 0.01):
        super().__init__(graph)
        self._bodies = [bodies[a.spec.name] for a in self.actors]
        self._nbytes = nbytes
        self._before = before_action
        self._stall_timeout = stall_timeout
        self._poll = poll
        self._queues = {t: queue.SimpleQueue() for t in self.thread_names}
        self._queue_of = [self._queues[a.spec.thread] for a in self.actors]
        self._records = {t: [] for t in self.thread_names}
        self._busy_s = {t: 0.0 for t in self.thread_names}   # handling messages, bodies included
        self._body_s = {t: 0.0 for t in self.thread_names}
        self._idle = {t: False for t in self.thread_names}
        self._handled = 0  # progress counter read by the stall detector
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self._wake = threading.Event()  # set when every thread has left, or on a failure
        self._lock = threading.Lock()
        self._running = 0
        self._local = threading.local()
        self._t0 = 0.0

    # -- driver hooks -------------------------------------------------------------
    def nbytes(self, value) -> int:
        return self._nbytes(value) if self._nbytes is not None else 0

    def send(self, dst, msg):
        self._queue_of[dst.index].put(msg)

    def execute(self, actor, k, inputs):
        spec = actor.spec
        start = time.perf_counter()
        try:
            if self._before is not None:
                self._before(spec, k)
            out = self._bodies[actor.index](k, inputs)
        except BaseException as e:
            raise _ActionFailed(spec, k, e) from e
        end = time.perf_counter()
        thread = self._local.name
        self._body_s[thread] += end - start
        self._records[thread].append(ActionRecord(spec.name, spec.kind, spec.stage, spec.microbatch(k),
                                                  thread, start - self._t0, end - self._t0))
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
                self._idle[name] = True
                msg = q.get()
                t = time.perf_counter()
                self._idle[name] = False
                if msg is _STOP:
                    break
                self.handle(name, msg)
                self._handled += 1  # a progress signal for the stall detector: a lost increment is harmless
                busy += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            self._fail(e)
        finally:
            self._busy_s[name] = busy
            self._idle[name] = True
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._wake.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failed.is_set():
                return
            self._failure = error
            self._failed.set()
        self._wake.set()
        for q in self._queues.values():
            q.put(_STOP)

    def run(self) -> Timeline:
        """Run the step; return its timeline, or raise what went wrong."""
        threads = [threading.Thread(target=self._thread_main, args=(t,), name=THREAD_PREFIX + t, daemon=True)
                   for t in self.thread_names]
        self._running = len(threads)
        self._t0 = time.perf_counter()
        try:
            for th in threads:
                th.start()
            self._watch()
        except BaseException as e:  # e.g. KeyboardInterrupt in the caller: stop every thread first
            self._fail(e)
            raise
        finally:
            for th in threads:
                th.join()
        if self._failure is not None:
            raise self._describe(self._failure)
        records = sorted((r for rs in self._records.values() for r in rs), key=lambda r: r.start)
        overhead = sum(self._busy_s.values()) - sum(self._body_s.values())
        return Timeline(tuple(records), self.register_stats(), tuple(self.thread_names), overhead)

    def _watch(self) -> None:
        """Wait for the threads; stop them all on a failure or a stall."""
        last, since = -1, time.perf_counter()
        while not self._wake.wait(self._poll):
            now = time.perf_counter()
            if self._handled != last:
                last, since = self._handled, now
            elif now - since > self._stall_timeout and all(self._idle.values()):
                report = self.stall_report()
                self._fail(PipelineStall(
                    f"pipeline stalled: no actor could act for {self._stall_timeout:g}s and the step is not "
                    f"finished. Unfinished actors:\n{report}\nGive the registers named above more slots "
                    "(stash_counts / activation_registers) or fix the action lists."))
                return

    def _describe(self, error: BaseException) -> BaseException:
        if isinstance(error, _ActionFailed):
            spec, k = error.spec, error.k
            mb = spec.microbatch(k)
            where = f"stage {spec.stage}" if spec.stage is not None else "the host"
            what = f"microbatch {mb}" if mb is not None else "the step's update"
            err = PipelineError(
                f"pipeline: {spec.kind} actor {spec.name!r} failed on {where}, {what}: "
                f"{type(error.error).__name__}: {str(error.error).rstrip('.')}. Every actor was stopped.",
                spec.name, spec.kind, spec.stage, mb)
            err.__cause__ = error.error
            return err
        if isinstance(error, PipelineError):
            return error
        err = PipelineError(f"pipeline runtime failed: {type(error).__name__}: {error}")
        err.__cause__ = error
        return err
