"""``sj.jit``'s static arguments (sbpjax/compiler/static_args.py), held to
``jax.jit``'s: each distinct value traces and plans one program whose values
equal the function run on one device, a repeated value reuses it, names and
positions are matched through the signature, ``in_sbp`` describes the other
positional arguments and ``donate_argnums`` counts them all, and bad settings
or values are SBPErrors that leave the function working."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, moved_bytes

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler.static_args import fingerprint_text

RNG = np.random.default_rng(3)
X = RNG.normal(size=(16, 8)).astype(np.float32)
W = RNG.normal(size=(8, 4)).astype(np.float32)


def make(counter):
    def f(x, mode, w, *, act="relu"):
        counter.append((mode, act))
        y = x @ w
        y = jax.nn.relu(y) if act == "relu" else jnp.tanh(y)
        return y.sum(axis=0) if mode == "sum" else y.mean(axis=0)

    return f


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_each_static_value_compiles_once_and_equals_one_device(how, pl8):
    traces: list = []
    f = make(traces)
    statics = (
        dict(static_argnums=1, static_argnames="act")
        if how == "argnums"
        else dict(static_argnames=("mode", "act"))
    )
    g = sj.jit(f, placement=pl8, in_sbp=(S(0), B), **statics)
    calls = [("sum", "relu"), ("mean", "relu"), ("sum", "tanh"), ("sum", "relu"), ("mean", "relu")]
    for mode, act in calls:
        got = g(X, mode, W, act=act).numpy()
        want = make([])(jnp.asarray(X), mode, jnp.asarray(W), act=act)
        assert_close(got, want, rtol=1e-5)
    assert sorted(set(traces)) == sorted(set(calls)) and len(traces) == 3  # one trace per value


@pytest.mark.parametrize("how", ["argnums", "argnames"])
def test_a_static_parameter_is_static_by_position_and_by_name(how, pl8):
    """Through the signature, as jax.jit: static_argnums=1 covers ``mode=``
    and static_argnames="mode" the second positional argument, one program."""
    traces: list = []

    def f(x, mode):
        traces.append(mode)
        return x * 2 if mode == "double" else x

    g = sj.jit(
        f,
        placement=pl8,
        in_sbp=S(0),
        **({"static_argnums": 1} if how == "argnums" else {"static_argnames": "mode"}),
    )
    assert_close(g(X, "double").numpy(), X * 2, rtol=1e-6)
    assert_close(g(X, mode="double").numpy(), X * 2, rtol=1e-6)
    assert_close(g(X, mode="same").numpy(), X, rtol=1e-6)
    assert traces == ["double", "double", "same"]  # positional and keyword calls: two call trees


def test_in_sbp_describes_the_dynamic_arguments(pl8):
    """As jax.jit's in_shardings: the static argument has no entry, so the
    split of x along the contraction and of w along it make a partial sum
    (one all-reduce), where a replicated w would move nothing."""
    f = lambda x, scale, w: (x @ w) * scale  # noqa: E731
    split_k = sj.jit(f, placement=pl8, in_sbp=(S(1), S(0)), out_sbp=B, static_argnums=1)
    replicated = sj.jit(f, placement=pl8, in_sbp=(S(0), B), out_sbp=S(0), static_argnums=1)
    for g in (split_k, replicated):
        assert_close(g(X, 3.0, W).numpy(), (X @ W) * 3.0, rtol=1e-5)
    assert split_k.explain(X, 3.0, W).propagation.in_sbp == [(S(1),), (S(0),)]
    assert moved_bytes(split_k, X, 3.0, W) > 0 and moved_bytes(replicated, X, 3.0, W) == 0
    with pytest.raises(sj.SBPError, match="in_sbp does not match"):
        sj.jit(f, placement=pl8, in_sbp=(S(1), None, S(0)), static_argnums=1)(X, 3.0, W)


def test_a_static_config_object_and_a_negative_position(pl8):
    @dataclasses.dataclass(frozen=True)
    class Config:
        power: int

    f = sj.jit(lambda x, cfg: x**cfg.power, placement=pl8, in_sbp=S(0), static_argnums=-1)
    for p in (2, 3, 2):
        assert_close(f(X, Config(p)).numpy(), X**p, rtol=1e-5)
    assert len(f._cache) == 2


def test_donate_argnums_count_the_static_arguments(pl8):
    step = sj.jit(
        lambda lr, p, x: (p - lr * jnp.tanh(p * x), jnp.sum(p * x)),
        placement=pl8,
        in_sbp=(S(0), S(0)),
        out_sbp=(S(0), B),
        static_argnums=0,
        donate_argnums=1,
    )
    p0 = RNG.normal(size=16).astype(np.float32)
    x = RNG.normal(size=16).astype(np.float32)
    p = sj.to_global(p0, pl8, (S(0),))
    p1, s = step(0.5, p, x)
    assert_close(p1.numpy(), p0 - 0.5 * np.tanh(p0 * x), rtol=1e-5)
    assert_close(s.numpy(), np.sum(p0 * x), rtol=1e-5)
    with pytest.raises(sj.SBPError, match="was donated"):
        p.numpy()
    p2, _ = step(0.5, p1, x)  # the result is the next call's argument
    want = p0 - 0.5 * np.tanh(p0 * x)
    assert_close(p2.numpy(), want - 0.5 * np.tanh(want * x), rtol=1e-5)
    for statics in (dict(static_argnums=0), dict(static_argnames="lr")):
        with pytest.raises(
            sj.SBPError, match=r"donate_argnums and the static arguments .* argument\(s\) \[0\]"
        ):
            sj.jit(lambda lr, p: p, placement=pl8, donate_argnums=(0, 1), **statics)
    from_the_end = sj.jit(lambda p, lr: p * lr, placement=pl8, static_argnums=-1, donate_argnums=1)
    with pytest.raises(sj.SBPError, match="names argument 1, which this call passes as a static argument"):
        from_the_end(X, 2.0)


def test_bad_settings_and_values_are_sbp_errors_that_leave_the_function_working(pl8):
    def f(x, mode="a", /, *, k=1):
        return x * k if mode == "a" else x

    with pytest.raises(sj.SBPError, match="'nope', which 'f' has no parameter"):
        sj.jit(f, placement=pl8, static_argnames="nope")
    with pytest.raises(sj.SBPError, match="positional-only parameter"):
        sj.jit(f, placement=pl8, static_argnames="mode")
    # a position the function has not (jax.jit refuses it too); with *args any position may come
    with pytest.raises(
        sj.SBPError, match=r"static_argnums=\(7,\) names position\(s\) \[7\].*takes 2 positional"
    ):
        sj.jit(f, placement=pl8, static_argnums=7)
    with pytest.raises(sj.SBPError, match=r"names position\(s\) \[-3\]"):
        sj.jit(f, placement=pl8, static_argnums=-3)
    sj.jit(lambda *xs: xs[0], placement=pl8, static_argnums=5)
    for bad in (dict(static_argnums="1"), dict(static_argnums=True), dict(static_argnames=3)):
        with pytest.raises(sj.SBPError, match="must be"):
            sj.jit(f, placement=pl8, **bad)
    g = sj.jit(f, placement=pl8, static_argnums=1, static_argnames="k")
    with pytest.raises(
        sj.SBPError, match=r"static keyword argument 'k' is \[2\] \(list\), which is not hashable"
    ):
        g(X, "a", k=[2])
    with pytest.raises(sj.SBPError, match=r"static positional argument 1 is \{\} \(dict\)"):
        g(X, {})
    assert_close(g(X, "a", k=2).numpy(), X * 2, rtol=1e-6)
    # a string left dynamic says how to make it static
    plain = sj.jit(lambda x, mode: x, placement=pl8)
    with pytest.raises(sj.SBPError, match=r"static_argnames=\('mode',\)"):
        plain(X, "eval")


def test_an_inner_function_with_static_arguments_is_inlined(pl8):
    inner = sj.jit(lambda a, n: jnp.sin(a) * n, placement=pl8, in_sbp=S(1), static_argnums=1)
    outer = sj.jit(lambda a: jnp.sum(inner(a, 3) ** 2), placement=pl8, in_sbp=S(0))
    assert_close(outer(X).numpy(), np.sum((np.sin(X) * 3) ** 2), rtol=1e-5)
    assert "S(0)->S(1)" in str(outer.explain(X))  # the inner in_sbp is a constrain point


def test_each_static_value_has_its_own_plan_cache_entry(pl8, tmp_path):
    def f(x, w, depth):
        for _ in range(depth):
            x = jnp.tanh(x @ w @ w.T)
        return x

    def compiled():
        return sj.jit(f, placement=pl8, in_sbp=(S(0), B), plan_cache=str(tmp_path), static_argnums=2)

    first = compiled()
    sources = [first.explain(X, W, d).choice.source for d in (1, 2)]
    assert sources == ["solved", "solved"]
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".json"))
    assert len(files) == 2 and all(json.loads((tmp_path / p).read_text()) for p in files)
    again = compiled()  # a fresh function, as a new process would have
    assert [again.explain(X, W, d).choice.source for d in (2, 1)] == ["plan cache", "plan cache"]
    want = np.tanh(np.tanh(X @ W @ W.T) @ W @ W.T)
    assert_close(again(X, W, 2).numpy(), want, rtol=1e-5)


def test_the_process_fingerprint_of_static_values_holds_no_address():
    class Opaque:
        pass

    a = fingerprint_text((3, ((1, "train"),), (("cfg", Opaque()),)))
    b = fingerprint_text((3, ((1, "train"),), (("cfg", Opaque()),)))
    assert a == b and "0x" not in a and "Opaque" in a
    assert fingerprint_text((2, ((1, "eval"),), ())) != fingerprint_text((2, ((1, "train"),), ()))
    assert fingerprint_text(()) == ""


def test_a_count_of_positional_arguments_leaves_static_ones_aside(pl24):
    def f(x, mode, y):
        return x + y if mode == "add" else x * y

    g = sj.jit(f, placement=pl24, in_sbp=((S(0), B), (S(0), S(1))), static_argnums=(1,))
    x = np.ones((8, 4), np.float32)
    with pytest.raises(sj.SBPError, match=r"static ones aside\) and this call passes 1 such argument"):
        g(x, "add", y=x)
