"""A tour of boxing: every 1-D and 2-D SBP transition on a 2x4 placement.

    python examples/boxing_tour.py            # 1024x1024 float32, all pairs
    python examples/boxing_tour.py --quick    # 64x64, and only a few plans printed in full

For each transition the script boxes a real tensor, checks that the logical
value is unchanged (NumPy on the whole array), and prints the plan: the steps
with the collective each one uses, and the bytes moved (OneFlow Table 2
convention: bytes received, summed over devices, also as a multiple of |T|).
Runs on a laptop: 8 simulated CPU devices.
"""

import argparse
import itertools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

import sbpjax as sj  # noqa: E402


def tour(pl, sbps, x, show_full):
    T = x.nbytes
    print(f"\n=== {pl!r}: {len(sbps) ** 2} transitions of a {x.shape} {x.dtype} tensor (|T| = {T} B) ===")
    print(f"{'from':<16}{'to':<16}{'bytes':>12}{'|T|':>8}{'floor|T|':>10}  steps")
    total = 0
    for src, dst in itertools.product(sbps, sbps):
        t = sj.to_global(x, pl, src)
        u = t.to_global(sbp=dst)
        np.testing.assert_array_equal(u.numpy(), x)  # the logical value is unchanged
        plan = sj.plan_boxing(x.shape, x.dtype, pl, src, dst)
        total += plan.bytes
        floor = "-" if plan.floor is None else f"{plan.floor / T:.3g}"
        steps = ", ".join(f"{s.label()}[{','.join(s.axes)}]" for s in plan.steps) or "(nothing)"
        print(
            f"{sj.format_sbp(src):<16}{sj.format_sbp(dst):<16}{plan.bytes:>12}{plan.bytes / T:>8.3g}"
            f"{floor:>10}  {steps}"
        )
    print(f"total {total / T:.4g}|T| over {len(sbps) ** 2} transitions; every value checked.")
    for src, dst in show_full:
        print()
        print(sj.plan_boxing(x.shape, x.dtype, pl, src, dst))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", type=int, default=None)
    args = ap.parse_args()
    n = args.size or (64 if args.quick else 1024)
    x = np.random.default_rng(0).integers(-100, 100, size=(n, n)).astype(np.float32)

    pl = sj.placement((2, 4), ("x", "y"))
    one_d = [sj.S(0), sj.S(1), sj.B, sj.P, sj.P_max, sj.P_min]
    # 1-D transitions over the 4 devices of one row of the grid (a sub-placement)
    tour(pl[0], [(s,) for s in one_d], x, [((sj.P_max,), (sj.S(1),))])
    two_d = list(itertools.product([sj.S(0), sj.S(1), sj.B, sj.P], repeat=2))
    interesting = [
        ((sj.S(0), sj.S(0)), (sj.B, sj.S(0))),  # conflicting nested splits
        ((sj.S(0), sj.S(1)), (sj.S(1), sj.S(0))),  # point-to-point at the floor
        ((sj.P, sj.S(0)), (sj.S(0), sj.S(0))),  # reduce-scatter into another split order
        ((sj.P, sj.P), (sj.B, sj.B)),
    ]  # hierarchical all-reduce
    tour(pl, two_d, x, interesting if not args.quick else interesting[:2])


if __name__ == "__main__":
    main()
