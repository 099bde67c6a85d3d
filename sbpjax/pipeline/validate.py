"""Checking an action list before it runs.

An action list gives each device its exact order of ``(kind, stage,
microbatch)``. The runtime follows it to the letter, so a wrong list would
stall (a backward before its forward), compute a wrong gradient (an action
twice, one missing) or hold more memory than planned. Every list is checked
here first, and a bad one gets an :class:`SBPError` naming the action:

* shape: one list per device, known kinds, each stage on its own device,
  microbatches in range, each stage's backward whole or split, not both;
* each action exactly once, and each actor's microbatches in order (the
  runtime's ``k``-th action of an actor is microbatch ``k``);
* dependencies: ``F(s, k)`` after ``F(s - 1, k)``; ``B(s, k)`` after ``F(s, k)``
  and ``B(s + 1, k)``; ``W(s, k)`` after ``B(s, k)``. Played without clocks,
  the lists must run to the end; if they cannot, the message names the action
  each blocked device waits at and what it waits for;
* register bounds: on its device's list, stage ``s`` never has more forwards
  waiting for their backward than its stash register's slots, nor more B's
  waiting for their W than its kept register's slots;
* memory: with bytes per slot and a per-device budget, the residuals and kept
  values live on each device never exceed the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sbpjax._errors import SBPError, is_count

FUSED = ("forward", "backward")
SPLIT = ("forward", "backward_input", "backward_weight")
KINDS = (*FUSED, *SPLIT[1:])


def describe(action) -> str:
    kind, s, k = action
    return f"{kind} of stage {s}, microbatch {k}"


def index_of(v, what: str, name: str = "ActionList") -> int:
    """A non-negative int (a NumPy one too); 1.7 is not truncated to 1."""
    if not is_count(v, 0):
        raise SBPError(f"{name}: {what} {v!r} is not an index; give an int >= 0.")
    return int(v)


def action_entry(a, device, i: int, name: str = "ActionList") -> tuple:
    """One ``(kind, stage, microbatch)`` entry of device ``device``'s list (an
    unknown kind is the validator's to name, with the rest of the list)."""
    kinds = sorted(set(FUSED) | set(SPLIT))
    if not (isinstance(a, (tuple, list)) and len(a) == 3 and isinstance(a[0], str)):
        raise SBPError(
            f"{name}: entry {i} of device {device}'s list is {a!r}; give (kind, stage, microbatch) "
            f"with kind one of {kinds}, e.g. ('forward', 0, 1)."
        )
    return (
        a[0],
        index_of(a[1], f"stage of entry {i} of device {device}'s list", name),
        index_of(a[2], f"microbatch of entry {i} of device {device}'s list", name),
    )


def validate_action_lists(
    lists: Mapping[int, Sequence],
    devices: int,
    microbatches: int,
    stage_devices: Sequence[int],
    *,
    stash_counts: Sequence[int] | None = None,
    kept_counts: Sequence[int] | None = None,
    slot_bytes: Mapping[int, tuple[int, int]] | None = None,
    memory_budget: float | None = None,
    name: str = "ActionList",
) -> None:
    """Raise :class:`SBPError` naming the first bad action of ``lists`` (see the module docstring).

    ``stage_devices[s]``: the device of stage ``s``. ``stash_counts`` /
    ``kept_counts``: per stage, the slots of its F-to-B and B-to-W registers.
    ``slot_bytes[s] = (residual bytes, kept bytes)`` of one microbatch, with
    ``memory_budget`` the bytes each device may hold in them."""
    lists = action_entries(lists, name)
    _check_counts(
        microbatches, len(stage_devices), stash_counts, kept_counts, slot_bytes, memory_budget, name
    )
    split = _check_shape(lists, devices, microbatches, stage_devices, name)
    _check_once(lists, microbatches, len(stage_devices), split, name)
    _check_dependencies(lists, len(stage_devices), split, name)
    _check_bounds(lists, len(stage_devices), stash_counts, kept_counts, slot_bytes, memory_budget, name)


def action_entries(lists, name: str) -> dict:
    """``lists`` with every entry a ``(kind, stage, microbatch)`` tuple of a
    str and two ints, or an SBPError naming the first that is not."""
    if not isinstance(lists, Mapping):
        raise SBPError(
            f"{name}: lists must map each device to its list of (kind, stage, microbatch) entries, got "
            f"{type(lists).__name__}."
        )
    out = {}
    for d, seq in lists.items():
        if not isinstance(seq, (list, tuple)):
            raise SBPError(f"{name}: device {d}'s list is {seq!r}; give a list of (kind, stage, microbatch).")
        out[d] = [action_entry(a, d, i, name) for i, a in enumerate(seq)]
    return out


def _check_counts(microbatches, n, stash_counts, kept_counts, slot_bytes, memory_budget, name) -> None:
    """The sizes the checks read: a positive microbatch count, one register
    size per stage, one slot size per stage where a budget is checked."""
    if not is_count(microbatches):
        raise SBPError(f"{name}: microbatches must be an int >= 1, got {microbatches!r}.")
    for what, counts in (("stash_counts", stash_counts), ("kept_counts", kept_counts)):
        if counts is not None and len(counts) != n:
            raise SBPError(f"{name}: {what} has {len(counts)} entries for {n} stages; give one per stage.")
    if slot_bytes is not None and memory_budget is not None:
        missing = [s for s in range(n) if s not in slot_bytes]
        if missing:
            raise SBPError(
                f"{name}: slot_bytes has no (residual bytes, kept bytes) for stage(s) {missing}; give one "
                "per stage."
            )


def _where(name: str, d: int, pos: int, action) -> str:
    return f"{name}: device {d}, entry {pos} ({describe(action)})"


def _check_shape(lists, devices, microbatches, stage_devices, name) -> bool:
    """Kinds, stages, devices, microbatch ranges; returns whether the backward is split."""
    if sorted(lists) != list(range(devices)):
        raise SBPError(
            f"{name}: lists are given for devices {sorted(lists)} but the pipeline has {devices} "
            f"device groups; give one list per device 0..{devices - 1}."
        )
    n = len(stage_devices)
    kinds = {kind for seq in lists.values() for kind, _, _ in seq}
    split = bool(kinds & set(SPLIT[1:]))
    for d, seq in lists.items():
        for pos, action in enumerate(seq):
            kind, s, k = action
            if kind not in KINDS:
                raise SBPError(
                    f"{_where(name, d, pos, action)}: kind {kind!r}; use 'forward' with 'backward' "
                    "(each backward whole) or with 'backward_input' and 'backward_weight' (split); "
                    "transfers, data and updates act on their own."
                )
            if split and kind == "backward":
                raise SBPError(
                    f"{_where(name, d, pos, action)}: this list splits other backwards into 'backward_input' and "
                    "'backward_weight'; split every one (B then W) or none."
                )
            if not 0 <= s < n:
                raise SBPError(f"{_where(name, d, pos, action)}: stage {s} is outside 0..{n - 1}.")
            if stage_devices[s] != d:
                raise SBPError(
                    f"{_where(name, d, pos, action)}: stage {s} runs on device {stage_devices[s]}, not {d}; "
                    f"move the entry to device {stage_devices[s]}'s list."
                )
            if not 0 <= k < microbatches:
                raise SBPError(
                    f"{_where(name, d, pos, action)}: microbatch {k} is outside 0..{microbatches - 1}."
                )
    return split


def _check_once(lists, microbatches, n, split, name) -> None:
    """Each action exactly once, each actor's microbatches in order. A missing
    action is named as missing, not as the one listed after it."""
    listed = {action for seq in lists.values() for action in seq}
    seen: dict = {}
    for d, seq in lists.items():
        for pos, action in enumerate(seq):
            if action in seen:
                d0, p0 = seen[action]
                raise SBPError(
                    f"{_where(name, d, pos, action)}: listed twice (first at device {d0}, entry {p0}); "
                    "list every action once."
                )
            seen[action] = (d, pos)
            kind, s, k = action
            if k > 0 and (kind, s, k - 1) not in seen and (kind, s, k - 1) in listed:
                raise SBPError(
                    f"{_where(name, d, pos, action)}: comes before microbatch {k - 1} of the same "
                    "kind and stage; each actor takes its microbatches 0, 1, 2, ... in turn."
                )
    kinds = SPLIT if split else FUSED
    every = [(kind, s, k) for s in range(n) for kind in kinds for k in range(microbatches)]
    missing = [a for a in every if a not in seen]
    if missing:
        shown = "; ".join(describe(a) for a in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise SBPError(
            f"{name}: {len(missing)} action(s) never appear: {shown}{more}. List every stage's "
            f"{', '.join(kinds)} for microbatches 0..{microbatches - 1}."
        )


def _needs(action, n: int) -> list:
    """The actions ``action`` waits for (on any device)."""
    kind, s, k = action
    if kind == "forward":
        return [("forward", s - 1, k)] if s > 0 else []
    if kind == "backward_weight":
        return [("backward_input", s, k)]
    after = [("forward", s, k)]
    if s < n - 1:
        after.append((kind, s + 1, k))
    return after


def _check_dependencies(lists, n, split, name) -> None:
    """Play the lists without clocks: each device runs its next action once what
    it waits for is done. If every device is blocked, name who waits for what."""
    cursor = {d: 0 for d in lists}
    done: set = set()
    left = sum(len(seq) for seq in lists.values())
    while left:
        moved = False
        for d, seq in lists.items():
            while cursor[d] < len(seq) and all(a in done for a in _needs(seq[cursor[d]], n)):
                done.add(seq[cursor[d]])
                cursor[d] += 1
                left -= 1
                moved = True
        if not moved:
            raise SBPError(_deadlock(lists, cursor, done, n, name))


def _deadlock(lists, cursor, done, n, name) -> str:
    position = {a: (d, pos) for d, seq in lists.items() for pos, a in enumerate(seq)}
    lines = []
    for d, seq in lists.items():
        if cursor[d] >= len(seq):
            continue
        action = seq[cursor[d]]
        waits = [a for a in _needs(action, n) if a not in done]
        told = ", ".join(f"{describe(a)} (device {position[a][0]}, entry {position[a][1]})" for a in waits)
        lines.append(f"  device {d}, entry {cursor[d]}: {describe(action)} waits for {told}")
    return (
        f"{name}: the lists cannot run to the end; every device waits at an action whose inputs "
        "come later:\n"
        + "\n".join(lines)
        + "\nReorder them so that each action comes after what it waits for."
    )


def _check_bounds(lists, n, stash_counts, kept_counts, slot_bytes, memory_budget, name) -> None:
    """Register slots per stage and bytes per device, along each device's list."""
    for d, seq in lists.items():
        stash = [0] * n
        kept = [0] * n
        for pos, action in enumerate(seq):
            kind, s, _ = action
            if kind == "forward":
                stash[s] += 1
                if stash_counts is not None and stash[s] > stash_counts[s]:
                    raise SBPError(
                        f"{_where(name, d, pos, action)}: stage {s} would hold {stash[s]} microbatches' "
                        f"residuals, more than its {stash_counts[s]} stash slot(s); give stash_counts[{s}] "
                        f">= {stash[s]} or run a backward earlier."
                    )
            elif kind in ("backward", "backward_input"):
                stash[s] -= 1
                # the first stage's B runs its whole backward and keeps nothing for W
                if kind == "backward_input" and s > 0:
                    kept[s] += 1
                    if kept_counts is not None and kept[s] > kept_counts[s]:
                        raise SBPError(
                            f"{_where(name, d, pos, action)}: stage {s} would keep {kept[s]} microbatches' "
                            f"values for W, more than its {kept_counts[s]} kept slot(s); run a "
                            f"backward_weight of stage {s} before it, or give kept_counts[{s}] >= {kept[s]}."
                        )
            elif s > 0:
                kept[s] -= 1
            if slot_bytes is not None and memory_budget is not None:
                held = sum(stash[t] * slot_bytes[t][0] + kept[t] * slot_bytes[t][1] for t in range(n))
                if held > memory_budget:
                    parts = " + ".join(
                        f"stage {t}: {stash[t]} x {slot_bytes[t][0]} + {kept[t]} x {slot_bytes[t][1]}"
                        for t in range(n)
                        if stash[t] or kept[t]
                    )
                    raise SBPError(
                        f"{_where(name, d, pos, action)}: device {d} would hold {held} bytes of residuals "
                        f"and kept values ({parts}), over the budget of {int(memory_budget)} bytes; run the "
                        "backwards earlier (a schedule with less in flight, e.g. 1f1b or zb-h1), or give "
                        "a larger memory_budget."
                    )
