"""Planning and compiling on 64 devices (a subprocess with 64 forced CPU devices)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import xla_flags

SCRIPT = textwrap.dedent("""
    import itertools, json, os, time
    import numpy as np
    import sbpjax as sj
    from sbpjax.boxing.lower import boxing_fn
    pl = sj.placement((4, 4, 4), ("a", "b", "c"))
    vals = [sj.S(0), sj.S(1), sj.B, sj.P]
    rng = np.random.default_rng(0)
    layouts = list(itertools.product(vals, repeat=3))
    worst, checked = 0.0, []
    for _ in range(30):
        a, b = (layouts[i] for i in rng.integers(len(layouts), size=2))
        t0 = time.perf_counter()
        plan = sj.plan_boxing((256, 512), np.float32, pl, a, b)
        worst = max(worst, time.perf_counter() - t0)
        at_floor = plan.floor is None or plan.bytes == plan.floor
        phys = sj.to_global(np.zeros((256, 512), np.float32), pl, a).physical
        measured = sum(c.bytes for c in sj.collectives(boxing_fn(plan).lower(phys).compile())) if plan.steps else 0
        checked.append([str(a), str(b), plan.bytes, measured, at_floor])
    print(json.dumps({"worst_plan_seconds": worst, "checked": checked}))
""")


@pytest.mark.slow
def test_64_devices_plans_fast_and_compiled_bytes_match():
    env = dict(os.environ, XLA_FLAGS=xla_flags(64))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900, check=True
    ).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["worst_plan_seconds"] < 2.0
    for src, dst, planned, measured, at_floor in res["checked"]:
        assert planned == measured, (src, dst)
        assert at_floor, (src, dst)
