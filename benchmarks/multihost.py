"""One process with 8 devices against 2 processes with 4 each: the same boxings and train step.

    python benchmarks/multihost.py            # both runs, writes benchmarks/results/multihost.json
    python benchmarks/multihost.py --quick    # fewer repetitions

The measured program is the same in both runs (a 2x4 placement over the 8
devices, in order): a set of boxings of a 1024x1024 float32 tensor and
``sjf.Trainer`` steps of a Megatron MLP. The single-process run uses 8
simulated CPU devices; the two-process run starts through
``python -m sbpjax.launch -n 2 --local-devices 4`` (gloo between the
processes). Per item: the planned bytes (``explain()`` / ``plan.bytes``, which
must be equal across the two runs), the median wall time of a call in each
run, and their ratio (two processes / one). On one machine the processes share
its cores and talk over loopback sockets, so the ratio measures the cost of
crossing processes here, not a cluster's network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PAIRS = [("S(0), B", "B, S(1)"), ("S(0), S(1)", "B, B"), ("P, P", "S(0), S(1)"), ("S(1), S(0)", "S(0), S(1)")]


def worker(reps: int) -> None:
    """Runs in each process (or the only one); process 0 prints one JSON line."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import sbpjax as sj
    import sbpjax.flax as sjf
    from sbpjax import B, S

    pl = sj.placement((2, 4), ("x", "y"))
    x = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)
    rows = []

    def timed(fn):
        fn()  # compile
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    for src, dst in PAIRS:
        t = sj.to_global(x, pl, sj.parse_sbp(src))
        plan = sj.plan_boxing(t.shape, t.dtype, pl, t.sbp, sj.parse_sbp(dst))
        seconds = timed(
            lambda t=t, dst=dst: jax.block_until_ready(t.to_global(sbp=sj.parse_sbp(dst)).physical)
        )
        rows.append({"name": f"boxing {src} -> {dst}", "bytes": plan.bytes, "seconds": seconds})

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(256, 1024, rngs=rngs)
            self.fc2 = nnx.Linear(1024, 256, rngs=rngs)

        def __call__(self, v):
            return self.fc2(jax.nn.gelu(self.fc1(v)))

    def loss_fn(model, batch):
        v, y = batch
        return ((model(v) - y) ** 2).mean()

    rules = {"fc1.kernel": (B, S(1)), "fc1.bias": (B, S(0)), "fc2.kernel": (B, S(0))}
    trainer = sjf.Trainer.create(
        lambda: sjf.annotate(MLP(nnx.Rngs(0)), rules), optax.adamw(1e-3), loss_fn, pl, batch_sbp=(S(0), B)
    )
    v = np.random.default_rng(1).normal(size=(64, 256)).astype(np.float32)
    batch = (v, np.tanh(v))
    losses = [float(trainer.step(batch)) for _ in range(2)]
    seconds = timed(lambda: float(trainer.step(batch)))
    rows.append(
        {
            "name": "Trainer step (Megatron MLP 256-1024-256, adamw)",
            "bytes": trainer.explain(batch).bytes,
            "seconds": seconds,
            "first_losses": losses,
        }
    )
    if jax.process_index() == 0:
        print(
            "RESULT "
            + json.dumps({"processes": jax.process_count(), "devices": jax.device_count(), "rows": rows})
        )


def run(cmd, env) -> dict:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    for line in r.stdout.splitlines():
        line = line.split("] ", 1)[1] if line.startswith("[p") else line
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--output", default=os.path.join(HERE, "results", "multihost.json"))
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 20)
    if args.worker:
        worker(reps)
        return
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    me = [sys.executable, os.path.abspath(__file__), "--worker", "--reps", str(reps)]
    one = run(me, {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    two = run([sys.executable, "-m", "sbpjax.launch", "-n", "2", "--local-devices", "4", *me[1:]], env)
    rows = []
    for a, b in zip(one["rows"], two["rows"]):
        rows.append(
            {
                "name": a["name"],
                "bytes_one_process": a["bytes"],
                "bytes_two_processes": b["bytes"],
                "seconds_one_process": a["seconds"],
                "seconds_two_processes": b["seconds"],
                "time_ratio_two_vs_one": b["seconds"] / a["seconds"],
                **({"first_losses": [a["first_losses"], b["first_losses"]]} if "first_losses" in a else {}),
            }
        )
        print(
            f"{a['name']:<50} bytes {a['bytes']:>10} / {b['bytes']:>10}  "
            f"time {a['seconds'] * 1e3:8.2f} ms / {b['seconds'] * 1e3:8.2f} ms  x{b['seconds'] / a['seconds']:.2f}"
        )
    result = {"config": {"quick": args.quick, "reps": reps}, "rows": rows}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
