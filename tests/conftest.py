"""Test set-up: 8 simulated CPU devices, set before JAX starts."""

import importlib.metadata as _metadata
import os
import tempfile

# XLA's CPU code generation at LLVM -O0, without its expensive passes: the tests
# read values and the compiled HLO's collectives (chosen by the HLO passes, before
# LLVM), not machine-code speed, and CPU compiles are most of the suite's time
# (measured: 23-38% less per test file and example run). SBPJAX_TEST_XLA_DEFAULT=1
# tests with XLA's own settings; users' programs never see these flags. A test that
# asserts a run-time ratio passes fast_compile=False to run_script.
FAST_COMPILE_FLAGS = (
    ""
    if os.environ.get("SBPJAX_TEST_XLA_DEFAULT") == "1"
    else "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)
# jaxlib 0.10's XLA:CPU can still emit fusions by its older elemental emitter: a
# small boxing program compiles in 38 ms instead of 67 (measured on the 2x4 pairs
# of tests/boxing/test_lower.py; that file's 512 cases on 2x4: 64 s -> 47 s). The
# collectives are chosen by HLO passes before code is emitted, and the memory tests
# compare the plan with XLA's figures for the same compile. Later XLAs have only the
# fusion emitters, and an unknown flag aborts XLA, so the flag goes only to jaxlib
# 0.10 (read from its metadata: JAX is not imported yet).
try:
    _JAXLIB = _metadata.version("jaxlib")
except _metadata.PackageNotFoundError:  # a jaxlib built from source: leave the flag out
    _JAXLIB = ""
if FAST_COMPILE_FLAGS and _JAXLIB.startswith("0.10."):
    FAST_COMPILE_FLAGS += " --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int = 8, fast_compile: bool = True) -> str:
    """XLA_FLAGS for a test's child process: ``devices`` simulated CPU devices,
    compiled as this module's comment says."""
    flags = f"--xla_force_host_platform_device_count={devices}"
    return f"{flags} {FAST_COMPILE_FLAGS}".strip() if fast_compile else flags


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags()).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"  # the same in every worker
# sj.jit's plan cache (sbpjax.compiler.plan_cache): one directory per test run,
# shared by its xdist workers (their run id), never the user's cache: a plan
# made by this run's code is the only kind a test reads back. Every program
# planned twice in a run goes through the cache's check and restore.
os.environ.setdefault("SBPJAX_PLAN_CACHE", os.path.join(tempfile.gettempdir(), f"sbpjax-test-plans-{_RUN}"))
# JAX's persistent compilation cache, likewise one directory per test run: a
# program compiled again (the same step by a test and by the example or docs page
# it checks, a child process's warm-up) is read back instead of compiled. Keyed by
# the HLO, the XLA flags and the JAX version, so a hit is the same executable;
# every size and compile time is kept (JAX keeps only compiles over 1 s unless
# told). Measured: tests/compiler's fast tests 201 -> 189 s.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"sbpjax-test-xla-{_RUN}")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import itertools  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import sbpjax as sj  # noqa: E402
from sbpjax.sbp import Partial, Split  # noqa: E402

_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def reference_local(x: np.ndarray, grid, sbp, coord) -> np.ndarray | None:
    """The local tensor the semantics define for an S/B nd-SBP (None if partial).

    Written independently of sbpjax.layout: nested balanced splits with
    np.array_split (the first size % p pieces one longer), axis 0 first.
    """
    piece = x
    for a, s in enumerate(sbp):
        if isinstance(s, Partial):
            return None
        if isinstance(s, Split):
            piece = np.array_split(piece, grid[a], axis=s.dim)[coord[a]]
    return piece


def reference_assemble(locals_: np.ndarray, sbp) -> np.ndarray:
    """The logical tensor from local tensors, straight from the definition:
    axis 0 applies first: S concatenates its pieces, B requires equal copies,
    P(op) reduces them."""

    def go(prefix, axis):
        if axis == len(sbp):
            return np.asarray(locals_[tuple(prefix)])
        parts = [go(prefix + [i], axis + 1) for i in range(locals_.shape[axis])]
        s = sbp[axis]
        if isinstance(s, Split):
            return np.concatenate(parts, axis=s.dim)
        if isinstance(s, Partial):
            return _REDUCE[s.op](np.stack(parts), axis=0).astype(parts[0].dtype)
        for p in parts[1:]:
            assert np.array_equal(p, parts[0]), "broadcast copies differ"
        return parts[0]

    return go([], 0)


def nd_sbps(values, ndim):
    return list(itertools.product(values, repeat=ndim))


# The longest tests, measured on a 2-core machine (seconds of one CI run), start first.
# pytest-xdist's work stealing (`-n 2 --dist worksteal`) gives each worker half of the
# collection in order and, when one runs dry, moves the end of the other's queue to it;
# a long test collected late (tests/test_examples.py, tests/test_multihost.py) could
# start when nothing else is left, and one worker then waits for the other for up to its
# whole length. Started first, they overlap everything else and a leg ends on short
# tests (the longest first is the classic rule for scheduling jobs on parallel
# machines). A name that no longer matches only loses its place in the order.
LONGEST_FIRST = (
    "tests/compiler/test_budgets.py::test_budgets_between",  # 154
    "tests/test_examples.py::test_boxing_benchmark_quick",  # 106
    "tests/test_edges.py::test_random_boxing_suite",  # 92 (leg 1)
    "tests/test_examples.py::test_compiler_benchmark_quick",  # 89
    "tests/compiler/test_choose.py::test_sweep_bytes_at_most_gspmd[gpt-2x2x2-2d-64-3",  # 76
    "tests/search/test_benchmark.py::test_search_benchmark_quick",  # 72
    "tests/compiler/test_choose.py::test_two_d_gpt_on_2x2x2_with_an_idle_axis",  # 71
    "tests/test_multihost.py::test_global_tensors_boxing_and_sj_jit_across_two_processes",  # 66
    "tests/test_examples.py::test_models_benchmark_quick",  # 61
    "tests/compiler/test_choose.py::test_two_d_gpt_on_4x2_moves_no_more_than_gspmd",  # 53
    "tests/compiler/test_choose.py::test_sweep_bytes_at_most_gspmd[gpt-4x2-2d-64-3",  # 53
    "tests/compiler/test_choose.py::test_sweep_bytes_at_most_gspmd[gpt-2x2x2-2d-128-1",  # 48
    "tests/test_examples.py::test_train_benchmark_quick",  # 47
    "tests/test_notebooks.py::test_notebook_runs[02_flax_hybrid_parallel",  # 44
    "tests/test_examples.py::test_boxing_tour_runs",  # 44
    "tests/pipeline/test_example_and_benchmark.py::test_pipeline_benchmark_quick",  # 40
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        for i, prefix in enumerate(LONGEST_FIRST):
            if item.nodeid.startswith(prefix):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep the collection's order


@pytest.fixture(scope="session")
def pl8():
    return sj.placement(8, "x")


@pytest.fixture(scope="session")
def pl24():
    return sj.placement((2, 4), ("x", "y"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the fields of a row of the joint pipeline search's results (issue 52), which
# benchmarks/pipeline_search.py writes and benchmarks/pipeline.py copies
SEARCH_ROW_FIELDS = frozenset(
    {"name", "predicted_step_s", "measured_step_s", "brute_force_step_s", "search_s", "layers", "devices"}
)


def run_script(args, timeout, fast_compile=True):
    """Run ``python *args`` from the repository root on 8 CPU devices (raises
    on a non-zero exit); the examples' and benchmarks' smoke tests use it.
    ``fast_compile``: with ``FAST_COMPILE_FLAGS`` (False for a test that
    asserts how fast a program runs)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=xla_flags(8, fast_compile))
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )


def run_launcher(command, env, timeout):
    """``(returncode, stdout, stderr)`` of ``command`` (an ``sbpjax.launch``
    run). One still running after ``timeout`` seconds is stopped with SIGTERM,
    on which the launcher stops its processes (killed, it left them running,
    and later launches hung), and ``subprocess.TimeoutExpired`` is raised."""
    import subprocess

    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=60)
        raise
    return proc.returncode, stdout, stderr


def nnx_single_device(model, optimizer, loss_fn, batches):
    """The plain NNX program on one device, the reference for sbpjax.flax
    training: its losses and final parameters (a pure dict of numpy arrays)."""
    import jax
    from flax import nnx

    opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, b)) for b in batches]
    return losses, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def assert_close(actual, desired, *, rtol, scale=None, err_msg=""):
    """``np.testing.assert_allclose`` with an ``atol`` scaled to the values:
    ``rtol`` times the largest ``|desired|``, or times ``scale`` when the
    result was computed from larger operands (a gradient that is zero
    analytically, such as a bias before a BatchNorm, is rounding noise of the
    other terms).

    A float result that is a sum depends on the summation order, which differs
    between machines, partitionings and XLA versions; its error is a few ulps
    of the largest terms, not of the result, so an element that happens to
    land near zero (a matmul entry of -0.0084 among entries of order 1) can
    miss a purely relative tolerance while being exact to the precision of the
    computation."""
    desired = np.asarray(desired, dtype=np.float64)
    own = float(np.max(np.abs(desired))) if desired.size else 0.0
    scale = max(own, float(scale or 0.0))
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), desired, rtol=rtol, atol=rtol * scale, err_msg=err_msg
    )


def load_module(path, name: str, imports_from=None):
    """The Python file ``path`` as a module named ``name`` (benchmarks/ and
    examples/ are not packages), registered in ``sys.modules`` because
    dataclasses look their module up there. ``imports_from``: a folder put
    first on ``sys.path`` while it runs, for its imports of its neighbours."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    if imports_from is not None:
        sys.path.insert(0, str(imports_from))
    try:
        spec.loader.exec_module(module)
    finally:
        if imports_from is not None:
            sys.path.remove(str(imports_from))
    return module


def xla_peak(compiled) -> int:
    """Per-device memory of a compiled program by XLA's ``memory_analysis()``:
    arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def moved_bytes(f, *args) -> int:
    """Bytes the compiled program of ``f`` (an ``sj.jit``) moves for ``args``:
    its collectives, as ``explain().bytes`` counts them."""
    import sbpjax as sj

    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def checked_step_bytes(f, step, args, *, rtol, scale=None, err_msg="") -> int:
    """The bytes the compiled ``f`` (an ``sj.jit`` of ``step``) moves, after
    checking its results against ``jax.jit(step)`` on one device and its
    compiled collectives against ``explain()``'s count. ``scale``: as
    ``assert_close``'s (an optimizer step's size, for results near zero)."""
    got = jax.tree.map(lambda t: t.numpy(), f(*args), is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
    want = jax.jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w, rtol=rtol, scale=scale, err_msg=err_msg)
    ours = sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))
    assert ours == f.explain(*args).bytes
    return ours


def gspmd_bytes(fn, pl, in_sbps, out_sbps, args) -> int:
    """Bytes GSPMD's program for ``fn`` moves (``gspmd_compiled``)."""
    return sum(c.bytes for c in sj.collectives(gspmd_compiled(fn, pl, in_sbps, out_sbps, args)))


def gspmd_compiled(fn, pl, in_sbps, out_sbps, args):
    """GSPMD's compiled program for ``fn`` (``jax.jit`` with the same layouts
    as ``NamedSharding``s): ``in_sbps`` / ``out_sbps`` are pytrees of nd-SBPs
    matching ``args`` and the outputs leaf for leaf (``out_sbps=None``: the
    outputs' layouts are GSPMD's to choose, as sj.jit's are without out_sbp)."""
    from jax.sharding import NamedSharding

    from sbpjax.boxing.plan import normalized_layout
    from sbpjax.compiler.api import is_nd_sbp
    from sbpjax.layout import Geometry

    def sharding(nd, shape):
        layout = normalized_layout(nd, len(shape), pl.shape)
        return NamedSharding(pl.mesh, Geometry(shape, pl.shape).partition_spec(layout, pl.axis_names))

    in_sh = jax.tree.map(lambda nd, a: sharding(nd, np.shape(a)), in_sbps, args, is_leaf=is_nd_sbp)
    if out_sbps is None:
        return jax.jit(fn, in_shardings=in_sh).lower(*args).compile()
    outs = jax.eval_shape(fn, *args)
    out_sh = jax.tree.map(lambda nd, o: sharding(nd, o.shape), out_sbps, outs, is_leaf=is_nd_sbp)
    return jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()
