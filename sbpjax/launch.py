"""Start one program as several JAX processes on this machine (like ``torchrun``).

    python -m sbpjax.launch -n 2 --local-devices 4 train.py --steps 100

starts ``-n`` copies of ``train.py``, each a JAX process of one distributed
run: the launcher picks a free coordinator port on 127.0.0.1, gives process
``i`` its rank, and calls ``jax.distributed.initialize`` in it before the
script runs, so the script is the same one that runs on a single process
(``jax.process_count()`` tells it where it is). ``--local-devices L`` gives
every process ``L`` simulated CPU devices (``JAX_PLATFORMS=cpu``, with gloo,
JAX's CPU collectives, between processes): 2 x 4 here behaves as a small pod.

Output is streamed line by line with a ``[pI]`` prefix. When a process fails
(non-zero exit, or killed), the launcher says which and with what, stops the
others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with that
process's code, so a run never hangs on a peer that is waiting in a
collective for a process that is gone. Ctrl-C, or SIGTERM sent to the
launcher, stops every process the same way.

On a cluster, call ``jax.distributed.initialize()`` yourself (SLURM and TPU
pods are detected by JAX); nothing here is needed there. The launcher is for
testing multi-process code on one machine and for single-node runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# Run in each child before the user's script: join the distributed run, then
# run the script as __main__ with its own arguments.
_BOOT = """
import ctypes, os, runpy, sys

# Each line leaves in one write, so the launcher never reads a line of the
# script's cut by a line gloo's threads log at the same time (C's stdout).
# (Python's stderr is line-buffered already.)
sys.stdout.reconfigure(line_buffering=True)
try:
    libc = ctypes.CDLL(None)
    for name in ("stdout", "__stdoutp"):  # glibc, macOS
        try:
            libc.setvbuf(ctypes.c_void_p.in_dll(libc, name), None, 1, 0)  # 1: _IOLBF
            break
        except ValueError:
            pass
except OSError:
    libc = None
if "SBPJAX_PYTHONUNBUFFERED" in os.environ:  # for the script's own child processes
    os.environ["PYTHONUNBUFFERED"] = os.environ.pop("SBPJAX_PYTHONUNBUFFERED")


def flush_all():
    sys.stdout.flush(); sys.stderr.flush()
    if libc is not None:
        libc.fflush(None)


import jax
jax.distributed.initialize(coordinator_address=os.environ["SBPJAX_COORDINATOR"],
                           num_processes=int(os.environ["SBPJAX_NUM_PROCESSES"]),
                           process_id=int(os.environ["SBPJAX_PROCESS_ID"]))
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))


def record_failure():
    # when this process failed, on the machine's clock, for the launcher to name
    # the first process that failed (a peer fails after it, in its next collective)
    import time
    path = os.path.join(os.environ["SBPJAX_LAUNCH_FAILURES"], os.environ["SBPJAX_PROCESS_ID"])
    with open(path, "w") as f:
        f.write(repr(time.time()))


try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if code:
        record_failure()
        flush_all()
        os._exit(code)
except BaseException:
    record_failure()
    # Exit now: jax.distributed's shutdown at exit waits for the peers, which
    # may be blocked in a collective with this process; the launcher stops them.
    import traceback
    traceback.print_exc()
    flush_all()
    os._exit(1)
"""


def free_port() -> int:
    """A TCP port nothing listens on now (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(rank: int, nprocs: int, port: int, local_devices: int | None, failures: str, base=None) -> dict:
    """The environment of process ``rank`` (``failures``: the folder where a
    failing process records when it failed)."""
    env = dict(os.environ if base is None else base)
    env.update(
        SBPJAX_LAUNCH_FAILURES=failures,
        SBPJAX_COORDINATOR=f"127.0.0.1:{port}",
        SBPJAX_NUM_PROCESSES=str(nprocs),
        SBPJAX_PROCESS_ID=str(rank),
    )
    # Not for the child itself: PYTHONUNBUFFERED makes print() write each of
    # its arguments separately and C's stdout write each piece of a line, so
    # the script's lines and gloo's log came out cut into each other. _BOOT
    # line-buffers both instead (as timely) and sets it back for the script.
    if "PYTHONUNBUFFERED" in env:
        env["SBPJAX_PYTHONUNBUFFERED"] = env.pop("PYTHONUNBUFFERED")
    if local_devices is not None:
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _stream(rank: int, pipe, out, lock):
    for line in iter(pipe.readline, ""):
        with lock:
            out.write(f"[p{rank}] {line}" if line.endswith("\n") else f"[p{rank}] {line}\n")
            out.flush()
    pipe.close()


def _stop(procs, grace: float):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(left, 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(
    script: str,
    args=(),
    nprocs: int = 2,
    local_devices: int | None = None,
    port: int | None = None,
    grace: float = 10.0,
    out=None,
) -> int:
    """Run ``script`` as ``nprocs`` processes; returns the exit code (0 when all
    succeeded, else the first failure's; see the module docstring)."""
    if nprocs < 1:
        raise ValueError(f"sbpjax.launch: -n must be at least 1, got {nprocs}.")
    if not os.path.exists(script):
        raise FileNotFoundError(f"sbpjax.launch: no script {script!r}.")
    out = out or sys.stdout
    port = port or free_port()
    lock = threading.Lock()
    failures = tempfile.TemporaryDirectory(prefix="sbpjax-launch-")
    procs, readers = [], []
    for rank in range(nprocs):
        p = subprocess.Popen(
            [sys.executable, "-c", _BOOT, script, *args],
            env=child_env(rank, nprocs, port, local_devices, failures.name),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
        t = threading.Thread(target=_stream, args=(rank, p.stdout, out, lock), daemon=True)
        t.start()
        readers.append(t)
    code = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = _first_failure(failed, failures.name, procs)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                with lock:
                    out.write(f"[launch] process {rank} {how}; stopping the other processes\n")
                    out.flush()
                _stop(procs, grace)
                code = code if code > 0 else 128 - code
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        with lock:
            out.write("[launch] interrupted; stopping every process\n")
        _stop(procs, grace)
        code = 130
    for t in readers:
        t.join(timeout=5)
    failures.cleanup()
    return code


def _first_failure(failed: list, folder: str, procs: list) -> tuple[int, int]:
    """``(rank, code)`` of the process that failed first. A process whose peer
    died fails in its next collective and exits too, often within one poll of
    the first, and on a loaded machine its exit may even be seen first; so the
    times failing processes record decide (any process's: the first records
    before its exit is seen), else (a process killed by a signal records
    nothing) the lowest rank of ``failed``, the exits seen in one poll."""
    when = {}
    for rank in range(len(procs)):
        try:
            with open(os.path.join(folder, str(rank))) as f:
                when[rank] = float(f.read())
        except (OSError, ValueError):
            pass
    if not when:
        return failed[0]
    first = min(when, key=lambda r: when[r])
    try:  # it recorded its failure and exits straight after
        code = procs[first].wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = 1
    return first, code


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sbpjax.launch",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-n", "--nprocs", type=int, default=2, help="number of processes (default 2)")
    parser.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="simulated CPU devices per process (sets JAX_PLATFORMS=cpu); default: the real ones",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping processes (default 10)",
    )
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    # A scheduler (or a test's timeout) stops the launcher with SIGTERM; treat
    # it as Ctrl-C so the processes, which run in sessions of their own, are
    # stopped too rather than left running (or hung in a collective).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return launch(ns.script, ns.args, ns.nprocs, ns.local_devices, ns.port, ns.grace)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
