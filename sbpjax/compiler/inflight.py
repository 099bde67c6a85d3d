"""A bound on the ``sj.jit`` calls in flight on XLA:CPU under jax < 0.11.

jax 0.10's CPU client deadlocks when too many programs with collectives are
queued at once: one device's part of a collective never joins its rendezvous,
and after 40 s XLA aborts the process ("Termination timeout for `all gather
RendezvousKey{...}` ... only 7 of them arrived"). Measured with 8 simulated
devices on 2 cores: a data-parallel AdamW step called in a loop without
reading its results hangs within 100 steps; waiting for the call 24 back,
1000 steps run, 32 back they hang. Plain ``jax.jit`` hangs alike (74
resharding all-gathers dispatched at once hang, 40 run). jax 0.12 runs all
of these, so the bound applies to jax < 0.11 on CPU only.

Every ``EVERY``-th call on such a placement waits for its own results before
it returns, so at most ``EVERY`` calls (a third of the least depth seen to
hang) are queued behind it. A sync point rather than a sliding window
because a train step's results are donated to the next call (deleted, so
nothing old is left to wait on). On the loop above, waiting every 1, 4 or 16
calls ran 1000 steps in the same time (6.5, 7.2 and 7.5 s: the machine's
noise), so the bound costs nothing measurable there.
"""

from __future__ import annotations

import itertools
import threading

import jax

EVERY = 8

_AFFECTED = jax.__version_info__[:2] < (0, 11)
_calls = itertools.count(1)
_lock = threading.Lock()


def bounded(outputs, placement) -> None:
    """After a call on ``placement`` returned ``outputs`` (jax arrays): wait
    for them on every ``EVERY``-th call where the deadlock above can happen."""
    if not _AFFECTED or placement.devices.flat[0].platform != "cpu":
        return
    with _lock:
        due = next(_calls) % EVERY == 0
    if due:
        jax.block_until_ready(outputs)


__all__ = ["EVERY", "bounded"]
