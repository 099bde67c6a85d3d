"""The notebooks match notebooks/build.py and run top to bottom in a fresh kernel."""

import os
import sys

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, NOTEBOOKS)

import build  # noqa: E402  (notebooks/build.py: the cells of every notebook)


@pytest.mark.parametrize("name", sorted(build.NOTEBOOKS))
def test_notebook_is_built_from_build_py(name):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    assert [c.source for c in nb.cells] == [src for _, src in build.NOTEBOOKS[name]], (
        f"{name} is stale: run python notebooks/build.py --execute"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(build.NOTEBOOKS))
def test_notebook_runs(name):
    saved = os.environ.get("XLA_FLAGS")
    try:
        nb = build.execute(build.notebook(build.NOTEBOOKS[name]))
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the pictures are drawn"
