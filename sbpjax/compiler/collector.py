"""Python's cyclic garbage collector paused while ``sj.jit`` plans and lowers.

Planning a program makes millions of small objects (values, layouts,
decisions, boxing plans) and frees almost none of them until the plan is
made. Each collection of the oldest generation walks every object the
process holds (with JAX loaded, hundreds of thousands), and the planning's
allocations set off many such collections: on the 32-layer scanned GPT step
of ``benchmarks/compiler.py`` the layout choice took 5.6-6.9 s with the
collector on and 3.7-4.0 s with it paused, and the front end of the demo
(``examples/gpt_hybrid.py``, 2 layers) 1.92 s and 1.46 s. Nothing planning
makes is garbage in a cycle that matters: what it drops is collected once
the collector runs again.

Decision: pause it (as ``timeit`` does, and as the benchmarks time every
compile), rather than raise its thresholds for the whole process: a user's
own program keeps Python's defaults. Where the caller has paused it already,
it is left paused; the pause is per call, so concurrent compiles in threads
end with the collector on.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """The cyclic collector off inside the block (if it was on)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


__all__ = ["collector_paused"]
