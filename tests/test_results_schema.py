"""Every committed results file is in the one schema ``benchmarks.harness`` writes, under
``benchmarks/results/<device>/<module>.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import harness, plots

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FILES = sorted(RESULTS.rglob("*.json"))
# The benchmark modules: a results file is named after the module that wrote it.
MODULES = {p.stem for p in (RESULTS.parent).glob("*.py")} - {
    "__init__",
    "harness",
    "plots",
    "run_all",
}


def test_the_store_has_files():
    assert FILES, f"no results under {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_file_has_the_schema(path):
    payload = json.loads(path.read_text())
    harness.check_schema(payload, path)
    assert list(payload) == list(harness.SCHEMA_KEYS)
    # <device>/<module>.json, nothing deeper or flatter.
    assert path.parent.parent == RESULTS, path
    assert path.stem in MODULES, f"{path.name}: no benchmarks/{path.stem}.py wrote it"
    assert plots.load(path).rows  # and the plots read it


def test_schema_check_refuses_another_key_set(tmp_path):
    good = dict(
        device="NVIDIA H200",
        jax="0.11.2",
        date="2026-11-29",
        command="python -m benchmarks.ssd",
        ceilings=dict(copy_gbps=4200.0, matmul_tflops=680.0),
        rows=[dict(problem="p", implementation="xla", median_ms=1.0)],
    )
    harness.check_schema(good)
    other_keys = (
        good | dict(title="ssd"),  # an extra key
        {k: v for k, v in good.items() if k != "command"},  # a missing one
        dict(runs=[good]),  # the old gathered-runs shape
    )
    for bad in other_keys:
        with pytest.raises(ValueError, match="top-level keys"):
            harness.check_schema(bad)
        (tmp_path / "ssd.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not a benchmark result"):
            plots.load(tmp_path / "ssd.json")
    for bad in (good | dict(ceilings=dict(copy_gbps=1.0)), good | dict(rows=[dict(problem="p")])):
        with pytest.raises(ValueError):
            harness.check_schema(bad)
