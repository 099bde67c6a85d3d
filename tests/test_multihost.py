"""Global tensors, boxing, transfers, sj.jit, Trainer, pipelines and checkpoints across 2 JAX
processes with 4 CPU devices each (``python -m sbpjax.launch``, gloo between
the processes). The programs run as scripts in ``tests/multihost/``; each
checks its values against NumPy or one device itself, so here we check that
both processes finished and compare runs."""

import ast
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE_FLAGS, run_launcher, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "multihost")

# jaxlib 0.12.1's gloo collectives on XLA:CPU hang at random across processes
# (2026-12-06: three of this file's seven runs in one CI run, each left waiting;
# the first or second launch in a row here, alone on the machine). The same
# tests pass on jaxlib 0.12.0 (7 in 74 s) and 0.10.2; leg 1 runs the launcher's
# own two-process test on 0.10.2. Skipped on that release alone, saying so.
_GLOO_HANGS = jax.__version_info__[:3] == (0, 12, 1)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_GLOO_HANGS, reason="jaxlib 0.12.1's gloo collectives hang across processes on CPU"),
]


def _env(devices=None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # the launcher sets each process's device count and keeps the other flags
    env["XLA_FLAGS"] = xla_flags(devices) if devices else FAST_COMPILE_FLAGS
    return env


def launch(script, *args, timeout=300, processes=2):
    """Run ``script`` under the launcher: ``processes`` JAX processes sharing 8
    CPU devices, gloo between them (one process of 8 devices: the same
    collectives as two, so their sums add in the same order).

    A run that hangs is stopped (SIGTERM: the launcher stops its processes,
    none is left behind) and run again, once, as tests/test_launch.py does:
    XLA:CPU's gloo communicators hang now and then inside jaxlib on a loaded
    machine. Killed instead (as until 2026-12), a hung launcher left its
    processes running, and the launches after it hung too: three of these
    runs in one CI run on jax 0.12.1, each waiting out a 600 s limit (that
    release hangs far more often: ``pytestmark``). A wrong result or exit
    code fails at once."""
    command = [
        sys.executable,
        "-m",
        "sbpjax.launch",
        "-n",
        str(processes),
        "--local-devices",
        str(8 // processes),
    ]
    command += [script, *map(str, args)]
    for attempt in range(2):
        try:
            code, stdout, stderr = run_launcher(command, _env(), timeout)
            break
        except subprocess.TimeoutExpired:
            if attempt:
                raise
    assert code == 0, stdout[-4000:] + stderr[-4000:]
    return stdout


def single(script, *args, timeout=600):
    r = subprocess.run(
        [sys.executable, script, *map(str, args)],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def _lines(out, tag, process=None):
    found = []
    for line in out.splitlines():
        if process is not None:
            if not line.startswith(f"[p{process}] "):
                continue
            line = line[len(f"[p{process}] ") :]
        if line.startswith(tag + " "):
            found.append(line[len(tag) + 1 :])
    return found


def test_global_tensors_boxing_and_sj_jit_across_two_processes():
    out = launch(os.path.join(SCRIPTS, "global_tensors.py"))
    for p in (0, 1):
        assert _lines(out, "OK", p) == [str(p)], out[-3000:]
        assert _lines(out, "boxing pairs equal the logical array:", p) == ["200"]
    # process 0 plans (or reads its plan cache), process 1 receives the plan
    (source0, plan0), (source1, plan1) = (_lines(out, "PLAN", p)[0].rsplit(" ", 1) for p in (0, 1))
    assert source0 in ("solved", "plan cache") and source1 == "process 0" and plan0 == plan1, out[-3000:]


def test_trainer_across_two_processes_matches_one_process():
    script = os.path.join(SCRIPTS, "trainer.py")
    one = ast.literal_eval(_lines(single(script), "LOSSES")[0])
    one_gloo = ast.literal_eval(_lines(launch(script, processes=1), "LOSSES", 0)[0])
    out = launch(script)
    two = [ast.literal_eval(_lines(out, "LOSSES", p)[0]) for p in (0, 1)]
    assert two[0] == two[1]  # every process sees the same losses
    # bit for bit: one process of 8 devices with the collectives two processes use
    assert two[0] == one_gloo
    # XLA's in-process all-reduce adds in another order than gloo's, so against a
    # plain single-process run the last bits of a float32 sum can differ
    np.testing.assert_allclose(two[0], one, rtol=2e-6, atol=0)


def test_two_stage_pipeline_with_one_stage_per_process_matches_one_process():
    """Stage 0 on process 0's devices, stage 1 on process 1's: the lockstep
    runtime, activations and gradients crossing as collectives. The script
    checks each step against one device; here the two runs are compared."""
    script = os.path.join(SCRIPTS, "pipeline.py")
    alone = single(script)
    assert _lines(alone, "RUNTIME") == ["threaded"]
    one = ast.literal_eval(_lines(alone, "LOSSES")[0])
    gloo = launch(script, processes=1)
    assert _lines(gloo, "RUNTIME", 0) == ["threaded"]
    one_gloo = ast.literal_eval(_lines(gloo, "LOSSES", 0)[0])
    out = launch(script)
    for p in (0, 1):
        assert _lines(out, "RUNTIME", p) == ["lockstep"] and _lines(out, "OK", p) == [str(p)], out[-3000:]
    two = [ast.literal_eval(_lines(out, "LOSSES", p)[0]) for p in (0, 1)]
    for p in (0, 1):  # a step of another batch shape in one process is refused in both
        assert _lines(out, "MISMATCH REFUSED", p) == [str(p)], out[-3000:]
        assert _lines(out, "REFUSAL SHARED", p) == [str(p)], out[-3000:]
    assert two[0] == two[1]  # the losses reach every process
    assert two[0] == one_gloo  # bit for bit, with the same collectives (see the Trainer test)
    np.testing.assert_allclose(two[0], one, rtol=2e-6, atol=0)


def test_zero_bubble_pipeline_with_one_stage_per_process():
    """ZB-H1 across the two processes: B and W of each stage in its process, in
    the simulated order; the script checks every step against one device."""
    out = launch(os.path.join(SCRIPTS, "pipeline.py"), "zb-h1")
    for p in (0, 1):
        assert _lines(out, "RUNTIME", p) == ["lockstep"] and _lines(out, "OK", p) == [str(p)], out[-3000:]
        kinds = ast.literal_eval(_lines(out, "KINDS", p)[0])
        assert {"backward_input", "backward_weight"} <= set(kinds) and "backward" not in kinds


@pytest.mark.parametrize("writer, reader", [("two", "one"), ("one", "two")])
def test_checkpoint_saved_by_one_process_count_restores_in_the_other(tmp_path, writer, reader):
    script = os.path.join(SCRIPTS, "checkpoint.py")
    path = tmp_path / "ckpt"
    (launch if writer == "two" else single)(script, path, "save")
    out = (launch if reader == "two" else single)(script, path, "restore")
    restored = _lines(out, "RESTORED", 0 if reader == "two" else None)
    assert restored == ["exact"], out[-3000:]


def test_multihost_benchmark_quick(tmp_path):
    path = tmp_path / "multihost.json"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "multihost.py"), "--quick", "--output", str(path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 5
    for row in rows:
        assert row["bytes_one_process"] == row["bytes_two_processes"] > 0, row
        assert row["seconds_one_process"] > 0 and row["seconds_two_processes"] > 0
