"""Zero-bubble schedules: the backward split into B and W, ordered as action lists.

A stage's backward is two actions (:mod:`sbpjax.pipeline.split`): **B**, the
input cotangent the previous stage waits for, and **W**, the weight cotangent
only the optimizer update waits for. Moving W later shortens the chain of
dependencies through the pipeline and lets W fill the idle time (Qi et al.,
"Zero Bubble Pipeline Parallelism", ICLR 2024; DeepSeek-V3's DualPipe).

Bubbles below are idle shares of the whole step (first action to the last,
the step ending with every stage's update), with F, B and W of equal length
per stage (per chunk for the V schedules) and free communication, as the
simulated clock measures them:

* :class:`ZeroBubbleH1` (``"zb-h1"``): 1F1B's order with W held back on later
  devices; the same peak of microbatches in flight as 1F1B's first device
  (``p``), and the makespan ``m (F + B + W) + (p - 1)(F + B - W)`` for
  ``m >= p``: a third of 1F1B's bubble at equal costs.
* :class:`ZeroBubbleH2` (``"zb-h2"``): up to ``2p - 1`` microbatches in flight on
  the first device so the start needs no idle time: the makespan is
  ``m (F + B + W) + (p - 1) F`` for ``m >= p``, the least any order reaches
  (the last device cannot start earlier, nor idle after). Equal to ZB-H1's at
  equal costs; ahead of it when W is shorter than F.
* :class:`ZeroBubbleV` (``"zb-v"``): two chunks per device in a V (stage ``s``
  and ``2p - 1 - s`` on device ``s``), so the first and last stages share
  device 0; 1F1B's memory (``2p`` chunk activations, ``p`` stages' worth) and the
  makespan ``2m (f + b + w) + (p - 1) f`` per chunk, the least possible, for
  ``m >= 2p`` (the greedy order below reaches it for p <= 4 and p = 8; at
  p = 5..7 it is up to 2 chunk-times longer).
* :class:`DualPipeV` (``"dualpipev"``): DeepSeek's DualPipe folded into a V,
  eight phases per device (warm-up forwards, forward pairs, B-W-F triples,
  the steady F&B pairs, and a cool-down whose Ws fill the tail). The F&B pairs
  overlap computation with communication on GPUs; here they run one after
  the other. Needs ``m >= 2p``; holds ``p + 1`` stages' activations; the
  makespan is ZB-V's bound.

ZB-H1 and DualPipeV are written out by rule. ZB-H2 and ZB-V come from a list
scheduler: the orders a greedy simulation of the devices gives with the
schedule's memory limit (at each free moment a device runs a ready B, else a
ready F within the limit, else a pending W; lowest microbatch first), played
with the durations the schedule is planned for (equal by default). Their
makespans are checked against the closed forms above in the tests.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from sbpjax._errors import SBPError
from sbpjax.pipeline.schedule import ActionList

F, B, W = "forward", "backward_input", "backward_weight"


def zb_h1_lists(p: int, m: int) -> dict[int, list]:
    """ZB-H1: device ``i`` warms up with ``min(p - i, m)`` forwards (1F1B's),
    then repeats B, W, F; its first ``i`` Ws wait for the tail, so its
    microbatches in flight (forward done, W not) never exceed ``p``."""
    lists = {}
    for i in range(p):
        warm = min(p - i, m)
        seq = [(F, i, k) for k in range(warm)]
        w = 0
        for b in range(m):
            seq.append((B, i, b))
            if b >= i:  # the first i Ws are held back
                seq.append((W, i, w))
                w += 1
            if warm + b < m:
                seq.append((F, i, warm + b))
        seq += [(W, i, k) for k in range(w, m)]
        lists[i] = seq
    return lists


class _Order:
    """One device's list being written: forwards and backwards in microbatch
    order per stage, and a FIFO of the Ws a zero-bubble B deferred."""

    def __init__(self):
        self.seq: list = []
        self.next: dict = {}
        self.deferred: deque = deque()

    def _take(self, kind, s) -> int:
        k = self.next.get((kind, s), 0)
        self.next[(kind, s)] = k + 1
        return k

    def forward(self, s) -> None:
        self.seq.append((F, s, self._take(F, s)))

    def backward(self, s, defer=False) -> None:
        """B, and its W at once unless ``defer``."""
        k = self._take(B, s)
        self.seq.append((B, s, k))
        (self.deferred.append if defer else self.seq.append)((W, s, k))

    def weight(self) -> None:
        self.seq.append(self.deferred.popleft())


def dualpipev_lists(p: int, m: int) -> dict[int, list]:
    """DualPipeV's eight phases on device ``r`` (chunks ``r`` and ``2p - 1 - r``).
    A B marked zero-bubble defers its W to a FIFO the later phases drain; any
    other backward runs whole (B then W at once)."""
    lists = {}
    for r in range(p):
        s0, s1, o = r, 2 * p - 1 - r, _Order()
        for _ in range(2 * (p - r - 1)):  # 1: forwards of chunk 0
            o.forward(s0)
        for _ in range(r + 1):  # 2: forwards of both chunks
            o.forward(s0)
            o.forward(s1)
        for _ in range(p - r - 1):  # 3: B, W, F of chunk 1
            o.backward(s1, defer=True)
            o.weight()
            o.forward(s1)
        for _ in range(m - 2 * p + r + 1):  # 4: the steady F&B pairs
            o.forward(s0)
            o.backward(s1)
            o.forward(s1)
            o.backward(s0)
        for _ in range(p - r - 1):  # 5: B of chunk 1, then an F&B pair
            o.backward(s1)
            o.forward(s1)
            o.backward(s0)
        for i in range(r + 1):  # 6: Bs of both chunks, Ws deferred in the second half
            o.backward(s1, defer=2 * i >= r + 1)
            o.backward(s0, defer=2 * i + 1 >= r + 1)
        for _ in range(p - r - 1):  # 7: a deferred W, then B of chunk 0
            o.weight()
            o.backward(s0, defer=True)
        while o.deferred:  # 8: the remaining Ws
            o.weight()
        lists[r] = o.seq
    return lists


def greedy_lists(
    p: int,
    m: int,
    stage_devices: list[int],
    in_flight: list[int],
    durations: Mapping[str, float],
) -> dict[int, list]:
    """The order a greedy simulation of the devices gives (see the module docstring).

    ``in_flight[d]``: the most microbatch-chunks device ``d`` holds between a
    forward and its W. Deterministic: times advance to the next completion and
    ties go to the lowest microbatch, then the highest stage."""
    n = len(stage_devices)
    never = float("inf")
    # per kind (F, B, W): the next microbatch of each stage, and when each of its actions ends
    nxt = [[0] * n for _ in range(3)]
    ends = [[[never] * m for _ in range(n)] for _ in range(3)]
    took = [durations[F], durations[B], durations[W]]
    busy_until = [0.0] * p
    held = [0] * p
    lists: dict[int, list] = {d: [] for d in range(p)}
    left, now = 3 * n * m, 0.0
    mine = [[s for s in range(n) if stage_devices[s] == d] for d in range(p)]
    f_end, b_end, w_end = ends
    while left:
        for d in range(p):
            if busy_until[d] > now:
                continue
            ready = []
            for s in mine[d]:
                k = nxt[0][s]
                if k < m and held[d] < in_flight[d] and (s == 0 or f_end[s - 1][k] <= now):
                    ready.append((1, k, -s, 0))
                k = nxt[1][s]
                if k < m and f_end[s][k] <= now and (s == n - 1 or b_end[s + 1][k] <= now):
                    ready.append((0, k, -s, 1))
                k = nxt[2][s]
                if k < m and b_end[s][k] <= now:
                    ready.append((2, k, -s, 2))
            if not ready:
                continue
            _, k, neg_s, kind = min(ready)
            s = -neg_s
            ends[kind][s][k] = busy_until[d] = now + took[kind]
            nxt[kind][s] += 1
            held[d] += (1, 0, -1)[kind]  # F holds a microbatch-chunk until its W
            lists[d].append(((F, B, W)[kind], s, k))
            left -= 1
        # a completion still ahead is its device's latest (a device starts nothing before it is
        # free), so the devices' busy times are all the times ahead
        later = [t for t in busy_until if t > now]
        if left and not later:  # every device idle with work left: the limit is too small
            raise SBPError(
                f"zero-bubble list scheduler: no order within {in_flight} microbatch-chunks in flight "
                f"per device for p={p}, m={m}; raise the limit."
            )
        now = min(later, default=now)
    return lists


def _equal(durations) -> dict:
    table = {F: 1.0, B: 1.0, W: 1.0}
    if durations is not None:
        unknown = set(durations) - set(table)
        if unknown:
            raise SBPError(
                f"zero-bubble schedule durations: unknown kinds {sorted(unknown)}; give {F!r}, {B!r}, {W!r}."
            )
        table.update({k: float(v) for k, v in durations.items()})
        if not all(math.isfinite(v) and v > 0 for v in table.values()):
            raise SBPError(f"zero-bubble schedule durations must be finite numbers > 0, got {table}.")
    return table


class _Generated(ActionList):
    """An action list built per (devices, microbatches) by a rule."""

    split_backward = True

    def __init__(self):
        self._stage_devices = None
        self._cache: dict = {}

    def action_lists(self, devices, microbatches):
        key = (devices, microbatches)
        if key not in self._cache:
            self._cache[key] = self._build(devices, microbatches)
        return self._cache[key]

    def _build(self, devices: int, microbatches: int) -> dict[int, list]:
        # the rule itself: each schedule below (ZB-H1, ZB-H2, ZB-V, DualPipeV) defines it;
        # _Generated is never used on its own (it is not in the registry)
        raise NotImplementedError(f"{type(self).__name__} defines no action-list rule")

    def stages(self, devices):
        return devices * self.chunks

    def device_of(self, stage, devices):
        return stage % devices

    def __repr__(self):
        return f"{type(self).__name__}()"


class ZeroBubbleH1(_Generated):
    """ZB-H1: 1F1B's memory, a third of its bubble (see the module docstring)."""

    name = "zb-h1"

    def _build(self, devices, microbatches):
        return zb_h1_lists(devices, microbatches)

    def theory_bubble(self, devices, microbatches):
        # makespan m (F + B + W) + (p - 1)(F + B - W) = 3m + p - 1 at equal costs (Qi et al., section 2.1)
        if microbatches < devices:
            return None
        return (devices - 1) / (3 * microbatches + devices - 1)


class ZeroBubbleH2(_Generated):
    """ZB-H2: up to ``2p - 1`` microbatches in flight, no idle start (see the module docstring).

    ``durations``: the F / B / W lengths the order is planned for
    (``{"forward": 1, "backward_input": 1, "backward_weight": 1}`` by default)."""

    name = "zb-h2"

    def __init__(self, durations: Mapping[str, float] | None = None):
        super().__init__()
        self.durations = _equal(durations)

    def _build(self, devices, microbatches):
        p = devices
        return greedy_lists(p, microbatches, list(range(p)), [2 * p - 1] * p, self.durations)

    def theory_bubble(self, devices, microbatches):
        # the last device starts after (p - 1) F and is never idle: m (F + B + W) + (p - 1) F;
        # with m < p it does idle (one microbatch alone takes p F + p B + W), and no formula is given
        if microbatches < devices:
            return None
        return (devices - 1) / (3 * microbatches + devices - 1)


class _VShape(_Generated):
    chunks = 2

    def device_of(self, stage, devices):
        return stage if stage < devices else 2 * devices - 1 - stage

    def theory_bubble(self, devices, microbatches):
        # per chunk f = b = w: the last device starts after (p - 1) f and is never idle, for
        # m >= 2p: below it the generated ZB-V order runs longer (p = 8, m = 9: 4 chunk-times),
        # and DualPipeV does not run at all
        if microbatches < 2 * devices:
            return None
        return (devices - 1) / (6 * microbatches + devices - 1)


class ZeroBubbleV(_VShape):
    """ZB-V: two chunks per device in a V, 1F1B's memory (see the module docstring).

    ``durations``: per-chunk F / B / W lengths the order is planned for."""

    name = "zb-v"

    def __init__(self, durations: Mapping[str, float] | None = None):
        super().__init__()
        self.durations = _equal(durations)

    def _build(self, devices, microbatches):
        p = devices
        return greedy_lists(
            p, microbatches, [self.device_of(s, p) for s in range(2 * p)], [2 * p] * p, self.durations
        )


class DualPipeV(_VShape):
    """DeepSeek's DualPipeV (see the module docstring); needs ``m >= 2p``."""

    name = "dualpipev"

    def check(self, devices, microbatches):
        if microbatches < 2 * devices:
            raise SBPError(
                f"DualPipeV: {microbatches} microbatches on {devices} devices; its phases need m >= 2p "
                f"= {2 * devices}. Use more microbatches or zb-v."
            )
        super().check(devices, microbatches)

    def _build(self, devices, microbatches):
        return dualpipev_lists(devices, microbatches)
