"""Bad arguments to the public API: each is an SBPError that says what was
wrong, where, and how to write it, raised where the argument enters (not as
an AttributeError or TypeError deep inside the planner), and the function it
was given to still works when called correctly."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from flax import nnx

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, P, S

X = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
W = np.ones((8, 4), np.float32)


def matmul(x, w):
    return x @ w


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cost_model="fast"), r"cost_model must be an sj.CostModel .*sj.calibrate\(placement\).*got str"),
        (
            dict(memory_budget=math.inf),
            r"memory_budget must be a positive, finite number .*None for no budget",
        ),
        (dict(memory_budget=-1), r"memory_budget must be a positive"),
    ],
)
def test_sj_jit_refuses_bad_settings_where_they_are_given(kwargs, match, pl8):
    with pytest.raises(sj.SBPError, match=match):
        sj.jit(matmul, placement=pl8, in_sbp=(S(0), B), **kwargs)


@pytest.mark.parametrize("name", ["zero_fill_weight", "fewer_collectives", "gather_share"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_compile_options_take_finite_numbers_only(name, value):
    # NaN passed the old check (nan < 0 is False) and priced plans at NaN
    with pytest.raises(sj.SBPError, match=rf"CompileOptions: {name} must be a finite number >= 0"):
        sj.CompileOptions(**{name: value})


def test_compile_options_name_a_setting_they_do_not_have():
    """A misspelt setting is an SBPError naming the close one and every
    setting (it was Python's TypeError); dataclasses.replace still works."""
    with pytest.raises(
        sj.SBPError,
        match=r"no setting 'efort' \('efort': did you mean 'effort'\?\); its settings are effort,",
    ):
        sj.CompileOptions(efort=3)
    with pytest.raises(sj.SBPError, match=r"no setting 'speed'; its settings"):
        sj.CompileOptions(speed=1)
    import dataclasses

    assert dataclasses.replace(sj.CompileOptions(effort=5), latency=False) == sj.CompileOptions(
        effort=5, latency=False
    )


def test_an_argument_in_a_partial_its_dtype_cannot_take_is_named_as_the_argument(pl8, tmp_path):
    """A bool mask given P (sum) in in_sbp is named as the argument, not by
    to_global; a donated tensor given to checkpoint.save is named by that
    call, not by to_jax()."""
    with pytest.raises(
        sj.SBPError, match=r"sj.jit in_sbp of argument args\[0\]\['mask'\]: P .*not supported for dtype bool"
    ):
        sj.jit(lambda m: m["mask"].any(), placement=pl8, in_sbp=({"mask": sj.P},))({"mask": np.ones(8, bool)})
    from sbpjax import checkpoint

    pytest.importorskip("orbax.checkpoint")
    f = sj.jit(lambda w: w * 2, placement=pl8, in_sbp=S(0), donate_argnums=0)
    t = sj.to_global(np.ones(8, np.float32), pl8, S(0))
    f(t)
    with pytest.raises(sj.SBPError, match=r"checkpoint.save of leaf 'w': .*has been deleted: it was donated"):
        checkpoint.save(tmp_path / "c", {"w": t})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=-1.0), r"CostModel: alpha must be a finite number of seconds >= 0"),
        (dict(beta=math.nan), r"CostModel: beta must be"),
        (dict(alpha={"x": 1e-5, "y": math.inf}), r"CostModel: alpha\['y'\] must be"),
        (dict(transfer_beta=-1e-9), r"CostModel: transfer_beta must be"),
    ],
)
def test_cost_model_values_are_checked(kwargs, match):
    with pytest.raises(sj.SBPError, match=match):
        sj.CostModel(**kwargs)
    assert sj.CostModel(alpha={"x": 0.0}, beta=1e-10).axis_alpha("x") == 0.0  # zero is a valid fit
    # NumPy and JAX scalars (a calibrated fit, a computed value) are seconds too, kept as floats
    for value in (np.float32(2e-5), jnp.float32(2e-5), np.array(2e-5), {"x": np.float64(2e-5)}):
        model = sj.CostModel(alpha=value)
        assert type(model.axis_alpha("x")) is float and abs(model.axis_alpha("x") - 2e-5) < 1e-12


def test_calibrate_names_its_placement_argument():
    with pytest.raises(sj.SBPError, match=r"sj.calibrate: placement must be an sj.Placement, got str"):
        sj.calibrate("pl")


def test_constrain_checks_its_layout_and_the_dtype_it_may_take(pl24):
    x = np.ones((8, 8), np.float32)
    for bad, says in [
        (5, r"sj.constrain: sbp must be an nd-SBP, one entry per placement axis"),
        (None, r"sj.constrain: sbp must be an nd-SBP, one entry per placement axis"),
        ([S(0), 3], r"sj.constrain: sbp: 3 is not an SBP; use sj.S\(d\)"),  # the entry, as sbp.as_sbp says
    ]:
        f = sj.jit(lambda a, bad=bad: sj.constrain(a * 2, bad), placement=pl24, in_sbp=((S(0), B),))
        with pytest.raises(sj.SBPError, match=says):
            f(x)
    # a partial of a dtype that has none: refused as out_sbp refuses it, naming the line
    cases = [
        (lambda a: a > 0, (P, B), "bool"),
        (lambda a: a.astype(jnp.complex64), (sj.P_max, B), "complex64"),
    ]
    for make, nd, name in cases:
        f = sj.jit(lambda a, make=make, nd=nd: sj.constrain(make(a), nd), placement=pl24, in_sbp=((S(0), B),))
        with pytest.raises(sj.SBPError, match=rf"sj.constrain at .*test_argument_checks.py.*dtype {name}"):
            f(x)


def test_a_call_that_does_not_match_in_sbp_says_how_and_the_function_still_runs(pl8):
    f = sj.jit(matmul, placement=pl8, in_sbp=((S(0),), (B,)))
    with pytest.raises(sj.SBPError, match=r"in_sbp has 2 entries .* this call passes 1 such argument\."):
        f(X)
    with pytest.raises(sj.SBPError, match=r"this call passes 3 such arguments"):
        f(X, W, W)
    g = sj.jit(matmul, placement=pl8, in_sbp=((S(0),), (B,)), out_sbp=((S(0),), (B,)))
    with pytest.raises(sj.SBPError, match=r"out_sbp is a tuple of 2 entries where the value is one array"):
        g(X, W)
    assert_close(f(X, W).numpy(), X @ W, rtol=1e-6)  # nothing half-done by the failed calls


def test_a_function_returning_a_non_array_is_named():
    def named_step(x):
        return x * 2, {"tag": "done"}

    f = sj.jit(named_step, placement=sj.placement(8, "d"), in_sbp=(S(0),))
    with pytest.raises(
        sj.SBPError, match=r"named_step \(.*test_argument_checks.py:\d+\) returned a str at output\[1\]"
    ):
        f(X)

    def inner_tag(x):  # the str comes from a jax.jit inside: JAX's error names that call, not inner_tag
        return jax.jit(lambda y: (y, "tag"))(x)[0]

    with pytest.raises(TypeError, match="not a valid JAX type"):
        sj.jit(inner_tag, placement=sj.placement(8, "d"), in_sbp=(S(0),))(X)


def test_collectives_wants_a_compiled_program(pl8):
    f = sj.jit(matmul, placement=pl8, in_sbp=(S(0), B))
    with pytest.raises(
        sj.SBPError, match=r"expected a compiled program, got CompiledFunction.*f.lower\(\*args\)"
    ):
        sj.collectives(f)
    with pytest.raises(sj.SBPError, match=r"not an HLO module"):
        sj.collectives("abc")
    assert sj.collectives(f.lower(X, W).compile()) == []  # rows split, w whole: nothing moves


def _make():
    return nnx.Linear(8, 4, rngs=nnx.Rngs(0))


def _loss(m, b):
    return ((m(b[0]) - b[1]) ** 2).mean()


BATCH = (X, np.zeros((16, 4), np.float32))


@pytest.mark.parametrize(
    "model, kwargs, match",
    [
        (
            _make,
            dict(optimizer="adam"),
            r"Trainer: optimizer must be an optax GradientTransformation .*got str",
        ),
        (_make, dict(compute_dtype="bf16"), r"Trainer: compute_dtype must be a floating dtype .*got 'bf16'"),
        (_make, dict(compute_dtype=jnp.int32), r"Trainer: compute_dtype must be a floating dtype"),
        (_make, dict(cost_model=3), r"Trainer: cost_model must be an sj.CostModel"),
        (lambda: {"w": np.ones(3, np.float32)}, {}, r"Trainer: model must be a Flax NNX Module .*got dict"),
        (lambda: nnx.Dropout(0.1), {}, r"Trainer: the model \(Dropout\) has no nnx.Param to train"),
    ],
)
def test_trainer_refuses_what_would_train_nothing_or_fail_later(model, kwargs, match, pl24):
    args = dict(optimizer=optax.sgd(0.1), batch_sbp=(S(0), B)) | kwargs
    optimizer = args.pop("optimizer")
    with pytest.raises(sj.SBPError, match=match):
        sjf.Trainer(model(), optimizer, _loss, pl24, **args)


def test_trainer_create_wants_a_factory_not_a_model(pl24):
    with pytest.raises(
        sj.SBPError, match=r"model_factory must be a function .*got Linear \(a model: pass it to"
    ):
        sjf.Trainer.create(_make(), optax.sgd(0.1), _loss, pl24, batch_sbp=(S(0), B))
    t = sjf.Trainer.create(_make, optax.sgd(0.1), _loss, pl24, batch_sbp=(S(0), B))
    want = jax.jit(_loss)(_make(), BATCH)
    assert_close(np.asarray(t.step(BATCH)), np.asarray(want), rtol=1e-5)


def test_auto_is_true_or_false(pl8):
    with pytest.raises(sj.SBPError, match=r"auto must be True .* or False, got 'no'"):
        sj.jit(matmul, placement=pl8, auto="no")


def test_a_batch_sbp_typo_is_refused_when_the_step_is_built(pl24):
    """A batch_sbp that cannot be read is an SBPError naming batch_sbp when
    the Trainer or TrainStep is built, before any state is placed; it was
    raised at the first step, as parse_sbp's message alone."""
    with pytest.raises(sj.SBPError, match=r"Trainer: batch_sbp='S\(0\), X': .*cannot read 'X'"):
        sjf.Trainer(_make(), optax.sgd(0.1), _loss, pl24, batch_sbp="S(0), X")
    with pytest.raises(sj.SBPError, match=r"TrainStep: batch_sbp=.*cannot read 'Y'"):
        sjf.TrainStep(_loss, optax.sgd(0.1), pl24, {"w": (B, S(1))}, ("S(0), Y", "S(0), B"))


def test_sj_jit_refuses_what_cannot_be_called_when_it_is_made(pl8):
    with pytest.raises(sj.SBPError, match=r"sj.jit: 3 \(int\) is not callable; pass the function"):
        sj.jit(3, placement=pl8)


def test_a_bad_leaf_layout_is_reported_once_not_chained(pl8):
    """The leaf's layout error names the leaf, with no first error chained to it."""
    f = sj.jit(matmul, placement=pl8, in_sbp=(S(2), B))
    with pytest.raises(sj.SBPError, match=r"in_sbp of argument") as info:
        f(X, W)
    assert info.value.__context__ is None and info.value.__cause__ is None


def test_train_step_names_an_optimizer_state_it_did_not_make(pl24):
    """Another optimizer's state, or params and state swapped, is an SBPError
    about opt_state, not about sj.jit's in_sbp (which TrainStep users never
    write); the step still runs with the right state afterwards."""

    def loss(p, b):
        return ((b[0] @ p["w"] - b[1]) ** 2).mean()

    step = sjf.TrainStep(loss, optax.adam(1e-2), pl24, {"w": (B, S(1))}, (S(0), B))
    params, state = step.init({"w": W})
    batch = (X, np.zeros((16, 4), np.float32))
    with pytest.raises(
        sj.SBPError, match=r"TrainStep: opt_state has 1 arrays where this optimizer's state has 3"
    ):
        step(params, optax.sgd(0.1, momentum=0.9).init({"w": W}), batch)
    with pytest.raises(sj.SBPError, match=r"params and opt_state are passed in each other's place"):
        step(state, params, batch)
    want = jax.jit(
        lambda p, b: optax.apply_updates(
            p, optax.adam(1e-2).update(jax.grad(loss)(p, b), optax.adam(1e-2).init(p), p)[0]
        )
    )
    got = step(params, state, batch)[0]["w"].numpy()
    assert_close(got, np.asarray(want({"w": W}, batch)["w"]), rtol=1e-5)


def test_small_messages_say_what_was_given(pl24):
    """A dict given as an SBP is named as such (its keys were read as SBPs);
    sj.constrain outside sj.jit hands back the very array it was given; an
    explain() cell too long for its column ends in an ellipsis."""
    from sbpjax.compiler.explain import _cell

    with pytest.raises(
        sj.SBPError, match=r"\{'z': S\(0\)\} is not an SBP or a tuple of SBPs; give one SBP per"
    ):
        sj.to_global(X, pl24, {"z": S(0)})
    assert sj.constrain(X, (S(0), B)) is X
    assert _cell("S(0), S(1)->B, B [all_gather dim 0, all_gather dim 1]", 20) == "S(0), S(1)->B, B [a…"
    assert _cell("B", 4) == "B   "
