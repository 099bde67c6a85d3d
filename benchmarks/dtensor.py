"""Boxing against PyTorch DTensor: the bytes of every layout conversion.

    pip install -e ".[compare]"          # PyTorch (CPU is enough), only for this benchmark
    python benchmarks/dtensor.py          # ~1 minute
    python benchmarks/dtensor.py --quick  # a 512 x 512 tensor instead of 4096 x 4096

The same pairs as ``benchmarks/boxing.py``: every pair over {S(0), S(1), B,
P, P(max), P(min)} on 8 devices in one axis, and over {S(0), S(1), B, P} per
axis on a 2x4 grid. For each pair, ``DTensor.redistribute`` converts a
float32 tensor between the two placements (``Shard(d)`` for S(d),
``Replicate()`` for B, ``Partial(op)`` for P(op)) and sbpjax plans the same
conversion (``sj.plan_boxing``); both run in this process.

How DTensor is measured: a ``TorchDispatchMode`` records each functional
collective DTensor issues (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce``, ``all_to_all_single``) with its buffer size and group, and the
bytes are priced with the same ring formulas ``sj.collectives`` applies to XLA's
programs (see ``sbpjax.comm``), summed over the 8 devices. DTensor runs on
torch's ``fake`` process group: one process plays rank 0 of 8, the
collectives are issued as on a real cluster but move nothing, so values are
not checked here (sbpjax's are, in ``benchmarks/boxing.py``). Every rank
issues the same collectives on an even mesh, so the total is 8 times rank 0's.
A pair DTensor refuses (e.g. a split to a partial) is recorded as
unsupported.

Writes ``benchmarks/results/dtensor.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _devices.py, also when imported
from _devices import simulate_devices  # noqa: E402

simulate_devices(8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError:  # pragma: no cover - the message is the point
    sys.exit('benchmarks/dtensor.py needs PyTorch: pip install -e ".[compare]" (the CPU build is enough)')

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

import sbpjax as sj  # noqa: E402
from sbpjax.boxing.plan import bytes_lower_bound  # noqa: E402

NAMES_1D = ["S(0)", "S(1)", "B", "P", "P(max)", "P(min)"]
NAMES_2D = ["S(0)", "S(1)", "B", "P"]
WORLD = 8


def torch_placement(name: str):
    if name.startswith("S("):
        return Shard(int(name[2]))
    if name == "B":
        return Replicate()
    return Partial({"P": "sum", "P(max)": "max", "P(min)": "min"}[name])


class CollectiveLog(TorchDispatchMode):
    """Prices the functional collectives issued inside it, per device (ring algorithms)."""

    def __init__(self, group_sizes: dict):
        super().__init__()
        self.group_sizes = group_sizes
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses. Declining an op on DTensors lets DTensor
        # run it and desugar it into local ops and collectives, which come back here;
        # otherwise the collectives of an op's input redistribution would go unseen.
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name != "wait_tensor" and not name.startswith("_"):
            x = args[0]
            n = x.numel() * x.element_size()
            g = self.group_sizes[args[-1]]
            per_device = {
                "all_reduce": 2 * (g - 1) / g * n,  # a buffer of n bytes
                "all_gather_into_tensor": (g - 1) * n,  # n bytes in, g n out
                "reduce_scatter_tensor": (g - 1) / g * n,  # n bytes in, n/g out
                "all_to_all_single": (g - 1) / g * n,
            }.get(name)
            if per_device is None:
                raise RuntimeError(f"unpriced collective {func}")
            self.calls.append({"op": name, "group": g, "bytes": per_device * WORLD})
        return func(*args, **(kwargs or {}))


def groups_of(mesh) -> dict:
    """Process-group name -> group size, for each mesh dimension."""
    return {mesh.get_group(d).group_name: mesh.size(d) for d in range(mesh.ndim)}


def dtensor_bytes(mesh, group_sizes, shape, src, dst):
    """Bytes DTensor's redistribute moves from ``src`` to ``dst`` (placement names), or None."""
    src_p, dst_p = [torch_placement(s) for s in src], [torch_placement(s) for s in dst]
    local = list(shape)
    for size, p in zip(mesh.shape, src_p):
        if isinstance(p, Shard):
            local[p.dim] //= size
    x = DTensor.from_local(
        torch.ones(local), mesh, src_p, run_check=False, shape=torch.Size(shape), stride=(shape[1], 1)
    )
    log = CollectiveLog(group_sizes)
    try:
        with log:
            y = x.redistribute(mesh, dst_p)
    except (RuntimeError, NotImplementedError, ValueError, AssertionError) as e:
        return None, [], f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    assert tuple(y.placements) == tuple(dst_p), (y.placements, dst_p)
    return int(round(sum(c["bytes"] for c in log.calls))), log.calls, None


def dtensor_mlp_bytes(mesh, group_sizes, n, d, h):
    """Bytes of the Megatron MLP's forward and backward with DTensor on a 2x4 mesh,
    gradients returned in their parameters' placements (as sbpjax's out_sbp asks)."""

    def leaf(local, placements, grad=False):
        v = DTensor.from_local(torch.randn(local), mesh, placements, run_check=False)
        return v.detach().requires_grad_(grad)

    w1 = leaf((d, h // 4), [Replicate(), Shard(1)], grad=True)
    w2 = leaf((h // 4, d), [Replicate(), Shard(0)], grad=True)
    x = leaf((n // 2, d), [Shard(0), Replicate()])
    t = leaf((n // 2, d), [Shard(0), Replicate()])
    log = CollectiveLog(group_sizes)
    with log:
        y = torch.nn.functional.gelu(x @ w1, approximate="tanh") @ w2
        ((y - t) ** 2).mean().backward()
        for w in (w1, w2):
            w.grad.redistribute(mesh, w.placements)  # a data-split batch leaves them partial
    return int(round(sum(c["bytes"] for c in log.calls))), [f"{c['op']}/{c['group']}" for c in log.calls]


def sbpjax_mlp_bytes(pl, n, d, h):
    """The same program compiled by sj.jit (benchmarks/compiler.py's first row): bytes read
    from the compiled program."""
    import jax
    import jax.numpy as jnp

    def loss(p, x, t):
        return jnp.mean((jax.nn.gelu(x @ p["w1"], approximate=True) @ p["w2"] - t) ** 2)

    S0, S1, B = sj.S(0), sj.S(1), sj.B
    psbp = {"w1": (B, S1), "w2": (B, S0)}
    f = sj.jit(jax.value_and_grad(loss), placement=pl, in_sbp=(psbp, (S0, B), (S0, B)), out_sbp=(None, psbp))
    z = np.zeros
    args = (
        {"w1": z((d, h), np.float32), "w2": z((h, d), np.float32)},
        z((n, d), np.float32),
        z((n, d), np.float32),
    )
    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", default=os.path.join(HERE, "results", "dtensor.json"))
    args = ap.parse_args()
    side = 512 if args.quick else 4096
    shape = (side, side)
    tensor_bytes = side * side * 4
    t0 = time.perf_counter()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    meshes = {
        "8": (init_device_mesh("cpu", (8,), mesh_dim_names=("x",)), sj.placement(8, "x")),
        "2x4": (init_device_mesh("cpu", (2, 4), mesh_dim_names=("x", "y")), sj.placement((2, 4), ("x", "y"))),
    }
    cases = [("8", (a,), (b,)) for a, b in itertools.product(NAMES_1D, NAMES_1D)]
    nd = list(itertools.product(NAMES_2D, repeat=2))
    cases += [("2x4", a, b) for a, b in itertools.product(nd, nd)]

    rows = []
    for where, src, dst in tqdm(cases, desc="pairs", unit="pair", disable=None):  # quiet in a log
        mesh, pl = meshes[where]
        d_bytes, calls, refused = dtensor_bytes(mesh, groups_of(mesh), shape, src, dst)
        src_sbp, dst_sbp = tuple(sj.parse_sbp(s)[0] for s in src), tuple(sj.parse_sbp(s)[0] for s in dst)
        plan = sj.plan_boxing(shape, np.float32, pl, src_sbp, dst_sbp)
        partial_free = not any(s.startswith("P") for s in src + dst)
        rows.append(
            {
                "placement": where,
                "src": "(" + ", ".join(src) + ")",
                "dst": "(" + ", ".join(dst) + ")",
                "sbpjax_bytes": plan.bytes,
                "dtensor_bytes": d_bytes,
                "dtensor_collectives": [f"{c['op']}/{c['group']}" for c in calls],
                "dtensor_refused": refused,
                "floor": bytes_lower_bound(shape, 4, pl, src_sbp, dst_sbp) if partial_free else None,
            }
        )

    n, d, h = (32, 64, 256) if args.quick else (256, 512, 2048)  # benchmarks/compiler.py's sizes
    mlp_dtensor, mlp_calls = dtensor_mlp_bytes(meshes["2x4"][0], groups_of(meshes["2x4"][0]), n, d, h)
    mlp = {
        "shape": {"n": n, "d": d, "h": h},
        "dtensor_bytes": mlp_dtensor,
        "dtensor_collectives": mlp_calls,
        "sbpjax_bytes": sbpjax_mlp_bytes(meshes["2x4"][1], n, d, h),
    }

    ok = [r for r in rows if r["dtensor_bytes"] is not None]
    two_d = [r for r in ok if r["placement"] == "2x4"]
    free = [r for r in ok if r["floor"] is not None]
    T = float(tensor_bytes)
    summary = {
        "tensor_bytes": tensor_bytes,
        "pairs": len(rows),
        "dtensor_supported_pairs": len(ok),
        "dtensor_refused_pairs": [f"{r['placement']} {r['src']}->{r['dst']}" for r in rows if r not in ok],
        "two_d_supported_pairs": len(two_d),
        "two_d_sbpjax_T": sum(r["sbpjax_bytes"] for r in two_d) / T,
        "two_d_dtensor_T": sum(r["dtensor_bytes"] for r in two_d) / T,
        "supported_sbpjax_T": sum(r["sbpjax_bytes"] for r in ok) / T,
        "supported_dtensor_T": sum(r["dtensor_bytes"] for r in ok) / T,
        "pairs_where_sbpjax_moves_more": [
            f"{r['placement']} {r['src']}->{r['dst']}" for r in ok if r["sbpjax_bytes"] > r["dtensor_bytes"]
        ],
        "pairs_where_dtensor_moves_more": sum(r["dtensor_bytes"] > r["sbpjax_bytes"] for r in ok),
        "no_partial_pairs": len(free),
        "no_partial_dtensor_at_floor": sum(r["dtensor_bytes"] == r["floor"] for r in free),
        "no_partial_sbpjax_at_floor": sum(r["sbpjax_bytes"] == r["floor"] for r in free),
        "no_partial_floor_T": sum(r["floor"] for r in free) / T,
        "no_partial_dtensor_T": sum(r["dtensor_bytes"] for r in free) / T,
        "torch_version": torch.__version__,
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    s = summary
    print(f"{'pair':<40}{'sbpjax |T|':>11}{'DTensor |T|':>12}  DTensor's collectives")
    for r in rows:
        shown = "refused" if r["dtensor_bytes"] is None else f"{r['dtensor_bytes'] / T:g}"
        print(
            f"{r['placement'] + ' ' + r['src'] + '->' + r['dst']:<40}{r['sbpjax_bytes'] / T:>11g}{shown:>12}  "
            + " ".join(r["dtensor_collectives"])
        )
    print(
        f"\nDTensor (torch {s['torch_version']}) converts {s['dtensor_supported_pairs']} of {s['pairs']} pairs; "
        f"on those sbpjax moves {s['supported_sbpjax_T']:g} |T|, DTensor {s['supported_dtensor_T']:g} |T|.\n"
        f"2x4: {s['two_d_sbpjax_T']:g} |T| against {s['two_d_dtensor_T']:g} |T| over {s['two_d_supported_pairs']} "
        f"pairs. Partial-free pairs at the floor: sbpjax {s['no_partial_sbpjax_at_floor']}, DTensor "
        f"{s['no_partial_dtensor_at_floor']} of {s['no_partial_pairs']}.\n"
        f"sbpjax moves more on {len(s['pairs_where_sbpjax_moves_more'])} pairs, DTensor on "
        f"{s['pairs_where_dtensor_moves_more']}.\n"
        f"Megatron MLP forward + backward on 2x4 ({n}x{d}, hidden {h}): sbpjax {mlp['sbpjax_bytes']:,} B, "
        f"DTensor {mlp['dtensor_bytes']:,} B ({' '.join(mlp_calls)})."
    )
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(
            {
                "config": {"shape": list(shape), "dtype": "float32"},
                "summary": summary,
                "megatron_mlp_fwd_bwd_2x4": mlp,
                "cases": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.output}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
