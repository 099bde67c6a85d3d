"""The pipeline search's benchmark and example run (small settings) and their figures hold."""

import json
import re

import pytest
from conftest import SEARCH_ROW_FIELDS, run_script


@pytest.mark.slow
def test_pipeline_search_benchmark_smoke(tmp_path):
    path = tmp_path / "pipeline_search.json"
    run_script(["benchmarks/pipeline_search.py", "--smoke", "--output", str(path)], 900)
    rows = {r["name"]: r for r in json.loads(path.read_text())["search"]}
    fields = SEARCH_ROW_FIELDS
    assert set(rows) == {"mlp_uneven", "gpt_64x64"} and all(fields <= set(r) for r in rows.values())
    small = rows["mlp_uneven"]
    # the searched plan's prediction is the exhaustive optimum's (the benchmark asserts it
    # too, unless the search hit its simulation cap); measured times on shared CPU cores
    # are reported, not asserted
    assert small["predicted_step_s"] >= small["brute_force_predicted_step_s"] * (1 - 1e-12)
    assert small["measured_step_s"] > 0 and small["brute_force_step_s"] > 0
    big = rows["gpt_64x64"]
    assert (big["layers"], big["devices"]) == (66, 64) and big["measured_step_s"] is None
    assert big["predicted_step_s"] > 0 and big["configuration"]["memory_per_device"] <= 80e9


@pytest.mark.slow
def test_auto_pipeline_example_runs():
    out = run_script(["examples/auto_pipeline.py", "--quick"], 900).stdout
    assert "first step equals the single-device step" in out  # the script checks the values itself
    assert re.search(r"PipelinePlan on Grid\(node=2, gpu=4\)", out)
    losses = [float(v) for v in re.findall(r"step +\d+: loss ([\d.]+)", out)]
    assert len(losses) == 4 and losses[-1] < losses[0]
