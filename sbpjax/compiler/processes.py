"""Every process makes the same ``sj.jit`` call.

With several processes (``jax.distributed``) each compiles its own program; a
process whose arguments differ in shape, dtype or layout would compile another
one and stall or abort in its first collective. ``sj.jit`` compares a
fingerprint of each call across processes first (``api.CHECK_PROCESSES``).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.arguments import leaf_name, leaf_paths
from sbpjax.tensor import GlobalTensor


def check_same_call_in_every_process(tree, leaves, statics: str = "") -> None:
    """With several processes (``jax.distributed``) every process must run the
    same program: a process passing other shapes, dtypes or layouts would
    compile another program and stall or abort in its first collective. Before
    anything is placed, compare a fingerprint of the call (tree, and each
    argument's shape, dtype and layout, and the static arguments as
    ``statics`` gives them) across processes and raise in every
    process when they differ. Every call is checked: a process cannot know
    from its own calls that another process's call differs."""
    desc = [
        (tuple(x.shape), str(x.dtype), x.sbp)
        if isinstance(x, GlobalTensor)
        else (
            np.shape(x),
            str(x.dtype if hasattr(x, "dtype") else np.result_type(x)),
        )  # a ShapeDtypeStruct too
        for x in leaves
    ]
    differ = processes_differing(repr((tree, desc, statics)))
    if differ:
        what = ", ".join(f"{leaf_name(path)} {d}" for path, d in zip(leaf_paths(tree), desc))
        raise SBPError(
            f"sj.jit: process(es) {differ} called this function with other argument shapes, dtypes, "
            f"layouts or static arguments than process 0 (this is process {jax.process_index()}: {what}). "
            "Every process must make the same call with the same global shapes, layouts and static "
            "values; pass each process's own rows with sj.to_global(..., process_local=True)."
        )


def processes_differing(text: str) -> list[int]:
    """The processes whose ``text`` (a description of what each is about to
    run) differs from process 0's, compared by a hash gathered from every
    process: a collective every process must call."""
    from jax.experimental import multihost_utils

    mine = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(mine))
    return [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]


__all__ = ["check_same_call_in_every_process", "processes_differing"]
