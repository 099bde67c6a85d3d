"""``jax.debug.print`` and ``jax.debug.callback`` inside ``sj.jit`` run once
per call with the global values, as under ``jax.jit``: the program is a
``shard_map`` body, where every device would run them (8 lines per print
on 8 devices before)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbpjax as sj
from sbpjax import S


@pytest.mark.parametrize("placement", ["pl8", "pl24"])
def test_a_callback_runs_once_per_call_with_the_global_value(placement, request):
    pl = request.getfixturevalue(placement)
    seen = []

    def f(x):
        jax.debug.callback(lambda s, row: seen.append((float(s), np.asarray(row))), x.sum(), x[0])
        return (x * 2).sum()

    in_sbp = ((S(0),),) if pl.ndim == 1 else ((S(0), S(1)),)
    g = sj.jit(f, placement=pl, in_sbp=in_sbp)
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    for _ in range(2):
        g(x).numpy()
    jax.effects_barrier()
    assert len(seen) == 2  # once per call, not once per device
    for s, row in seen:
        assert s == x.sum()
        np.testing.assert_array_equal(row, x[0])


def test_a_print_in_a_scanned_loop_prints_each_iteration_once(pl8, capfd):
    def f(x):
        jax.debug.print("start")  # no operands

        def body(c, xi):
            jax.debug.print("carry {c}", c=c)
            return c + xi.sum(), None

        return jax.lax.scan(body, jnp.float32(0), x)[0]

    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    got = sj.jit(f, placement=pl8, in_sbp=((S(0),),))(x).numpy()
    jax.effects_barrier()
    assert got == x.sum()
    lines = capfd.readouterr().out.splitlines()
    assert lines.count("start") == 1
    carries = np.concatenate([[0.0], np.cumsum(x.sum(axis=1))[:-1]])
    assert sorted(ln for ln in lines if ln.startswith("carry")) == sorted(f"carry {c}" for c in carries)


def test_an_ordered_print_is_refused_with_what_to_do(pl8):
    def f(x):
        jax.debug.print("total {s}", s=x.sum(), ordered=True)
        return x * 2

    g = sj.jit(f, placement=pl8, in_sbp=((S(0),),))
    x = np.ones((8, 4), np.float32)
    for _ in range(2):  # refused again, not half-built, on the next call
        with pytest.raises(
            sj.SBPError, match=r"jax.debug.print\('total \{s\}', ...\) asks for ordered=True.*Drop"
        ) as err:
            g(x)
        # where: the user's line of the print, once (not again on the second call)
        assert str(err.value).count(f"(at {__file__}:{f.__code__.co_firstlineno + 1}") == 1
