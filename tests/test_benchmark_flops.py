"""benchmarks/_hlo_flops.py: matmul and convolution FLOPs with each loop counted as it runs,
against the arithmetic of the program (XLA's cost analysis counts a loop's body once)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from conftest import load_module
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

HERE = os.path.dirname(os.path.abspath(__file__))
hlo_flops = load_module(os.path.join(HERE, "..", "benchmarks", "_hlo_flops.py"), "bench_hlo_flops")


def _scan_chain(w, x):
    def body(c, wi):
        return jnp.tanh(c @ wi), None

    c, _ = jax.lax.scan(body, x, w)
    return c.sum()


def _xla_flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return (ca[0] if isinstance(ca, (list, tuple)) else ca)["flops"]


def test_a_scans_matmuls_are_counted_once_per_iteration():
    layers, batch, d = 5, 4, 16
    compiled = jax.jit(jax.grad(_scan_chain)).lower(jnp.ones((layers, d, d)), jnp.ones((batch, d))).compile()
    one = 2 * batch * d * d  # one (batch, d) @ (d, d)
    # forward: one matmul a layer; backward: the input's and the weight's cotangents
    assert hlo_flops.loop_flops(compiled.as_text()) == 3 * layers * one
    assert _xla_flops(compiled) < 2 * 3 * one  # XLA's count: each loop's body once


def test_a_convolution_counts_its_kernel_per_output_element():
    x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 5))
    conv = lambda x, k: jax.lax.conv_general_dilated(  # noqa: E731
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    compiled = jax.jit(conv).lower(x, k).compile()
    assert hlo_flops.loop_flops(compiled.as_text()) == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)


def test_an_spmd_programs_count_is_per_device():
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("x",))
    w = jnp.ones((3, 32, 32))
    x = jax.device_put(jnp.ones((8 * n, 32)), NamedSharding(mesh, PS("x")))
    compiled = jax.jit(jax.grad(_scan_chain, argnums=1)).lower(w, x).compile()
    # the batch split n ways: forward and the input's cotangent, per device
    assert np.isclose(hlo_flops.loop_flops(compiled.as_text()), 2 * 3 * (2 * 8 * 32 * 32))
