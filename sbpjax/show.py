"""Pictures of layouts: which part of the logical tensor each device holds.

    import sbpjax as sj
    t = sj.to_global(np.zeros((8, 6)), sj.placement((2, 4), ("x", "y")), (sj.S(0), sj.P))
    sj.show(t)                       # a text grid (rich when installed), printed
    fig = sj.show(t, kind="figure")  # a matplotlib Figure

The picture is a grid over the logical tensor's first two dims: rows are dim 0,
columns dim 1. Its bands are cut wherever some device's local box starts or
ends, so every cell is held whole by the devices it lists, and each device's
box is exactly a union of cells. A 1-D tensor is one row (dim 0 across), a
scalar one cell. Higher dims are folded into the cells: a cell lists every
device holding any part of dims 2.. for that block, and the output says so;
the per-device lines under the grid give every device's exact box in all dims.

Broadcast and partial axes are explained under the grid, e.g. "P(sum) over y:
... 0,1,2,3 | 4,5,6,7": the devices of each group hold one term each of the
value. The figure hatches partial terms. Only the layout is read, never the
values, so a tensor inside ``jax.jit`` can be shown too.
"""

from __future__ import annotations

import itertools

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.plan import normalized_layout
from sbpjax.layout import Geometry
from sbpjax.sbp import format_sbp
from sbpjax.tensor import GlobalTensor

_KINDS = ("text", "figure")


class _Picture:
    """The drawn layout: bands of the shown dims, the devices holding each cell,
    and every device's local box."""

    def __init__(self, t: GlobalTensor):
        self.tensor = t
        pl = t.placement
        self.layout = normalized_layout(t.sbp, t.ndim, pl.shape)
        geom = Geometry(t.shape, pl.shape)
        # (grid position, device id, box: per dim (start, size)), in the placement's order
        self.devices = [(c, int(pl.devices[c].id), geom.local_box(self.layout, c)) for c in geom.coords]
        self.shown = min(t.ndim, 2)
        self.row_bands = self._bands(0) if self.shown == 2 else [(0, 1)]
        self.col_bands = self._bands(self.shown - 1) if self.shown >= 1 else [(0, 1)]
        self.cells = [[self._holders(r, c) for c in self.col_bands] for r in self.row_bands]

    @staticmethod
    def holds_something(box) -> bool:
        return all(n > 0 for _, n in box)

    def _bands(self, dim: int) -> list:
        cuts = {0, self.tensor.shape[dim]}
        for _, _, box in self.devices:
            if self.holds_something(box):
                start, size = box[dim]
                cuts |= {start, start + size}
        return list(itertools.pairwise(sorted(cuts)))

    def _holders(self, row_band, col_band) -> list:
        # the bands of the dims actually shown (a scalar shows none, a vector only columns)
        shown = {0: [], 1: [col_band], 2: [row_band, col_band]}[self.shown]
        ids = []
        for _, dev, box in self.devices:
            if self.holds_something(box) and all(
                box[d][0] <= lo and hi <= box[d][0] + box[d][1] for d, (lo, hi) in enumerate(shown)
            ):
                ids.append(dev)
        return ids

    # -- words -----------------------------------------------------------------
    def title(self) -> str:
        t, pl = self.tensor, self.tensor.placement
        axes = ", ".join(f"{n}={s}" for n, s in zip(pl.axis_names, pl.shape))
        return (
            f"shape {t.shape} {t.dtype.name}, sbp {format_sbp(t.sbp)}, "
            f"placement ({axes}) devices {_grid_ids(pl)}"
        )

    def reading(self) -> str:
        nd = self.tensor.ndim
        if nd == 0:
            return "a scalar: one cell; a cell lists the devices holding that block"
        if nd == 1:
            return "one row, columns: dim 0; a cell lists the devices holding that block"
        text = "rows: dim 0, columns: dim 1; a cell lists the devices holding that block"
        if nd > 2:
            folded = "dim 2 is" if nd == 3 else f"dims 2..{nd - 1} are"
            text += (
                f"; {folded} folded into the cells (a cell lists every device "
                "holding any part of them; see the boxes below)"
            )
        return text

    def legend(self) -> list:
        t, pl, layout = self.tensor, self.tensor.placement, self.layout
        lines = []
        partial_ops = dict(layout.partial)
        split_dim = {a: d for d, axes in enumerate(layout.dims) for a in axes}
        for a, name in enumerate(pl.axis_names):
            groups = " | ".join(",".join(str(i) for i in g) for g in _groups_along(pl, a))
            if pl.shape[a] == 1:
                lines.append(f"{name} has size 1: any SBP on it is the same as B")
            elif a in partial_ops:
                op = partial_ops[a]
                lines.append(
                    f"P({op}) over {name}: the devices of each group hold one term each; "
                    f"the value is the {op} of their terms: {groups}"
                )
            elif a not in split_dim:
                lines.append(f"B over {name}: the devices of each group hold copies: {groups}")
            elif split_dim[a] >= 2:
                lines.append(
                    f"S({split_dim[a]}) over {name}: folded dim {split_dim[a]} is split; "
                    f"the devices of each group hold different parts of it: {groups}"
                )
        empty = [str(dev) for _, dev, box in self.devices if not self.holds_something(box)]
        if empty and t.size > 0:
            lines.append(
                f"holding nothing (a balanced split of a dim into more pieces than it has "
                f"elements leaves some empty): devices {','.join(empty)}"
            )
        return lines

    def box_lines(self) -> list:
        names = self.tensor.placement.axis_names
        out = []
        for c, dev, box in self.devices:
            where = ", ".join(f"{n}={i}" for n, i in zip(names, c))
            out.append(f"device {dev} ({where}): {_box_text(box)}")
        return out

    def band_label(self, band, dim_shown: bool) -> str:
        """``start:stop`` of a band of a shown dim; a dim not shown has one unlabelled band."""
        return f"{band[0]}:{band[1]}" if dim_shown else ""


def _grid_ids(pl) -> str:
    return str(np.asarray(pl.device_ids).reshape(pl.shape).tolist()).replace(" ", "")


def _groups_along(pl, axis: int) -> list:
    """Device ids along ``axis``, one list per position of the other axes."""
    ids = np.moveaxis(np.asarray(pl.device_ids).reshape(pl.shape), axis, -1)
    return [list(map(int, g)) for g in ids.reshape(-1, pl.shape[axis])]


def _box_text(box) -> str:
    if not box:
        return "the whole scalar"
    return "[" + ", ".join(f"{s}:{s + n}" for s, n in box) + "]"


def layout_text(t: GlobalTensor) -> str:
    """The layout of ``t`` as plain text: a title, the grid of cells with the
    devices holding each, the meaning of B / P / folded axes, and every device's box.

    >>> print(layout_text(sj.to_global(np.zeros((4, 2), np.float32), sj.placement(2, "x"), sj.S(0))))
    shape (4, 2) float32, sbp (S(0)), placement (x=2) devices [0,1]
    rows: dim 0, columns: dim 1; a cell lists the devices holding that block
        | 0:2
    ----+----
    0:2 | 0
    2:4 | 1
    <BLANKLINE>
    device 0 (x=0): [0:2, 0:2]
    device 1 (x=1): [2:4, 0:2]
    """
    pic = _Picture(_check_tensor(t, "layout_text"))
    lines = [pic.title(), pic.reading()]
    if pic.tensor.size == 0:
        lines.append(f"(empty: shape {pic.tensor.shape} has no elements)")
    else:
        lines += _plain_grid(pic)
    lines.append("")
    legend = pic.legend()
    if legend:
        lines += legend + [""]
    lines += pic.box_lines()
    return "\n".join(lines)


def _plain_grid(pic: _Picture) -> list:
    row_labels = [pic.band_label(b, pic.shown == 2) for b in pic.row_bands]
    col_labels = [pic.band_label(b, pic.shown >= 1) for b in pic.col_bands]
    cells = [[",".join(map(str, h)) for h in row] for row in pic.cells]
    lead = max(len(s) for s in row_labels + [""])
    widths = [
        max([len(col_labels[j])] + [len(cells[i][j]) for i in range(len(cells))])
        for j in range(len(col_labels))
    ]

    def line(first, items):
        return " | ".join([first.ljust(lead)] + [s.ljust(w) for s, w in zip(items, widths)]).rstrip()

    out = [line("", col_labels), "-+-".join(["-" * lead] + ["-" * w for w in widths])]
    out += [line(row_labels[i], cells[i]) for i in range(len(cells))]
    return out


def _check_tensor(t, where: str) -> GlobalTensor:
    if not isinstance(t, GlobalTensor):
        raise SBPError(
            f"{where}: expected an sj.GlobalTensor, got {type(t).__name__}; lay a "
            "plain array out first with sj.to_global(x, placement, sbp)."
        )
    return t


def _print_rich(pic: _Picture) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    partial = bool(pic.layout.partial)
    table = Table(show_lines=True)
    table.add_column("")
    for band in pic.col_bands:
        table.add_column(pic.band_label(band, pic.shown >= 1))
    palette = [
        "red",
        "green",
        "blue",
        "magenta",
        "cyan",
        "yellow",
        "bright_red",
        "bright_green",
        "bright_blue",
        "bright_magenta",
        "bright_cyan",
        "bright_yellow",
    ]
    order = {dev: k for k, (_, dev, _) in enumerate(pic.devices)}
    for band, row in zip(pic.row_bands, pic.cells):
        styled = []
        for holders in row:
            text = ",".join(map(str, holders))
            # one colour per device where one device holds the cell; partial terms in italics
            style = palette[order[holders[0]] % len(palette)] if len(holders) == 1 else ""
            styled.append(Text(text, style=(style + " italic").strip() if partial else style))
        table.add_row(pic.band_label(band, pic.shown == 2), *styled)
    console = Console()
    console.print(pic.title(), highlight=False)
    console.print(pic.reading(), highlight=False)
    if pic.tensor.size == 0:
        console.print(f"(empty: shape {pic.tensor.shape} has no elements)")
    else:
        console.print(table)
    for line in pic.legend() + [""] + pic.box_lines():
        console.print(line, highlight=False)


def _figure(pic: _Picture, figsize):
    import matplotlib
    from matplotlib.figure import Figure  # not pyplot: no global state, fine under Agg
    from matplotlib.patches import Patch, Rectangle

    n = len(pic.devices)
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "hsv"]
    colour = {dev: cmap(k / n if n > 20 else k) for k, (_, dev, _) in enumerate(pic.devices)}
    hatch = "///" if pic.layout.partial else None

    fig = Figure(figsize=figsize or (7, 5), layout="constrained")
    ax = fig.add_subplot()
    t = pic.tensor
    height = t.shape[0] if pic.shown == 2 else 1
    width = t.shape[pic.shown - 1] if pic.shown >= 1 else 1
    for (r0, r1), row in zip(pic.row_bands, pic.cells):
        for (c0, c1), holders in zip(pic.col_bands, row):
            # a cell held by k devices is drawn as k vertical stripes, one per device
            stripe = (c1 - c0) / max(len(holders), 1)
            for k, dev in enumerate(holders):
                x0 = c0 + k * stripe
                rect = Rectangle(
                    (x0, r0),
                    stripe,
                    r1 - r0,
                    facecolor=colour[dev],
                    hatch=hatch,
                    edgecolor="white",
                    linewidth=0.8,
                )
                rect.set_gid(f"device {dev} rows {r0}:{r1} cols {c0}:{c1}")
                ax.add_patch(rect)
                if len(holders) <= 8:
                    ax.text(x0 + stripe / 2, (r0 + r1) / 2, str(dev), ha="center", va="center", fontsize=8)
            outline = Rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor="black", linewidth=1.5)
            outline.set_gid(f"cell rows {r0}:{r1} cols {c0}:{c1}")
            ax.add_patch(outline)
    # a size-0 dim gets a frame of one unit: an empty range would make a singular axis
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(max(height, 1), 0)  # row 0 at the top, as the array prints
    ax.set_xticks(sorted({b for band in pic.col_bands for b in band}))
    ax.set_yticks(sorted({b for band in pic.row_bands for b in band}))
    ax.set_xlabel("dim 1" if pic.shown == 2 else "dim 0" if pic.shown == 1 else "")
    ax.set_ylabel("dim 0" if pic.shown == 2 else "")
    if pic.shown < 2:
        ax.set_yticks([])
    if pic.shown == 0:
        ax.set_xticks([])
    ax.set_title(pic.title(), fontsize=9, wrap=True)
    notes = [pic.reading()] + pic.legend()
    if any(len(h) > 1 for row in pic.cells for h in row):
        notes.append(
            "a cell (black outline) held by k devices is drawn as k stripes: "
            "each of them holds the whole cell"
        )
    fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize=7)  # constrained layout makes room
    handles = [Patch(facecolor=colour[dev], label=f"device {dev}", hatch=hatch) for _, dev, _ in pic.devices]
    if pic.layout.partial:
        handles.append(
            Patch(facecolor="white", edgecolor="black", hatch=hatch, label="hatched: partial terms")
        )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def show(t: GlobalTensor, kind: str = "text", *, figsize=None):
    """Draw which part of the logical tensor each device of ``t`` holds.

    ``kind="text"``: print a grid (with ``rich`` when installed, plain text
    otherwise; :func:`layout_text` returns the plain text) and return None.
    ``kind="figure"``: return a matplotlib ``Figure`` (colours per device,
    partial terms hatched); ``figsize`` in inches.

        sj.show(sj.to_global(x, sj.placement((2, 4), ("x", "y")), (sj.S(0), sj.S(0))))
    """
    _check_tensor(t, "show")
    if kind not in _KINDS:
        raise SBPError(
            f"show: unknown kind {kind!r}; use kind='text' (printed) or kind='figure' (a matplotlib Figure)."
        )
    if kind == "figure":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SBPError(
                "show(kind='figure') needs matplotlib; install it with "
                "pip install 'sbpjax[plots]', or use kind='text'."
            ) from None
        return _figure(_Picture(t), figsize)
    try:
        import rich  # noqa: F401
    except ImportError:  # rich is in the plots extra; plain text needs nothing
        print(layout_text(t))
        return None
    _print_rich(_Picture(t))
    return None


__all__ = ["layout_text", "show"]
