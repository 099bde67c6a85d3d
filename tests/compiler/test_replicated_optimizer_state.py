"""Optimizer states kept replicated beside tensor-parallel parameters and a
batch split over the other axis: the gradient arrives partial over the batch's
axis, and each update reads it beside a whole state (``Domains._beside_zero_fill``).

Each step's values equal the one-device step's, and its collectives move no
more bytes than GSPMD's program with the same layouts. Nesterov momentum reads
the gradient twice (``g + mu * (g + mu * m)``); it needs the same one reduction
of the gradient as plain momentum, where the plan once added the zero-filled
momentum to the partial gradient and reduced both (1.11x GSPMD's bytes)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import checked_step_bytes, gspmd_bytes

import sbpjax as sj

S0, S1, B = sj.S(0), sj.S(1), sj.B

OPTIMIZERS = {
    "momentum": optax.sgd(0.01, momentum=0.9),
    "nesterov": optax.sgd(0.01, momentum=0.9, nesterov=True),
    "adam": optax.adam(1e-3, eps=1e-3),
    "lion": optax.lion(1e-3),
}


def _loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2


def _case(name):
    rng = np.random.default_rng(7)
    opt = OPTIMIZERS[name]
    params = {
        "w1": (rng.normal(size=(32, 64)) / 6).astype(np.float32),
        "w2": (rng.normal(size=(64, 16)) / 8).astype(np.float32),
    }
    x = rng.normal(size=(32, 32)).astype(np.float32)

    def step(p, s, x):
        g = jax.grad(_loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    params_sbp = {"w1": (B, S1), "w2": (B, S0)}  # Megatron's column / row split over y
    state_sbp = jax.tree.map(lambda _: (B, B), state)  # the state whole on every device
    in_sbp, out_sbp = (params_sbp, state_sbp, (S0, B)), (params_sbp, state_sbp)
    return step, (params, state, x), in_sbp, out_sbp


def _bytes(name):
    step, args, in_sbp, out_sbp = _case(name)
    pl = sj.placement((2, 4), ("x", "y"))
    f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp)
    return checked_step_bytes(f, step, args, rtol=1e-5, err_msg=name), gspmd_bytes(
        step, pl, in_sbp, out_sbp, args
    )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_beside_a_replicated_state_moves_no_more_than_gspmd(name):
    ours, theirs = _bytes(name)
    assert ours <= theirs, (name, ours, theirs)


def test_nesterov_reduces_the_gradient_once_as_plain_momentum_does():
    assert _bytes("nesterov")[0] == _bytes("momentum")[0]
