"""Power iteration to a tolerance, with the matrix's rows split over 8 devices.

    python examples/power_iteration.py            # n = 2048, a few seconds on CPU
    python examples/power_iteration.py --n 512

The loop stops when the estimate stops moving, so its trip count is known only
at run time: ``lax.while_loop`` cannot be written out as a scan. ``sj.jit``
runs it as a loop inside the ``shard_map`` body (sbpjax.compiler.inner_loops): the
carried vector keeps the layout it arrives in (B), the body computes
``A @ v`` on each device's rows (S(0)) and gathers the result back to B at
the end of each iteration, and the stopping test's norm is all-reduced
inside the loop. ``explain()`` shows what one iteration moves.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sbpjax as sj  # noqa: E402


def top_eigenpair(a, v0, tol=1e-6, max_iters=1000):
    """The largest eigenvalue of the symmetric ``a`` and its vector, by power
    iteration from ``v0`` until the vector moves less than ``tol``."""

    def keep_going(state):
        _, _, moved, i = state
        return (moved > tol) & (i < max_iters)

    def step(state):
        v, _, _, i = state
        w = a @ v
        lam = jnp.linalg.norm(w)
        w = w / lam
        return w, lam, jnp.linalg.norm(w - v), i + 1

    v0 = v0 / jnp.linalg.norm(v0)
    v, lam, _, iters = jax.lax.while_loop(keep_going, step, (v0, jnp.float32(0), jnp.float32(jnp.inf), 0))
    return lam, v, iters


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    args = ap.parse_args()
    n = args.n
    rng = np.random.default_rng(0)
    # a symmetric matrix with a clear gap between its two largest eigenvalues
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    eig = np.concatenate([[10.0, 5.0], rng.uniform(0, 4, size=n - 2)])
    a = ((q * eig) @ q.T).astype(np.float32)
    v0 = rng.normal(size=(n,)).astype(np.float32)

    rows = sj.placement(8, "x")
    f = sj.jit(top_eigenpair, placement=rows, in_sbp=(sj.S(0), sj.B))
    lam, v, iters = f(a, v0)
    print(f.explain(a, v0))
    print(f"iterations: {int(iters.numpy())}")
    print(
        f"largest eigenvalue: sbpjax {float(lam.numpy()):.5f}, numpy {np.linalg.eigvalsh(a.astype(np.float64))[-1]:.5f}"
    )
    ref_lam, ref_v, ref_iters = jax.jit(top_eigenpair)(a, v0)
    print(f"one device: {float(ref_lam):.5f} after {int(ref_iters)} iterations")
    compiled = f.lower(a, v0).compile()
    per_iteration = sum(c.bytes for c in sj.collectives(compiled))
    print(f"bytes per iteration: planned {f.explain(a, v0).bytes}, compiled {per_iteration}")


if __name__ == "__main__":
    main()
