"""The simulated clock: schedules verified exactly against their closed forms."""

import random

import numpy as np
import pytest

import sbpjax as sj
import sbpjax.pipeline as sjp

UNIFORM = [(1.0, 2.0), (1.0, 1.0), (3.0, 5.0), (0.25, 0.5)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_makespan_is_m_plus_p_minus_1_times_f_plus_b(schedule, p):
    for m in sorted({1, 2, 3, 5, 8, p, 2 * p, 4 * p}):
        for F, B in UNIFORM:
            tl = sjp.simulate(schedule, p, m, {"forward": F, "backward": B})
            assert tl.makespan == (m + p - 1) * (F + B), (schedule, p, m, F, B)
            # bubble: every device is busy m (F + B) of the makespan
            assert abs(tl.bubble - (p - 1) / (m + p - 1)) < 1e-12
            assert abs(sjp.OneFOneB().theory_bubble(p, m) - (p - 1) / (m + p - 1)) < 1e-15


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_peak_live_activation_registers(p):
    for m in range(1, 9):
        gpipe = sjp.simulate("gpipe", p, m).peak_live_activations()
        one_f_one_b = sjp.simulate("1f1b", p, m).peak_live_activations()
        assert [gpipe[i] for i in range(p)] == [m] * p
        assert [one_f_one_b[i] for i in range(p)] == [min(p - i, m) for i in range(p)]


def test_1f1b_alternates_in_the_steady_state():
    # emerges from counts: once its p - i slots are full, stage i follows each backward with one forward
    tl = sjp.simulate("1f1b", 4, 8)
    order = [
        (a.kind[0], a.microbatch)
        for a in sorted(tl.of_kind("forward", "backward"), key=lambda a: a.start)
        if a.stage == 0
    ]
    assert order[:4] == [("f", 0), ("f", 1), ("f", 2), ("f", 3)]
    assert order[4:12] == [("b", 0), ("f", 4), ("b", 1), ("f", 5), ("b", 2), ("f", 6), ("b", 3), ("f", 7)]


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_interleaved_makespan(v, p):
    for m in (p, 2 * p, 4 * p):
        for f, b in UNIFORM:
            tl = sjp.simulate(sjp.Interleaved1F1B(v), p, m, {"forward": f, "backward": b})
            # Narayanan et al. SC'21 section 2.2.2: per-chunk times f, b; makespan (v m + p - 1)(f + b)
            assert tl.makespan == (v * m + p - 1) * (f + b), (v, p, m, f, b)
            assert abs(tl.bubble - sjp.Interleaved1F1B(v).theory_bubble(p, m)) < 1e-12


def test_interleaved_lists_are_megatrons():
    lists = sjp.megatron_interleaved(2, 2, 4)
    # device 0 warms up with 2 (p - 1) + (v - 1) p = 4 forwards: chunk 0 (stage 0) then chunk 1 (stage 2)
    assert lists[0][:4] == [("forward", 0, 0), ("forward", 0, 1), ("forward", 2, 0), ("forward", 2, 1)]
    assert lists[1][:3] == [("forward", 1, 0), ("forward", 1, 1), ("forward", 3, 0)]
    for seq in lists.values():
        assert len(seq) == 2 * 2 * 4  # v m forwards and as many backwards


def test_action_list_reproduces_1f1b():
    p, m = 4, 6
    tl = sjp.simulate("1f1b", p, m)
    lists = {
        d: [
            (a.kind, a.stage, a.microbatch)
            for a in sorted(tl.of_kind("forward", "backward"), key=lambda a: a.start)
            if a.stage == d
        ]
        for d in range(p)
    }
    again = sjp.simulate(sjp.ActionList(lists), p, m)
    assert again.makespan == tl.makespan == (m + p - 1) * 3.0
    assert again.peak_live_activations() == tl.peak_live_activations()


def test_action_list_that_cannot_finish_is_refused_before_it_runs():
    # the last stage is asked for microbatch 1's backward before its forward: never possible
    lists = {
        0: [("forward", 0, 0), ("forward", 0, 1), ("backward", 0, 0), ("backward", 0, 1)],
        1: [("forward", 1, 0), ("backward", 1, 0), ("backward", 1, 1), ("forward", 1, 1)],
    }
    with pytest.raises(sj.SBPError) as e:
        sjp.simulate(sjp.ActionList(lists), 2, 2)
    assert not isinstance(e.value, sjp.PipelineStall)  # refused by the validator, nothing ran
    assert (
        "device 1, entry 2: backward of stage 1, microbatch 1 waits for forward of stage 1, microbatch 1"
        in str(e.value)
    )


def test_bad_schedules_raise_sbperror(tmp_path):
    with pytest.raises(sj.SBPError, match="m % p == 0"):
        sjp.simulate(sjp.Interleaved1F1B(2), 4, 6)
    with pytest.raises(sj.SBPError, match="unknown pipeline schedule"):
        sjp.simulate("zigzag", 2, 2)
    with pytest.raises(sj.SBPError, match="runs on device"):
        sjp.simulate(sjp.ActionList({0: [("forward", 1, 0)], 1: []}), 2, 1)
    with pytest.raises(sj.SBPError, match="never appear"):
        sjp.simulate(sjp.ActionList({0: [("forward", 0, 0)]}), 1, 1)
    with pytest.raises(sj.SBPError, match="comes before microbatch 0"):
        sjp.simulate(
            sjp.ActionList(
                {0: [("forward", 0, 1), ("forward", 0, 0), ("backward", 0, 0), ("backward", 0, 1)]}
            ),
            1,
            2,
        )
    with pytest.raises(sj.SBPError, match="unknown action kinds"):
        sjp.simulate("1f1b", 2, 2, {"fwd": 1.0})
    with pytest.raises(sj.SBPError, match="^simulate: stash_counts"):
        sjp.simulate("1f1b", 2, 2, stash_counts=[1])
    # the errors name the function called, not the Pipeline that shares its graph builder
    with pytest.raises(sj.SBPError, match="^simulate: microbatches must be an int >= 1, got 0"):
        sjp.simulate("1f1b", 2, 0)
    with pytest.raises(sj.SBPError, match="^simulate: data_registers"):
        sjp.simulate("1f1b", 2, 2, data_registers=0)
    # counts: NumPy's ints taken, bools refused, as everywhere (_errors.is_count)
    assert sjp.simulate("1f1b", np.int64(2), 2).makespan == sjp.simulate("1f1b", 2, 2).makespan
    with pytest.raises(sj.SBPError, match="devices must be an int >= 1, got True"):
        sjp.simulate("1f1b", True, 2)
    assert sjp.Interleaved1F1B(np.int64(2)).chunks == 2
    with pytest.raises(sj.SBPError, match="chunks is the number of model stages"):
        sjp.Interleaved1F1B(True)
    with pytest.raises(sj.SBPError, match="finite numbers > 0"):
        sjp.ZeroBubbleV({"backward_weight": float("nan")})
    with pytest.raises(sj.SBPError, match="m % p == 0"):
        sjp.megatron_interleaved(2, 2, 3)
    with pytest.raises(sj.SBPError, match=r"costs has shape \(2, 3\)"):
        sjp.balance(np.ones((2, 3)), 2)
    with pytest.raises(sj.SBPError, match="no actions to draw"):
        sjp.Timeline((), (), ()).gantt(str(tmp_path / "empty.png"))


def test_slow_consumer_bounds_the_producer_to_its_register_count():
    for slots in (1, 2, 3):
        tl = sjp.simulate(
            "1f1b", 2, 8, {"load": 0.1, "put": 1.0, "forward": 0.1, "backward": 0.1}, data_registers=slots
        )
        load = sorted((a for a in tl.actions if a.actor == "load:inputs"), key=lambda a: a.microbatch)
        put = sorted((a for a in tl.actions if a.actor == "put:inputs"), key=lambda a: a.microbatch)
        stats = {r.name: r for r in tl.registers}
        assert stats["host:inputs"].peak_live == slots
        for k in range(slots, 8):
            # the loader's k-th load needs the slot the put of microbatch k - slots releases
            assert load[k].start == put[k - slots].end


def test_data_loading_overlaps_the_first_stage():
    tl = sjp.simulate("1f1b", 2, 4, {"load": 0.5, "put": 0.2, "forward": 1.0, "backward": 2.0})
    load = {a.microbatch: a for a in tl.actions if a.actor == "load:inputs"}
    fwd0 = {a.microbatch: a for a in tl.actions if a.actor == "forward0"}
    assert load[1].start < fwd0[0].end and load[1].end > fwd0[0].start  # loads k+1 while stage 0 runs k
    assert fwd0[0].start == 0.5 + 0.2


def _random_durations(rng):
    """A duration per (kind, stage, microbatch), drawn once."""
    table = {}

    def duration(kind, stage, microbatch):
        return table.setdefault((kind, stage, microbatch), rng.choice([0.0, 0.5, 1.0, 3.0, 7.0]))

    return duration


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", sjp.Interleaved1F1B(2)])
def test_random_durations_never_deadlock(schedule):
    rng = random.Random(0)
    for _ in range(30):
        p = rng.choice([2, 4])
        m = p * rng.choice([1, 2, 3])
        tl = sjp.simulate(schedule, p, m, _random_durations(rng))
        n_stages = p * (2 if isinstance(schedule, sjp.Interleaved1F1B) else 1)
        assert len(tl.of_kind("forward")) == len(tl.of_kind("backward")) == n_stages * m
        assert len(tl.of_kind("update")) == n_stages


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib")
    tl = sjp.simulate(sjp.Interleaved1F1B(2), 2, 4)
    path = tl.gantt(str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "bubble" in str(tl)


@pytest.mark.parametrize(
    "durations",
    [
        {"forward": float("nan"), "backward": 2.0},
        {"forward": 1.0, "backward": float("inf")},
        lambda kind, s, k: None,
    ],
    ids=["nan", "inf", "none"],
)
def test_a_duration_that_is_no_finite_number_is_refused(durations):
    """NaN passed a test of d < 0 and gave a makespan of 0 and a NaN bubble;
    None was a raw TypeError."""
    with pytest.raises(sj.SBPError, match=r"durations must be finite numbers of seconds >= 0"):
        sjp.simulate("1f1b", 4, 8, durations)
