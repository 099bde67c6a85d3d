"""An all-to-all's operand is computed once in the compiled program.

XLA:CPU splits an array all-to-all into one slice per peer, and its fusion
then copies the operand's whole producer into every slice (a tensor-parallel
GPT step compiled 670 extra HLO ops that way). Under jax 0.11+ the lowering
keeps the producer whole (``_On.computed_once``); these tests read the
optimized HLO and compare values with NumPy.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import PartitionSpec as P

import sbpjax as sj
from sbpjax import B, S
from sbpjax.boxing.lower import _BARRIER_KEPT, exchange_rows, run_plan
from sbpjax.boxing.plan import plan_boxing
from sbpjax.layout import Geometry

pytestmark = pytest.mark.jax_versions  # XLA keeps the barrier from jax 0.11 on


def _producer(x):
    return jnp.sin(x) * 3.0 + jnp.cos(x)


def _relaid_producer(pl, shape, src, dst):
    """A program that computes the producer on each block, then re-lays it out
    from ``src`` to ``dst`` with the plan's own lowering."""
    plan = plan_boxing(shape, np.float32, pl, src, dst)
    assert [s.op for s in plan.steps] == ["all_to_all"]
    geom = Geometry(plan.shape, pl.shape)
    names = pl.axis_names

    def body(x):
        y = _producer(x).reshape(geom.padded(plan.src_layout))
        return run_plan(plan, y).reshape(geom.block_shape(plan.dst_layout))

    in_spec = geom.partition_spec(plan.src_layout, names)
    out_spec = geom.partition_spec(plan.dst_layout, names)
    return jax.jit(jax.shard_map(body, mesh=pl.mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))


def _count(text: str, op: str) -> int:
    return len(re.findall(rf" {op}\(", text))


@pytest.mark.parametrize(
    "shape, placement, src, dst",
    [
        ((16, 64), "pl8", (S(1),), (S(0),)),  # even pieces
        ((12, 20), "pl8", (S(1),), (S(0),)),  # uneven: pieces arranged before sending
        ((8, 12, 16), "pl24", (S(2), B), (S(0), B)),  # over one axis of a 2-D placement
    ],
)
def test_the_producer_of_an_all_to_all_is_compiled_once(shape, placement, src, dst, request):
    pl = request.getfixturevalue(placement)
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    f = _relaid_producer(pl, shape, src, dst)
    physical = sj.to_global(x, pl, src).physical
    compiled = f.lower(physical).compile()
    text = compiled.as_text()
    assert _count(text, "all-to-all") == 1
    if pl.devices.flat[0].platform == "cpu" and _BARRIER_KEPT:
        # one sine, not one per peer's slice (jax 0.10's XLA drops the barrier)
        assert _count(text, "sine") == 1, f"{_count(text, 'sine')} sines in the compiled program"
    got = sj.GlobalTensor(f(physical), shape, np.float32, pl, dst).numpy()
    assert_close(got, np.sin(x) * 3.0 + np.cos(x), rtol=1e-6)


def _exchange_cases():
    """Shapes of rank 1 to 4 with one dim a multiple of the group, every
    (split dim, concat dim) pair, over one axis, the other, and both."""
    rng = np.random.default_rng(7)
    cases = []
    for axes, g in ((("y",), 4), (("x",), 2), (("x", "y"), 8)):
        for rank in (1, 2, 3, 4):
            for e in range(rank):
                for d in range(rank):
                    shape = [int(rng.integers(1, 4)) for _ in range(rank)]
                    shape[e] = g * int(rng.integers(1, 3))
                    cases.append((axes, g, tuple(shape), e, d))
    return cases


@pytest.mark.parametrize("axes, g, shape, e, d", _exchange_cases())
def test_exchange_rows_is_jaxs_tiled_all_to_all_sending_rows(pl24, axes, g, shape, e, d):
    """``exchange_rows`` against ``lax.all_to_all(tiled=True)`` itself on each
    device's own block, and the compiled all-to-all sends rows of a 2-D array
    (one contiguous piece per peer)."""
    x = np.random.default_rng(sum(shape) + 10 * e + d).normal(size=(8,) + shape).astype(np.float32)
    axis = axes[0] if len(axes) == 1 else axes

    def run(fn):
        body = lambda v: fn(v[0])[None]  # noqa: E731 (one block per device)
        mapped = jax.shard_map(body, mesh=pl24.mesh, in_specs=P(("x", "y")), out_specs=P(("x", "y")))
        return jax.jit(mapped)

    ours = run(lambda v: exchange_rows(v, axis, e, d, g))
    theirs = run(lambda v: jax.lax.all_to_all(v, axis, split_axis=e, concat_axis=d, tiled=True))
    np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(theirs(x)))
    text = ours.lower(x).compile().as_text()
    sent = re.findall(r" all-to-all\(([^)]*)\)", text)
    assert len(sent) == 1
    assert (
        re.findall(r"f32\[([\d,]+)\]", re.search(r"= \(([^)]*)\) all-to-all", text).group(1))
        == [f"1,{x[0].size // g}"] * g
    )
