"""The demo and the benchmark drivers run end to end (tiny shapes on CPU)."""

from __future__ import annotations

import json

from benchmarks import attention as attention_benchmark
from benchmarks import conv1d as conv1d_benchmark
from benchmarks import model as model_benchmark
from benchmarks import ssd as ssd_benchmark
from flax_models import demo


def test_demo_rows_are_accurate():
    rows = demo.kernel_table("auto")
    assert {r["op"] for r in rows} == {
        "ssd_scan",
        "selective_state_update",
        "causal_conv1d",
        "causal_conv1d_update",
        "masked_tail_attention",
        "gated_rms_norm",
    }
    for r in rows:
        assert r["rel"] < 1e-5, r


def test_ssd_benchmark_quick(tmp_path):
    out = tmp_path / "ssd.json"
    rows = ssd_benchmark.main(["--quick", "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["rows"] == json.loads(json.dumps(rows))
    for r in rows:
        assert r["median_ms"] > 0 and r["roofline_fraction"] > 0
        assert r["speedup_vs_xla"] > 0


def test_attention_benchmark_quick(tmp_path):
    out = tmp_path / "attention.json"
    rows = attention_benchmark.main(["--quick", "--out", str(out)])
    payload = json.loads(out.read_text())
    assert payload["rows"] == json.loads(json.dumps(rows))
    problems = {p.name for p in attention_benchmark.problems(quick=True)}
    assert {r["problem"] for r in rows} == problems
    assert {r["implementation"] for r in rows} >= {"xla", "triton"}
    for r in rows:
        assert r["median_ms"] > 0 and r["roofline_fraction"] > 0
        assert r["speedup_vs_xla"] > 0


def test_conv1d_benchmark_quick(tmp_path):
    out = tmp_path / "conv1d.json"
    rows = conv1d_benchmark.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    assert {r["implementation"] for r in rows} >= {"xla", "triton"}
    for r in rows:
        assert r["median_ms"] > 0 and r["roofline_fraction"] > 0


def test_model_benchmark_quick(tmp_path):
    out = tmp_path / "model.json"
    rows = model_benchmark.main(["--quick", "--out", str(out)])
    assert {r["implementation"] for r in rows} == {"xla", "auto"}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup_vs_xla"] > 0
