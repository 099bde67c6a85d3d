"""sj.show / layout_text: every drawn box and cell against the semantics.

The reference for what a device holds is ``reference_local`` (nested
np.array_split, written apart from sbpjax.layout) applied to a tensor of
distinct values, so a device's piece identifies its region of the logical tensor.
"""

import math
import re
import sys
import warnings

import jax
import matplotlib
import numpy as np
import pytest
from conftest import reference_local

import sbpjax as sj
from sbpjax.sbp import Partial
from sbpjax.show import layout_text, show

matplotlib.use("Agg")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _permuted_placement():
    """A 2x4 grid whose device order is not jax.devices()' order."""
    devs = jax.devices()
    order = [3, 7, 1, 5, 0, 4, 2, 6]
    return sj.Placement(np.array([devs[i] for i in order], dtype=object).reshape(2, 4), ("x", "y"))


def _pl(kind):
    if kind == "1d":
        return sj.placement(8, "x")
    if kind == "2x4":
        return sj.placement((2, 4), ("x", "y"))
    return _permuted_placement()


CASES = [  # (placement, shape, nd-SBP)
    ("1d", (8, 6), (sj.S(0),)),
    ("1d", (5, 11), (sj.S(1),)),  # uneven: 11 = 2+2+2+1+1+1+1+1
    ("1d", (3, 4), (sj.S(0),)),  # more pieces than rows: empty pieces
    ("1d", (4, 4), (sj.B,)),
    ("1d", (4, 4), (sj.P,)),
    ("1d", (13,), (sj.S(0),)),
    ("1d", (), (sj.P_max,)),
    ("2x4", (8, 6), (sj.S(0), sj.S(0))),
    ("2x4", (11, 3), (sj.S(0), sj.S(0))),  # nested uneven: 11 -> 6,5 -> 2,2,1,1 / 2,1,1,1
    ("2x4", (7, 10), (sj.S(0), sj.S(1))),
    ("2x4", (9, 6), (sj.S(1), sj.S(0))),
    ("2x4", (7, 5), (sj.S(1), sj.P)),
    ("2x4", (6, 9), (sj.P, sj.S(1))),
    ("2x4", (5, 5), (sj.B, sj.P_max)),
    ("2x4", (4, 4), (sj.P, sj.P_min)),
    ("2x4", (4, 3, 5), (sj.S(0), sj.S(2))),  # dim 2 folded into the cells
    ("2x4", (13,), (sj.S(0), sj.S(0))),
    ("2x4", (), (sj.P, sj.B)),
    ("perm", (8, 6), (sj.S(0), sj.S(1))),  # user device order is kept
    ("perm", (10, 7), (sj.S(1), sj.S(0))),
    ("perm", (5, 6), (sj.P, sj.S(0))),
]


def _case_id(case):
    kind, shape, sbp = case
    return f"{kind}-{'x'.join(map(str, shape)) or 'scalar'}-{sj.format_sbp(sbp)}"


def _reference(pl, shape, sbp):
    """Per device id: its piece of ``x`` (distinct values), from the semantics; a
    partial axis does not cut (every term has the logical shape)."""
    x = np.arange(math.prod(shape)).reshape(shape)
    as_b = tuple(sj.B if isinstance(s, Partial) else s for s in sbp)
    pieces = {}
    for coord in np.ndindex(*pl.shape):
        pieces[pl.devices[coord].id] = (coord, reference_local(x, pl.shape, as_b, coord))
    return x, pieces


def _parse(text):
    """(device id -> (grid position, box as slices), cells as (row band, col band, device ids))."""
    lines = text.splitlines()
    boxes = {}
    for line in lines:
        m = re.fullmatch(r"device (\d+) \((.*)\): (.*)", line)
        if m:
            coord = tuple(int(kv.split("=")[1]) for kv in m.group(2).split(", "))
            box = (
                ()
                if m.group(3) == "the whole scalar"
                else tuple(slice(*map(int, part.split(":"))) for part in m.group(3).strip("[]").split(", "))
            )
            boxes[int(m.group(1))] = (coord, box)
    header = lines.index(next(line for line in lines if re.fullmatch(r"-+(\+-+)+", line))) - 1
    col_bands = [c.strip() for c in lines[header].split("|")[1:]]
    cells = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        row, *items = [c.strip() for c in line.split("|")]
        for col, item in zip(col_bands, items):
            cells.append((row, col, {int(i) for i in item.split(",")} if item else set()))
    return boxes, cells


def _band(label, size):
    return slice(*map(int, label.split(":"))) if label else slice(0, size)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_text_boxes_and_cells_match_the_semantics(case):
    kind, shape, sbp = case
    pl = _pl(kind)
    t = sj.to_global(np.zeros(shape, np.float32), pl, sbp)
    x, pieces = _reference(pl, shape, sbp)
    boxes, cells = _parse(layout_text(t))

    # every device's box, in every dim, is exactly its piece from the semantics
    assert set(boxes) == set(pieces)
    for dev, (coord, box) in boxes.items():
        want_coord, want = pieces[dev]
        assert coord == want_coord
        np.testing.assert_array_equal(x[box], want)

    # every cell is held whole by exactly the devices it lists, and the cells tile
    # dims 0 and 1. Folded dims 2.. are projected away: x's values are flat indices,
    # so value // (size of dims 2..) names the (row, column) an element lies in.
    folded = math.prod(shape[2:])
    shown = min(len(shape), 2)
    area = 0
    for row, col, holders in cells:
        bands = (
            [_band(row, shape[0]), _band(col, shape[1])]
            if shown == 2
            else [_band(col, shape[0])]
            if shown == 1
            else []
        )
        cell = set((x[tuple(bands)].ravel() // folded).tolist())
        area += len(cell)
        want = {
            dev
            for dev, (_, piece) in pieces.items()
            if piece.size and cell <= set((piece.ravel() // folded).tolist())
        }
        assert holders == want, (row, col)
    assert area == math.prod(shape[:2])


def test_text_format_example_from_the_docstring():
    t = sj.to_global(np.zeros((4, 2), np.float32), sj.placement(2, "x"), sj.S(0))
    assert layout_text(t) == (
        "shape (4, 2) float32, sbp (S(0)), placement (x=2) devices [0,1]\n"
        "rows: dim 0, columns: dim 1; a cell lists the devices holding that block\n"
        "    | 0:2\n"
        "----+----\n"
        "0:2 | 0\n"
        "2:4 | 1\n"
        "\n"
        "device 0 (x=0): [0:2, 0:2]\n"
        "device 1 (x=1): [2:4, 0:2]"
    )


def test_text_explains_partial_broadcast_folded_and_empty():
    pl = sj.placement((2, 4), ("x", "y"))
    partial = layout_text(sj.to_global(np.zeros((4, 4), np.float32), pl, (sj.S(0), sj.P)))
    assert (
        "P(sum) over y: the devices of each group hold one term each; the value is the sum "
        "of their terms: 0,1,2,3 | 4,5,6,7"
    ) in partial
    copies = layout_text(sj.to_global(np.zeros((4, 4), np.float32), pl, (sj.B, sj.S(1))))
    assert "B over x: the devices of each group hold copies: 0,4 | 1,5 | 2,6 | 3,7" in copies
    folded = layout_text(sj.to_global(np.zeros((2, 2, 8, 3), np.float32), pl, (sj.S(2), sj.S(3))))
    assert "dims 2..3 are folded into the cells" in folded
    assert "S(2) over x: folded dim 2 is split" in folded and "S(3) over y" in folded
    empty = layout_text(sj.to_global(np.zeros((3,), np.float32), sj.placement(8, "x"), sj.S(0)))
    assert "devices 3,4,5,6,7" in empty
    size1 = layout_text(
        sj.to_global(np.zeros((4,), np.float32), sj.placement((1, 8), ("a", "b")), (sj.P, sj.S(0)))
    )
    assert "a has size 1: any SBP on it is the same as B" in size1


def test_layout_text_works_on_a_traced_tensor():
    pl = sj.placement((2, 4), ("x", "y"))
    seen = []

    @jax.jit
    def f(x):
        t = sj.to_global(x, pl, (sj.S(0), sj.S(1)))
        seen.append(layout_text(t))
        return x

    f(np.zeros((4, 8), np.float32))
    assert seen[0] == layout_text(sj.to_global(np.zeros((4, 8), np.float32), pl, (sj.S(0), sj.S(1))))


def test_show_text_prints_with_rich(capsys):
    t = sj.to_global(np.zeros((8, 6), np.float32), sj.placement((2, 4), ("x", "y")), (sj.S(0), sj.P))
    assert show(t) is None
    out = capsys.readouterr().out
    assert "sbp (S(0), P)" in out and "P(sum) over y" in out
    assert "━" in out  # rich's table border, not the plain grid


def test_show_text_without_rich_prints_the_plain_text(capsys, monkeypatch):
    t = sj.to_global(np.zeros((7, 5), np.float32), sj.placement(8, "x"), sj.S(1))
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich now fails
    assert show(t) is None
    assert capsys.readouterr().out == layout_text(t) + "\n"


FIGURE_CASES = [c for c in CASES if len(c[1]) <= 2]


@pytest.mark.parametrize("case", FIGURE_CASES, ids=_case_id)
def test_figure_draws_each_device_over_exactly_its_box(case):
    kind, shape, sbp = case
    pl = _pl(kind)
    t = sj.to_global(np.zeros(shape, np.float32), pl, sbp)
    x, pieces = _reference(pl, shape, sbp)
    fig = show(t, kind="figure")
    assert isinstance(fig, matplotlib.figure.Figure)
    (ax,) = fig.axes
    stripes = [p for p in ax.patches if (p.get_gid() or "").startswith("device")]
    partial = any(isinstance(s, Partial) and pl.shape[a] > 1 for a, s in enumerate(sbp))

    # a device's stripes cover exactly the cells of its piece: same area, all inside it
    covered = {dev: 0 for dev in pieces}
    colours = {}
    for patch in stripes:
        dev, r0, r1, c0, c1 = map(
            int, re.fullmatch(r"device (\d+) rows (\d+):(\d+) cols (\d+):(\d+)", patch.get_gid()).groups()
        )
        block = x[r0:r1, c0:c1] if len(shape) == 2 else x[c0:c1] if len(shape) == 1 else x
        assert np.isin(block, pieces[dev][1]).all()
        covered[dev] += block.size
        colours.setdefault(dev, patch.get_facecolor())
        assert patch.get_facecolor() == colours[dev]
        assert bool(patch.get_hatch()) == partial
    for dev, (_, piece) in pieces.items():
        assert covered[dev] == piece.size
    assert len(stripes) == sum(1 for _, piece in pieces.values() if piece.size)
    assert len(set(colours.values())) == len(colours)  # one colour per device
    assert sj.format_sbp(sbp) in ax.get_title() and str(shape) in ax.get_title()
    fig.canvas.draw()  # renders under Agg


def test_show_figure_for_a_folded_tensor_builds():
    pl = sj.placement((2, 4), ("x", "y"))
    fig = show(sj.to_global(np.zeros((4, 3, 5), np.float32), pl, (sj.S(0), sj.S(2))), kind="figure")
    stripes = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("device")]
    assert len(stripes) == 8  # two row bands, each held by the four devices splitting dim 2
    fig.canvas.draw()


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0,), (4, 0, 3)])
def test_show_figure_of_an_empty_tensor_draws_a_frame_without_warnings(shape):
    pl = sj.placement((2, 4), ("x", "y"))
    t = sj.to_global(np.zeros(shape, np.float32), pl, (sj.S(0), sj.B))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns on a singular axis range
        fig = show(t, kind="figure")
        fig.canvas.draw()
    (ax,) = fig.axes
    assert not [p for p in ax.patches if (p.get_gid() or "").startswith("device")]
    assert ax.get_xlim() == (0, max(shape[-1] if len(shape) <= 2 else shape[1], 1))


def test_errors_say_what_and_how_to_fix():
    with pytest.raises(sj.SBPError, match=r"expected an sj.GlobalTensor, got ndarray.*sj.to_global"):
        show(np.zeros(3))
    with pytest.raises(sj.SBPError, match=r"layout_text: expected an sj.GlobalTensor"):
        layout_text([1, 2])
    t = sj.to_global(np.zeros(4, np.float32), sj.placement(8, "x"), sj.B)
    with pytest.raises(sj.SBPError, match=r"unknown kind 'png'.*kind='text'.*kind='figure'"):
        show(t, kind="png")
