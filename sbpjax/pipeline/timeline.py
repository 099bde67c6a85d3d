"""Timelines: every action of a run, its summary, and a Gantt chart.

Times are seconds from the start of the run (real or simulated). The bubble
is measured over the compute actions (forward, backward, and a split
backward's B and W), on the threads that run them: ``1 - busy / (threads *
span)`` with ``span`` from the first such start to the last such end; data
loading, transfers and updates are outside it so that it compares with the
schedules' theory.

Memory: the registers report the most slots and bytes each held, in bytes
per device (``tensor.bytes_per_device``: the most any one device of the
stage's group holds of each value): the
residuals a forward keeps for its backward (``peak_activation_bytes``) and,
under zero-bubble schedules, what each B keeps for its W
(``peak_kept_bytes``); ``held_bytes_over_time`` replays both from the
actions (``peak_held_bytes``: their most at once per device group), and the
Gantt chart draws the kept bytes in each device's row.
"""

from __future__ import annotations

import dataclasses

from sbpjax._errors import SBPError

COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


@dataclasses.dataclass(frozen=True)
class ActionRecord:
    """One action: which actor did what for which microbatch, and when."""

    actor: str
    kind: str
    stage: int | None
    microbatch: int | None
    thread: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class RegisterStats:
    """A register's slot count and what it held at most during the run."""

    name: str
    count: int
    peak_live: int
    peak_bytes: int
    activation: bool
    stage: int | None
    kept: bool = False  # what a B keeps for its W


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The record of one run (one training step, or one simulation)."""

    actions: tuple[ActionRecord, ...]
    registers: tuple[RegisterStats, ...]
    threads: tuple[str, ...]
    # real runs: seconds the runtime's threads spent outside action bodies
    runtime_overhead_s: float = 0.0
    # (stage, microbatch, "stash" | "kept") -> bytes its forward kept for its
    # backward (residuals), or its B for its W
    held_bytes: dict = dataclasses.field(default_factory=dict)

    @property
    def makespan(self) -> float:
        if not self.actions:
            return 0.0
        return max(a.end for a in self.actions) - min(a.start for a in self.actions)

    def of_kind(self, *kinds: str) -> list[ActionRecord]:
        return [a for a in self.actions if a.kind in kinds]

    @property
    def bubble(self) -> float:
        """Idle share of the compute threads over the forward/backward span."""
        acts = self.of_kind(*COMPUTE)
        if not acts:
            return 0.0
        threads = {a.thread for a in acts}
        span = max(a.end for a in acts) - min(a.start for a in acts)
        if span <= 0:
            return 0.0
        busy = sum(a.duration for a in acts)
        return 1.0 - busy / (len(threads) * span)

    def peak_live_activations(self) -> dict[int | None, int]:
        """Per stage: the most activation registers (forward inputs kept for the
        backward) live at once."""
        return {r.stage: r.peak_live for r in self.registers if r.activation}

    def peak_activation_bytes(self) -> dict[int | None, int]:
        """Per stage: the most bytes its live activation registers held at once."""
        return {r.stage: r.peak_bytes for r in self.registers if r.activation}

    def peak_live_kept(self) -> dict[int | None, int]:
        """Per stage: the most slots of its kept register in use at once (B
        writes a slot, its W reads it). A slot is in use until the W's read is
        acknowledged, as the buffer lives until then; in a real run the
        acknowledgement may arrive after the stage's next B, so this can be
        one more than the schedule's own count of microbatches whose B had
        run and W had not (the simulated run's: ZB-H1's first stage 1, run
        2). :meth:`peak_kept_bytes` counts the same slots' bytes (the first
        stage's B keeps none: its slots hold 0 bytes)."""
        return {r.stage: r.peak_live for r in self.registers if r.kept}

    def peak_kept_bytes(self) -> dict[int | None, int]:
        """Per stage: the most bytes B kept for W at once (zero-bubble schedules)."""
        return {r.stage: r.peak_bytes for r in self.registers if r.kept}

    def held_bytes_over_time(self, thread: str, what=("stash", "kept")) -> list[tuple[float, int]]:
        """``(time, bytes)`` steps of what the stages on ``thread`` hold between
        actions: ``"stash"``, a forward's residuals (from its end to the end of
        its backward or B), and ``"kept"``, what a B keeps for its W (to the end
        of the W)."""
        events = []
        for a in self.actions:
            if a.thread != thread or a.kind not in COMPUTE:
                continue
            gets = {"forward": "stash", "backward_input": "kept"}.get(a.kind)
            frees = {"backward": "stash", "backward_input": "stash", "backward_weight": "kept"}.get(a.kind)
            for key, sign in ((gets, 1), (frees, -1)):
                if key in what:
                    events.append((a.end, sign * self.held_bytes.get((a.stage, a.microbatch, key), 0)))
        steps, held = [], 0
        for t, delta in sorted(events):  # at equal times a release before a new hold
            held += delta
            steps.append((t, held))
        return steps

    def peak_held_bytes(self, what=("stash", "kept")) -> dict[str, int]:
        """Per thread (device group): the most bytes its stages held at once
        in residuals and kept values (see :meth:`held_bytes_over_time`)."""
        return {t: max((b for _, b in self.held_bytes_over_time(t, what)), default=0) for t in self.threads}

    @property
    def overhead_per_action_s(self) -> float:
        return self.runtime_overhead_s / max(len(self.actions), 1)

    def summary(self) -> dict:
        """Makespan, bubble, peak live registers per stage, time per kind."""
        per_kind: dict[str, float] = {}
        for a in self.actions:
            per_kind[a.kind] = per_kind.get(a.kind, 0.0) + a.duration
        return {
            "makespan": self.makespan,
            "bubble": self.bubble,
            "actions": len(self.actions),
            "peak_live_activations": self.peak_live_activations(),
            "peak_activation_bytes": self.peak_activation_bytes(),
            "peak_live_kept": self.peak_live_kept(),
            "peak_kept_bytes": self.peak_kept_bytes(),
            "peak_live_registers": {r.name: r.peak_live for r in self.registers},
            "seconds_per_kind": per_kind,
            "overhead_us_per_action": 1e6 * self.overhead_per_action_s,
        }

    def __str__(self):
        s = self.summary()
        live = ", ".join(f"stage {k}: {v}" for k, v in sorted(s["peak_live_activations"].items()))
        kinds = ", ".join(f"{k} {v:.4g}s" for k, v in s["seconds_per_kind"].items())
        kept = ", ".join(f"stage {k}: {v}" for k, v in sorted(s["peak_kept_bytes"].items()))
        return (
            f"Timeline: {s['actions']} actions on {len(self.threads)} threads, makespan "
            f"{s['makespan']:.4g}s, bubble {s['bubble']:.3f}\n  peak live activation registers: {live}"
            + (f"\n  peak bytes kept for W: {kept}" if kept else "")
            + f"\n  busy time per kind: {kinds}"
        )

    def gantt(self, path: str, title: str | None = None) -> str:
        """Draw one row per thread, one box per action (colour by kind, label by
        microbatch) and write a PNG to ``path``. Needs matplotlib (``pip install
        sbpjax[plots]``)."""
        if not self.actions:
            raise SBPError("Timeline.gantt: the timeline has no actions to draw (no step was recorded).")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise SBPError(
                "Timeline.gantt needs matplotlib; install it with `pip install sbpjax[plots]`."
            ) from None
        colours = {
            "load": "#9e9e9e",
            "put": "#c7a76c",
            "forward": "#4c8bd6",
            "backward": "#e07b39",
            "backward_input": "#e07b39",
            "backward_weight": "#f2c14e",
            "transfer": "#7bc47f",
            "update": "#9b59b6",
        }
        rows = list(self.threads)
        t0 = min((a.start for a in self.actions), default=0.0)
        fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
        for a in self.actions:
            y = rows.index(a.thread)
            w = max(a.duration, 1e-9)
            ax.broken_barh(
                [(a.start - t0, w)],
                (y - 0.4, 0.8),
                facecolors=colours.get(a.kind, "#cccccc"),
                edgecolor="black",
                linewidth=0.3,
            )
            if a.microbatch is not None and a.kind in COMPUTE:
                ax.text(a.start - t0 + w / 2, y, str(a.microbatch), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows)
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        self._draw_kept(ax, rows, t0)
        shown = [k for k in colours if any(a.kind == k for a in self.actions)]
        handles: list = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in shown]
        labels = [{"backward_input": "B", "backward_weight": "W"}.get(k, k) for k in shown]
        if any(key[2] == "kept" and b for key, b in self.held_bytes.items()):
            handles.append(plt.Line2D([0], [0], color="black", linewidth=1))
            labels.append("bytes kept for W")
        ax.legend(handles, labels, loc="upper right", fontsize=7, ncol=len(handles))
        ax.set_title(title or f"pipeline timeline: bubble {self.bubble:.3f}, makespan {self.makespan:.4g}s")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def _draw_kept(self, ax, rows: list, t0: float) -> None:
        """Under each row, a line of the bytes its B's keep for their W's (scaled
        to the largest held anywhere; labelled with it)."""
        series = {t: self.held_bytes_over_time(t, ("kept",)) for t in rows}
        top = max((b for steps in series.values() for _, b in steps), default=0)
        if not top:
            return
        end = max(a.end for a in self.actions) - t0
        for y, thread in enumerate(rows):
            steps = series[thread]
            if not steps:
                continue
            xs, ys, held = [0.0], [0], 0
            for t, b in steps:
                xs += [t - t0, t - t0]
                ys += [held, b]
                held = b
            xs.append(end)
            ys.append(held)
            ax.plot(xs, [y + 0.4 - 0.35 * v / top for v in ys], color="black", linewidth=0.8)
        ax.set_xlabel(f"seconds  (black lines: bytes kept for W, a row's height = {top} bytes)")
