"""Shared checks for boxing tests: value, local tensors, bytes and collectives."""

from collections import Counter

import numpy as np
from conftest import reference_assemble, reference_local

import sbpjax as sj
from sbpjax.boxing.lower import boxing_fn


def check_boxing(pl, x, src, dst):
    """Box ``x`` from ``src`` to ``dst`` and check everything against references.

    Returns the plan."""
    t = sj.to_global(x, pl, src)
    u = t.to_global(sbp=dst)
    assert u.sbp == tuple(dst)
    # the logical value is unchanged (NumPy on the whole array)
    np.testing.assert_array_equal(u.numpy(), x)
    locs = u.local_tensors()
    np.testing.assert_array_equal(reference_assemble(locs, dst), x)
    for coord in np.ndindex(*pl.shape):
        want = reference_local(x, pl.shape, dst, coord)
        if want is not None:
            np.testing.assert_array_equal(locs[coord], want)
        else:  # a partial term has the shape of its piece (partials read as B)
            as_b = tuple(sj.B if isinstance(s, sj.Partial) else s for s in dst)
            assert locs[coord].shape == reference_local(x, pl.shape, as_b, coord).shape
    plan = sj.plan_boxing(x.shape, x.dtype, pl, src, dst)
    if plan.steps and 0 not in x.shape:
        compiled = boxing_fn(plan).lower(t.physical).compile()
        found = sj.collectives(compiled)
        # XLA's CPU backend moves bf16 collectives as f32: count in the tensor's dtype.
        itemsize = np.dtype(x.dtype).itemsize
        measured = sum(c.bytes * itemsize // c.itemsize for c in found)
        assert measured == plan.bytes, (str(plan), found)
        want_kinds = Counter(s.collective for s in plan.steps if s.collective and s.bytes)
        got_kinds = Counter(
            c.op for c in found for _ in range(c.count if c.op != "collective-permute" else 1)
        )
        if "collective-permute" in want_kinds:
            # one collective-permute per round
            want_kinds["collective-permute"] = sum(s.rounds for s in plan.steps if s.op == "permute")
        assert got_kinds == want_kinds, (str(plan), found)
    else:
        assert plan.bytes == 0
    return plan
