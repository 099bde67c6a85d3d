"""The documentation runs as shown.

Every ```python block of a page is executed, in order, in one fresh process per
page (so a page may build on its earlier blocks), on 8 simulated CPU devices and
in a temporary working directory. Blocks fenced as ```text, ```bash or ```py are
shown but not run (```py marks a fragment, e.g. one that needs several hosts).
The README's "A first look" runs too, and the site builds in strict mode when
the docs extra is installed (``pip install -e ".[docs]"``; scripts/docs.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FAST = {"index.md", "tutorial.md"}  # the rest are marked slow (they train models)
_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)


def python_blocks(text: str) -> list[str]:
    return _BLOCK.findall(text)


def _pages() -> list:
    pages = []
    for path in sorted(DOCS.rglob("*.md")):
        rel = path.relative_to(DOCS).as_posix()
        if not python_blocks(path.read_text()):
            continue
        marks = [] if rel in FAST else [pytest.mark.slow]
        pages.append(pytest.param(rel, marks=marks, id=rel))
    return pages


def _run(code: str, where: str, tmp_path: Path, timeout: int = 900) -> str:
    env = dict(
        os.environ,
        XLA_FLAGS=xla_flags(8),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        MPLBACKEND="Agg",
    )
    script = tmp_path / "page.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{where} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("page", _pages())
def test_page_code_runs(page, tmp_path):
    blocks = python_blocks((DOCS / page).read_text())
    code = "\n\n".join(f"# --- block {i + 1} of docs/{page}\n{b}" for i, b in enumerate(blocks))
    _run(code, f"docs/{page}", tmp_path)


def test_readme_first_look_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A first look", 1)[1].split("\n## ", 1)[0]
    blocks = python_blocks(section)
    assert blocks, "README.md: no python block under 'A first look'"
    out = _run("\n\n".join(blocks), "README.md 'A first look'", tmp_path)
    assert "total 12.00 KiB" in out  # the plan printed below the block in the README


def test_tutorial_is_a_fast_page():
    assert python_blocks((DOCS / "tutorial.md").read_text())
    assert python_blocks((DOCS / "index.md").read_text())


_OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md")


def test_no_reference_outside_the_repository():
    """Users get the repository, nothing beside it: no file may send them elsewhere."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        # a tree copied without its .git (an sdist) has no file list to read; CI and the
        # README's test command run in a clone, where this always runs
        pytest.skip("not a git checkout")
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".ipynb", ".txt", ".cfg"}:
            continue
        if not path.is_file() or name == "tests/test_docs.py":
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _OUTSIDE.search(line):
                bad.append(f"{name}:{no}: {line.strip()}")
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def test_site_builds_strictly(tmp_path):
    # CI installs the docs extra and builds the site only here: there a missing
    # extra fails the test instead of skipping it
    if os.environ.get("CI") != "true":
        for module in ("mkdocs", "mkdocstrings", "mkdocs_jupyter"):
            pytest.importorskip(module)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _fmt_int(n) -> str:
    return f"{int(n):,}"


def test_comparison_quotes_the_benchmark_results():
    """The figures of docs/comparison.md are those of benchmarks/results/*.json: rerunning a
    benchmark without updating the page fails here."""
    import json

    page = (DOCS / "comparison.md").read_text()
    results = ROOT / "benchmarks" / "results"
    boxing = json.loads((results / "boxing.json").read_text())["summary"]
    compiler = {p["name"]: p for p in json.loads((results / "compiler.json").read_text())["programs"]}
    train = json.loads((results / "train.json").read_text())
    pipeline_run = json.loads((results / "pipeline.json").read_text())
    pipeline = pipeline_run["real"]
    zb_h1 = next(r for r in pipeline_run["schedules"] if r["schedule"] == "zb-h1" and r["m"] == 8)
    searched = {r["name"]: r for r in pipeline_run["search"]}
    # the page says the search found exhaustive search's own configuration on both cases it measures
    assert [r["same_configuration"] for r in searched.values() if "same_configuration" in r] == [True, True]
    dtensor = json.loads((results / "dtensor.json").read_text())
    dt, mlp = dtensor["summary"], dtensor["megatron_mlp_fwd_bwd_2x4"]
    quoted = [
        f"In all {boxing['measured_equals_plan']} cases",
        f"move {boxing['two_d_plan_T']:g} |T| with sbpjax and\n"
        f"  {boxing['two_d_gspmd_T_over_expressible']:g} |T| with GSPMD",
        f"{boxing['no_partial_plan_T']:g} |T| in total",
        f"against {boxing['no_partial_gspmd_T']:g} |T| for GSPMD",
        f"GSPMD's is {boxing['median_time_ratio_vs_gspmd']:.2f}",
        f"{_fmt_int(train['sbpjax_bytes'])} bytes with\nsbpjax against {_fmt_int(train['gspmd_bytes'])} with GSPMD",
        f"at {train['time_ratio_vs_gspmd']:.2f} of GSPMD's time",
        f"costs\n{pipeline['overhead_us_per_action']:.0f} us per action",
        f"{pipeline['throughput_ratio_vs_single_program']:.2f} times the throughput",
        f"(ZB-H1's makespan is {zb_h1['simulated_makespan_ratio_vs_1f1b']:.3f} of 1F1B's",
        f"(ZB-H1 at {zb_h1['measured_makespan_ratio_vs_1f1b']:.2f} of 1F1B's)",
        f"on 64 devices in {searched['gpt_64x64']['search_s']:.1f} s",
        f"DTensor converts {dt['dtensor_supported_pairs']} of the {dt['pairs']} pairs",
        f"sbpjax moves {dt['supported_sbpjax_T']:g} |T| and DTensor {dt['supported_dtensor_T']:g} |T|",
        f"{dt['two_d_sbpjax_T']:g} |T| against {dt['two_d_dtensor_T']:g} |T|",
        f"DTensor moves more on {dt['pairs_where_dtensor_moves_more']}",
        f"sbpjax reaches the floor on\n  all {dt['no_partial_sbpjax_at_floor']} and DTensor on {dt['no_partial_dtensor_at_floor']}",
        f"({dt['no_partial_dtensor_T']:g} |T| in total against a floor of {dt['no_partial_floor_T']:g} |T|)",
        f"{_fmt_int(mlp['dtensor_bytes'])} bytes with DTensor against\n  {_fmt_int(mlp['sbpjax_bytes'])} with sbpjax",
    ]
    # the DTensor benchmark's sbpjax side is the boxing benchmark's plans, pair by pair
    plans = {
        (c["placement"], c["src"], c["dst"]): c["plan_bytes"]
        for c in json.loads((results / "boxing.json").read_text())["cases"]
    }
    assert {(c["placement"], c["src"], c["dst"]): c["sbpjax_bytes"] for c in dtensor["cases"]} == plans
    assert not dt["pairs_where_sbpjax_moves_more"]
    readme = (ROOT / "README.md").read_text()
    for q in (
        f"DTensor converts {dt['dtensor_supported_pairs']} of the {dt['pairs']} pairs",
        f"{dt['supported_dtensor_T']:g} |T| on them where sbpjax moves {dt['supported_sbpjax_T']:g} |T|",
    ):
        assert q in " ".join(readme.split()), f"README.md does not quote benchmarks/results/dtensor.json: {q}"
    assert mlp["sbpjax_bytes"] == compiler["megatron_mlp_fwd_bwd_2x4"]["sbpjax_bytes"]
    ratio = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731  (compile-only rows: no times)
    for r in compiler.values():
        quoted.append(
            f"| {_fmt_int(r['sbpjax_bytes'])} | {_fmt_int(r['gspmd_bytes'])} | "
            f"{_fmt_int(r['handwritten_bytes'])} | {ratio(r['time_ratio_vs_gspmd'])} | "
            f"{ratio(r['time_ratio_vs_handwritten'])} | {ratio(r['first_call_ratio'])} | "
            f"{ratio(r['cached_call_ratio'])} |"
        )
    missing = [q for q in quoted if q not in page]
    assert not missing, "docs/comparison.md does not quote benchmarks/results as they are now:\n" + "\n".join(
        missing
    )
