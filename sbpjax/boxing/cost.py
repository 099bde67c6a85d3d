"""The alpha-beta time model of ring collectives (AutoDDL section 3, Table 2).

For ``p`` devices, latency ``alpha`` (seconds) and inverse bandwidth ``beta``
(seconds per byte), with ``n`` the bytes each device holds:

* all-reduce: ``2(p-1) alpha + 2 (p-1)/p n beta``;
* all-gather (n = gathered output), reduce-scatter and all-to-all (n = input):
  ``(p-1) alpha + (p-1)/p n beta``;
* one point-to-point round sending ``n`` bytes: ``alpha + n beta``.

Each placement axis may have its own alpha and beta (e.g. NVLink inside a node,
the network between nodes). A collective over several axes at once runs at the
slowest of them (largest alpha and beta).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np

from sbpjax._errors import SBPError

DEFAULT_ALPHA = 1e-5  # 10 us latency
DEFAULT_BETA = 1e-10  # 10 GB/s


@dataclasses.dataclass(frozen=True)
class CostModel:
    """alpha/beta per placement axis name; ``default_*`` for axes not listed.

    ``CostModel(alpha={"node": 2e-5, "gpu": 2e-6}, beta={"node": 8e-11, "gpu": 4e-12})``
    models 8 GPUs per node on NVLink with nodes on 100 Gb/s.
    """

    alpha: Mapping[str, float] | float = DEFAULT_ALPHA
    beta: Mapping[str, float] | float = DEFAULT_BETA
    default_alpha: float = DEFAULT_ALPHA
    default_beta: float = DEFAULT_BETA
    # Between disjoint placements (pipeline stages); None -> the slowest axis.
    transfer_alpha: float | None = None
    transfer_beta: float | None = None

    def __post_init__(self):
        # stored as Python floats (a NumPy scalar or 0-d array is accepted): the
        # plan cache keys on the model's repr, which must not depend on the type
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                value = {axis: _seconds(v, f"{name}[{axis!r}]") for axis, v in value.items()}
            else:
                value = _seconds(value, name)
            object.__setattr__(self, name, value)
        for name in ("default_alpha", "default_beta", "transfer_alpha", "transfer_beta"):
            v = getattr(self, name)
            if v is not None or not name.startswith("transfer"):
                object.__setattr__(self, name, _seconds(v, name))

    def axis_alpha(self, axis: str) -> float:
        if isinstance(self.alpha, Mapping):
            return float(self.alpha.get(axis, self.default_alpha))
        return float(self.alpha)

    def axis_beta(self, axis: str) -> float:
        if isinstance(self.beta, Mapping):
            return float(self.beta.get(axis, self.default_beta))
        return float(self.beta)

    def group(self, axes: Sequence[str]) -> tuple[float, float]:
        if not axes:
            return 0.0, 0.0
        return max(self.axis_alpha(a) for a in axes), max(self.axis_beta(a) for a in axes)

    def collective_time(
        self, op: str, axes: Sequence[str], group_size: int, nbytes: float, launches: bool = False
    ) -> float:
        """Seconds for one collective; ``nbytes`` as in the module docstring.
        ``launches=True``: one ``alpha`` (the collective's launch) in place of
        the ring's ``p-1`` (all-reduce: ``2(p-1)``) hops, the latency the
        layout choice prices; the boxing planner ranks plans of equal bytes by
        it (``sbpjax.boxing.plan.Step.tie_time``)."""
        alpha, beta = self.group(axes)
        p = group_size
        if p <= 1:
            return 0.0
        if op == "all_reduce":
            return (alpha if launches else 2 * (p - 1) * alpha) + 2 * (p - 1) / p * nbytes * beta
        if op in ("all_gather", "reduce_scatter", "all_to_all"):
            return (alpha if launches else (p - 1) * alpha) + (p - 1) / p * nbytes * beta
        raise SBPError(f"CostModel: no time formula for collective {op!r}.")

    def p2p_time(self, axes: Sequence[str], nbytes_per_round: Sequence[float]) -> float:
        alpha, beta = self.group(axes)
        return sum(alpha + n * beta for n in nbytes_per_round)

    def transfer_time(self, nbytes_per_device: float, axes: Sequence[str]) -> float:
        alpha, beta = self.group(axes)
        a = self.transfer_alpha if self.transfer_alpha is not None else alpha
        b = self.transfer_beta if self.transfer_beta is not None else beta
        return a + nbytes_per_device * b


def _seconds(value, name: str) -> float:
    """``value`` as a float of seconds, or an SBPError: a real number (a
    NumPy or JAX scalar too), finite and >= 0."""
    real = (
        not isinstance(value, (bool, np.bool_))
        and np.ndim(value) == 0
        and np.issubdtype(np.asarray(value).dtype, np.number)
        and not np.iscomplexobj(value)
    )
    seconds = float(value) if real else math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise SBPError(
            f"sj.CostModel: {name} must be a finite number of seconds >= 0 (alpha: a collective's latency, "
            f"beta: seconds per byte), got {value!r}."
        )
    return seconds


def checked_cost_model(value, where: str) -> CostModel | None:
    """``value`` (None: the default model) if it is a CostModel, else an
    SBPError naming ``where``."""
    if value is None or isinstance(value, CostModel):
        return value
    raise SBPError(
        f"{where}: cost_model must be an sj.CostModel (e.g. sj.CostModel(alpha=1e-5, beta=1e-10), or "
        f"sj.calibrate(placement) to measure one), or None for the default; got {type(value).__name__} "
        f"({value!r:.60})."
    )


DEFAULT_COST_MODEL = CostModel()


def calibrate(
    placement, sizes: Sequence[int] = (1 << 12, 1 << 15, 1 << 18, 1 << 20), repeats: int = 5
) -> CostModel:
    """Time the real collectives over each placement axis and fit alpha, beta.

    For every axis, message size and collective (all-reduce, all-gather,
    reduce-scatter, all-to-all), the median of ``repeats`` timed runs after a
    warm-up is one row ``t = a*alpha + b*beta`` of a linear system whose
    coefficients come from the ring formulas above; alpha and beta are its
    least-squares solution (AutoDDL section 3.2), clipped at 0.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec

    from sbpjax.placement import checked_placement

    checked_placement(placement, "sj.calibrate")
    names = placement.axis_names
    stacked = PartitionSpec(names)  # one row per device
    alphas, betas = {}, {}
    for axis in names:
        p = placement.axis_size(axis)
        if p == 1:
            alphas[axis], betas[axis] = 0.0, 0.0
            continue
        bodies = {
            "all_reduce": lambda x, a=axis: lax.psum(x, a),
            "all_gather": lambda x, a=axis: lax.all_gather(x, a, axis=1, tiled=True),
            "reduce_scatter": lambda x, a=axis: lax.psum_scatter(x, a, scatter_dimension=1, tiled=True),
            "all_to_all": lambda x, a=axis: lax.all_to_all(x, a, 1, 1, tiled=True),
        }
        rows, times = [], []
        for nbytes in sizes:
            n = max(p, (nbytes // 4) // p * p)  # float32 elements, a multiple of p
            for op, body in bodies.items():
                local = n // p if op == "all_gather" else n
                fn = jax.jit(
                    jax.shard_map(
                        body, mesh=placement.mesh, in_specs=stacked, out_specs=stacked, check_vma=False
                    )
                )
                x = jax.device_put(
                    jnp.ones((placement.size, local), jnp.float32), NamedSharding(placement.mesh, stacked)
                )
                fn(x).block_until_ready()
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn(x).block_until_ready()
                    samples.append(time.perf_counter() - t0)
                times.append(float(np.median(samples)))
                nb = 4 * n  # bytes in the formula: gathered output, or input
                if op == "all_reduce":
                    rows.append([2 * (p - 1), 2 * (p - 1) / p * nb])
                else:
                    rows.append([p - 1, (p - 1) / p * nb])
        sol, *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(times), rcond=None)
        alphas[axis], betas[axis] = max(float(sol[0]), 0.0), max(float(sol[1]), 0.0)
    return CostModel(alpha=alphas, beta=betas)
