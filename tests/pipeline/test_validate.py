"""The action-list validator: each kind of broken list is refused before it runs,
with an SBPError naming the action; on random reorderings it agrees with the
runtime (a list it accepts runs to the end, one it refuses would stall)."""

import random

import pytest

import sbpjax as sj
import sbpjax.pipeline as sjp

F, B, W = "forward", "backward_input", "backward_weight"


def _zb(p=2, m=2):
    return {d: list(seq) for d, seq in sjp.ZeroBubbleH1().action_lists(p, m).items()}


def _refused(lists, p=2, m=2, match=None, **kw):
    with pytest.raises(sj.SBPError, match=match) as e:
        sjp.ActionList(lists).validate(p, m, **kw)
    assert not isinstance(e.value, sjp.PipelineStall)
    return str(e.value)


def test_a_valid_list_passes():
    sjp.ActionList(_zb()).validate(2, 2)
    assert sjp.ActionList(_zb()).split_backward


def test_each_kind_of_break_names_the_action():
    lists = _zb()
    _refused({0: lists[0]}, match="lists are given for devices \\[0\\] but the pipeline has 2")
    bad = _zb()
    bad[1][0] = ("fwd", 1, 0)
    _refused(bad, match="device 1, entry 0 .* kind 'fwd'")
    bad = _zb()
    bad[0][-1] = ("backward", 0, 1)
    _refused(bad, match="device 0, entry 5 \\(backward of stage 0, microbatch 1\\).*split every one")
    bad = _zb()
    bad[0][0] = (F, 1, 0)
    _refused(bad, match="device 0, entry 0 \\(forward of stage 1, microbatch 0\\): stage 1 runs on device 1")
    bad = _zb()
    bad[0][1] = (F, 0, 5)
    _refused(bad, match="device 0, entry 1 .* microbatch 5 is outside 0..1")
    bad = _zb()
    bad[0][5] = (B, 0, 1)  # B of microbatch 1 twice, its W's slot taken
    _refused(bad, match="device 0, entry 5 \\(backward_input of stage 0, microbatch 1\\): listed twice")
    bad = _zb()
    del bad[1][-1]
    _refused(bad, match="1 action\\(s\\) never appear: backward_weight of stage 1, microbatch 1")
    bad = _zb()
    bad[1].remove((W, 1, 0))  # missing, not "W of microbatch 1 comes before microbatch 0"
    _refused(bad, match="1 action\\(s\\) never appear: backward_weight of stage 1, microbatch 0")
    bad = _zb()
    bad[0][0], bad[0][1] = bad[0][1], bad[0][0]
    _refused(bad, match="device 0, entry 0 \\(forward of stage 0, microbatch 1\\): comes before microbatch 0")


def test_entries_that_are_not_actions_are_refused_when_the_list_is_made():
    for entry, says in [
        ((F, 0), r"entry 0 of device 0's list is \('forward', 0\); give \(kind, stage, microbatch\)"),
        ((F, 0, "x"), r"microbatch of entry 0 of device 0's list 'x' is not an index"),
        ((F, 0, 1.7), r"microbatch of entry 0 of device 0's list 1.7 is not an index"),  # not truncated to 1
        ((F, -1, 0), r"stage of entry 0 of device 0's list -1 is not an index"),
    ]:
        bad = _zb()
        bad[0][0] = entry
        with pytest.raises(sj.SBPError, match=says):
            sjp.ActionList(bad)
    with pytest.raises(sj.SBPError, match="stage_devices entry 'a' is not an index"):
        sjp.ActionList(_zb(), stage_devices=[0, "a"])


def test_the_validator_itself_refuses_what_is_not_a_list_of_actions():
    """sjp.validate_action_lists called directly (not through ActionList):
    malformed entries and sizes are SBPErrors naming them, not unpacking or
    index errors."""
    good = {0: [(F, 0, 0), ("backward", 0, 0)], 1: [(F, 1, 0), ("backward", 1, 0)]}
    validate = sjp.validate_action_lists
    for lists, says in [
        (
            {0: [(F, 0)], 1: []},
            r"entry 0 of device 0's list is \('forward', 0\); give \(kind, stage, microbatch\)",
        ),
        ({0: ["forward00"], 1: []}, r"entry 0 of device 0's list is 'forward00'"),
        ({0: [None], 1: []}, r"entry 0 of device 0's list is None"),
        ({0: [(F, "0", 0)], 1: []}, r"stage of entry 0 of device 0's list '0' is not an index"),
        ({0: None, 1: []}, r"device 0's list is None"),
        ([good[0], good[1]], r"lists must map each device to its list"),
    ]:
        with pytest.raises(sj.SBPError, match=says):
            validate(lists, 2, 1, [0, 1])
    with pytest.raises(sj.SBPError, match=r"stash_counts has 1 entries for 2 stages"):
        validate(good, 2, 1, [0, 1], stash_counts=[4])
    with pytest.raises(
        sj.SBPError, match=r"slot_bytes has no \(residual bytes, kept bytes\) for stage\(s\) \[1\]"
    ):
        validate(good, 2, 1, [0, 1], slot_bytes={0: (100, 0)}, memory_budget=1e6)
    with pytest.raises(sj.SBPError, match=r"microbatches must be an int >= 1, got 0"):
        validate({0: [], 1: []}, 2, 0, [0, 1])
    for lists in (None, {0: None}):
        with pytest.raises(sj.SBPError, match=r"ActionList: (lists must map|device 0's list is None)"):
            sjp.ActionList(lists)
    validate(good, 2, 1, [0, 1])


def test_dependencies_that_cannot_be_met_name_who_waits_for_what():
    bad = _zb()
    bad[1].remove((W, 1, 0))
    i = bad[1].index((B, 1, 0))
    bad[1].insert(i, (W, 1, 0))  # a W before its own B
    msg = _refused(bad, match="cannot run to the end")
    assert (
        f"device 1, entry {i}: backward_weight of stage 1, microbatch 0 waits for backward_input of stage 1"
        in msg
    )
    # across devices: stage 0's B waits for stage 1's, which waits behind a forward that waits for stage 0
    cross = {
        0: [(F, 0, 0), (B, 0, 0), (F, 0, 1), (W, 0, 0), (B, 0, 1), (W, 0, 1)],
        1: [(F, 1, 0), (F, 1, 1), (B, 1, 0), (W, 1, 0), (B, 1, 1), (W, 1, 1)],
    }
    msg = _refused(cross, match="cannot run to the end")
    assert (
        "device 0, entry 1: backward_input of stage 0, microbatch 0 waits for backward_input of stage 1"
        in msg
    )
    assert (
        "device 1, entry 1: forward of stage 1, microbatch 1 waits for forward of stage 0, microbatch 1"
        in msg
    )


def test_register_and_memory_bounds():
    lists = _zb(4, 8)
    _refused(
        lists,
        4,
        8,
        match="device 0, entry 3 \\(forward of stage 0, microbatch 3\\).*3 stash slot",
        stash_counts=[3, 3, 2, 1],
        kept_counts=[1, 2, 3, 4],
    )
    _refused(
        lists,
        4,
        8,
        match="backward_input of stage 2, microbatch 2.*2 kept slot",
        stash_counts=[4, 3, 2, 1],
        kept_counts=[1, 2, 2, 4],
    )
    slot = {s: (100, 60) for s in range(4)}
    sjp.ActionList(lists).validate(4, 8, slot_bytes=slot, memory_budget=400)  # 1F1B's first stage: 4 x 100
    msg = _refused(lists, 4, 8, match="over the budget of 399 bytes", slot_bytes=slot, memory_budget=399)
    assert "device 0" in msg and "stage 0: 4 x 100 + 0 x 60" in msg


class _Unchecked(sjp.ActionList):
    """An action list the validator never sees: the runtime alone decides."""

    def check(self, devices, microbatches):
        return None

    def validate(self, *args, **kwargs):
        return None


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipev"])
def test_validator_agrees_with_the_runtime_on_random_reorderings(name):
    """Swap random neighbours in a valid list: whenever the validator accepts the
    result, the simulated runtime (message passing, no validator) runs it to the
    end; whenever it refuses a reordering (not a duplicate or missing action:
    those are refused by count), the runtime stalls."""
    rng = random.Random(3)
    schedule = sjp.as_schedule(name)
    p, m = 2, 4
    base = schedule.action_lists(p, m)
    devices = [schedule.device_of(s, p) for s in range(schedule.stages(p))]
    seen = {True: 0, False: 0}
    for _ in range(40):
        lists = {d: list(seq) for d, seq in base.items()}
        for _ in range(rng.randint(1, 4)):
            d = rng.randrange(p)
            i = rng.randrange(len(lists[d]) - 1)
            a, b = lists[d][i], lists[d][i + 1]
            if a[:2] != b[:2]:  # keep each actor's microbatches in order
                lists[d][i], lists[d][i + 1] = b, a
        try:
            sjp.ActionList(lists, stage_devices=devices).validate(p, m)
            accepted = True
        except sj.SBPError:
            accepted = False
        graph = sjp.build_graph(
            _Unchecked(lists, stage_devices=devices),
            p,
            m,
            stash_counts=[m] * len(devices),
            kept_counts=[m] * len(devices),
        )
        try:
            sjp.simulate_graph(graph)
            ran = True
        except sjp.PipelineStall:
            ran = False
        assert accepted == ran, (lists, accepted, ran)
        seen[accepted] += 1
    assert seen[True] and seen[False]  # both verdicts were exercised
