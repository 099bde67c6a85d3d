"""Zero-bubble schedules on the simulated clock: makespans equal their closed
forms, memory stays within each schedule's bound, the lists pass the validator,
and every schedule is in the registry."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import sbpjax as sj
import sbpjax.pipeline as sjp

EQUAL = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
ZB = ("zb-h1", "zb-h2", "zb-v", "dualpipev")


def _grid(name):
    for p in (1, 2, 3, 4, 8):
        for m in sorted({1, 2, 3, p, p + 1, 2 * p, 3 * p + 1, 4 * p}):
            if name == "dualpipev" and m < 2 * p:
                continue
            yield p, m


def test_registry_lists_every_schedule():
    assert tuple(sjp.SCHEDULES) == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")
    for name, cls in sjp.SCHEDULES.items():
        schedule = sjp.as_schedule(name)
        assert isinstance(schedule, cls) and schedule.name == name
        assert sjp.as_schedule(name.upper()).name == name
    with pytest.raises(sj.SBPError, match="'zb-h1'"):  # the message lists the names
        sjp.as_schedule("zb-h3")


@pytest.mark.parametrize("name", ZB)
def test_makespan_equals_the_closed_form(name):
    """At equal F, B, W (per chunk for the V schedules) and free communication:
    ZB-H1 m(F+B+W) + (p-1)(F+B-W) = 3m + p - 1 and ZB-H2 3m + p - 1 for m >= p;
    ZB-V and DualPipeV 6m + p - 1 chunk-times for m >= 2p (the last device never
    idles), ZB-V's greedy order within 2 chunk-times of it at p = 5..7."""
    schedule = sjp.as_schedule(name)
    for p in (1, 2, 3, 4, 5, 8):
        low = schedule.chunks * p
        for m in sorted({low, low + 1, 2 * low + 1, 4 * p + 3}):
            tl = sjp.simulate(schedule, p, m, EQUAL)
            want = 6 * m + p - 1 if schedule.chunks == 2 else 3 * m + p - 1
            if name == "zb-v" and 5 <= p <= 7:
                assert want <= tl.makespan <= want + 2, (p, m, tl.makespan)
                continue
            assert tl.makespan == want, (name, p, m, tl.makespan)
            assert abs(tl.bubble - schedule.theory_bubble(p, m)) < 1e-12
    tl = sjp.simulate(schedule, 3, 2 * 3 + 1, EQUAL)
    assert len(tl.of_kind("backward_input")) == len(tl.of_kind("backward_weight")) == schedule.stages(3) * 7


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-v"])
def test_no_closed_form_below_p_microbatches(name):
    """With m < p the last device idles too (one microbatch alone takes
    p F + p B + W): the formula would promise a makespan the schedule cannot
    reach, so theory_bubble gives None there, and the simulated bubble is
    above the formula's."""
    schedule = sjp.as_schedule(name)
    for p, m in [(2, 1), (4, 1), (4, 3)]:
        assert schedule.theory_bubble(p, m) is None
        formula = (p - 1) / (3 * m + p - 1) if schedule.chunks == 1 else (p - 1) / (6 * m + p - 1)
        assert sjp.simulate(schedule, p, m, EQUAL).bubble > formula
    # the V schedules' formula from m = 2p on: below it ZB-V's generated order runs longer
    # (p = 8, m = 9: by 4 chunk-times), and DualPipeV does not run at all
    assert (schedule.theory_bubble(4, 4) is None) == (schedule.chunks == 2)
    assert schedule.theory_bubble(4, 8) is not None


def test_the_v_schedules_give_no_closed_form_below_2p_microbatches():
    for p, m in [(2, 3), (4, 7), (8, 9)]:
        assert sjp.DualPipeV().theory_bubble(p, m) is None and sjp.ZeroBubbleV().theory_bubble(p, m) is None
    formula = 7 / (6 * 9 + 7)
    assert sjp.simulate("zb-v", 8, 9, EQUAL).bubble > formula  # the bubble the formula would promise


def test_zero_bubble_beats_1f1b_at_p4_m8():
    one = sjp.simulate("1f1b", 4, 8, {"forward": 1.0, "backward": 2.0}).makespan
    assert one == 33
    assert sjp.simulate("zb-h1", 4, 8, EQUAL).makespan / one == pytest.approx(27 / 33)
    half = {k: 0.5 for k in EQUAL}  # two chunks per device: each half a stage
    assert sjp.simulate("zb-v", 4, 8, half).makespan / one == pytest.approx(25.5 / 33)


def _in_flight(lists):
    """Per device, the most microbatch-chunks between a forward and its W."""
    peaks = {}
    for d, seq in lists.items():
        live = peak = 0
        for kind, _, _ in seq:
            live += {"forward": 1, "backward_weight": -1}.get(kind, 0)
            peak = max(peak, live)
        peaks[d] = peak
    return peaks


@pytest.mark.parametrize("name", ZB)
def test_memory_bounds_of_each_schedule(name):
    """ZB-H1 holds no more than 1F1B's first stage (p microbatches in flight on any
    device, p - d waiting for B on device d); ZB-H2 2p - 1; ZB-V 1F1B's memory in
    chunks (2p); DualPipeV p + 1 stages' worth (2p + 2 chunks)."""
    schedule = sjp.as_schedule(name)
    for p, m in _grid(name):
        lists = schedule.action_lists(p, m)
        flight = _in_flight(lists)
        bound = {"zb-h1": p, "zb-h2": 2 * p - 1, "zb-v": 2 * p, "dualpipev": 2 * p + 2}[name]
        assert max(flight.values()) <= bound, (name, p, m, flight)
        if name == "zb-h1":
            assert schedule.stash_counts(p, m) == [min(p - d, m) for d in range(p)]  # 1F1B's
        schedule.validate(p, m)  # the generated lists pass the validator


@pytest.mark.parametrize("name", ZB)
def test_random_durations_never_deadlock(name):
    """The lists are fixed before the run; whatever the actions take, they finish
    and every action runs once."""
    rng = random.Random(7)
    schedule = sjp.as_schedule(name)
    table: dict = {}

    def duration(kind, stage, microbatch):
        return table.setdefault((kind, stage, microbatch), rng.choice([0.0, 0.5, 1.0, 3.0, 7.0]))

    for _ in range(10):
        p = rng.choice([2, 3, 4])
        m = rng.choice([2 * p, 2 * p + 1, 3 * p])
        table.clear()
        tl = sjp.simulate(schedule, p, m, duration)
        n = schedule.stages(p)
        for kind in ("forward", "backward_input", "backward_weight"):
            assert sorted((a.stage, a.microbatch) for a in tl.of_kind(kind)) == [
                (s, k) for s in range(n) for k in range(m)
            ]


def test_w_waits_at_most_as_long_as_the_kept_register_allows():
    """Back-pressure: with fewer kept slots than the list needs, the list is
    refused naming the B that would exceed them; the register counts bound the
    B's waiting for their W in a run."""
    lists = sjp.ZeroBubbleH1().action_lists(4, 8)
    need = sjp.ZeroBubbleH1().kept_counts(4, 8)
    assert need == [1, 2, 3, 4]
    tl = sjp.simulate("zb-h1", 4, 8, EQUAL)
    assert tl.peak_live_kept() == {0: 1, 1: 2, 2: 3, 3: 4}
    with pytest.raises(
        sj.SBPError, match=r"device 3, entry \d+ \(backward_input of stage 3, microbatch 3\).*kept"
    ):
        sjp.simulate("zb-h1", 4, 8, EQUAL, kept_counts=[1, 2, 3, 3])
    assert lists[3][:4] == [
        ("forward", 3, 0),
        ("backward_input", 3, 0),
        ("forward", 3, 1),
        ("backward_input", 3, 1),
    ]


def test_the_first_stage_keeps_nothing_so_its_kept_count_bounds_nothing():
    """The first stage's B runs its whole backward (nothing waits for an input
    cotangent there), so its W reads nothing kept: its kept_counts entry is no
    bound (ZB-H2 at p = 3 was refused for kept_counts[0] = 1 although it
    holds 0 bytes there); the other stages' entries still are."""
    need = sjp.ZeroBubbleH2().kept_counts(3, 6)
    assert need[0] >= 2
    tl = sjp.simulate("zb-h2", 3, 6, EQUAL, kept_counts=[1, *need[1:]])
    assert tl.makespan == sjp.simulate("zb-h2", 3, 6, EQUAL).makespan
    with pytest.raises(sj.SBPError, match=r"stage 1 would keep .* kept_counts\[1\]"):
        sjp.simulate("zb-h2", 3, 6, EQUAL, kept_counts=[1, need[1] - 1, need[2]])
    rng = np.random.default_rng(0)
    ws = [rng.normal(size=(8, 8)).astype(np.float32) * 0.3 for _ in range(3)]
    x = rng.normal(size=(12, 8)).astype(np.float32)
    stages = [
        sjp.Stage(
            lambda w, h: h + jnp.tanh(h @ w), w, sj.Placement(np.array(jax.devices()[i : i + 1]), ("d",))
        )
        for i, w in enumerate(ws)
    ]
    mse = lambda o, t: jnp.mean((o - t) ** 2)  # noqa: E731
    pipe = sjp.Pipeline(
        stages, mse, optax.sgd(0.1), microbatches=6, schedule="zb-h2", kept_counts=[1, *need[1:]]
    )
    got = pipe.step(x, np.roll(x, 1, 1))

    def whole(ws):
        h = x
        for w in ws:
            h = h + jnp.tanh(h @ w)
        return mse(h, np.roll(x, 1, 1))

    want = jax.value_and_grad(whole)(ws)[0]
    assert_close(float(got.loss), float(want), rtol=1e-5)
    assert got.timeline.peak_kept_bytes()[0] == 0


def test_durations_split_a_whole_backward_in_half():
    a = sjp.simulate("zb-h1", 4, 8, {"forward": 1.0, "backward": 2.0})
    b = sjp.simulate("zb-h1", 4, 8, EQUAL)
    assert a.makespan == b.makespan == 27
    c = sjp.simulate("zb-h1", 4, 8, {"forward": 1.0, "backward": 2.0, "backward_weight": 0.5})
    assert {r.end - r.start for r in c.of_kind("backward_weight")} == {0.5}
    assert {r.end - r.start for r in c.of_kind("backward_input")} == {1.0}


def test_planned_durations_change_the_generated_order():
    """ZB-H2 and ZB-V plan their lists for given F/B/W lengths; planned for a short
    W, ZB-H2 meets the bound m(F+B+W) + (p-1)F at those lengths."""
    short_w = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 0.5}
    tl = sjp.simulate(sjp.ZeroBubbleH2(short_w), 4, 8, short_w)
    assert tl.makespan == 8 * 2.5 + 3
    with pytest.raises(sj.SBPError, match="unknown kinds"):
        sjp.ZeroBubbleV({"backward": 1.0})


def test_dualpipev_needs_two_microbatches_per_device():
    with pytest.raises(sj.SBPError, match="m >= 2p = 8"):
        sjp.simulate("dualpipev", 4, 6)


def test_gantt_shows_f_b_w(tmp_path):
    pytest.importorskip("matplotlib")
    tl = sjp.simulate("zb-v", 2, 4)
    assert {a.kind for a in tl.actions} >= {"forward", "backward_input", "backward_weight"}
    path = tl.gantt(str(tmp_path / "zb.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
