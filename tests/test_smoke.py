"""The demo and the benchmark drivers run end to end (tiny shapes on CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks import attention as attention_benchmark
from benchmarks import conv1d as conv1d_benchmark
from benchmarks import harness, plots, run_all
from benchmarks import model as model_benchmark
from benchmarks import serving as serving_benchmark
from benchmarks import ssd as ssd_benchmark
from flax_models import demo
from tests.helpers import fast_compile_env


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
    harness.check_schema(payload)
    assert payload["rows"] == json.loads(json.dumps(rows))
    assert payload["command"] == f"python -m benchmarks.ssd --quick --out {out}"
    for r in rows:
        assert r["median_ms"] > 0 and r["roofline_fraction"] > 0
        assert r["speedup_vs_xla"] > 0


def test_ssd_benchmark_runs_only_the_named_problems():
    """``--only`` names the decode problem: no prefill problem runs (it was ignored)."""
    (decode,) = ssd_benchmark.decode_problems(quick=True)
    rows = ssd_benchmark.main(["--quick", "--only", decode.name])
    assert rows and {r["problem"] for r in rows} == {decode.name}


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
    # Off-GPU ``auto`` runs the xla backends: its rows would time the xla rows' programs
    # again (102 -> 38 s alone), so there the test times xla alone, the ratio's baseline.
    implementations = ["auto", "xla"] if jax.default_backend() == "gpu" else ["xla"]
    rows = model_benchmark.main(
        ["--quick", "--implementations", *implementations, "--out", str(out)]
    )
    assert {r["implementation"] for r in rows} == set(implementations)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["speedup_vs_xla"] > 0
    # Each model and implementation streams one request end to end (Engine.stream).
    streamed = {(r["model"], r["implementation"]) for r in rows if r["problem"].endswith("-stream")}
    assert streamed == {(m, i) for m in ("tiny", "tiny-moe") for i in implementations}


def test_model_benchmark_keeps_rows_of_a_stopped_run(tmp_path, monkeypatch):
    """The JSON is rewritten after every row: a run stopped part-way (a time limit) keeps
    the rows it timed."""

    class Stopped(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(model_benchmark, "_stream_timing", stop)  # the model's last row
    out = tmp_path / "model.json"
    with pytest.raises(Stopped):
        model_benchmark.main(["--quick", "--implementations", "auto", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["problem"] for r in rows] == [
        f"tiny/{case}"
        for case in ("prefill-2x32", "prefill-ragged", "prefill-1x24", "decode-1x48", "decode-4x48")
    ]


def test_serving_schedule_runs_no_step(monkeypatch):
    """The bucket analysis walks the trace's schedule on the host: no step program runs
    (it once ran the tiny model's, 175 s of host time for the full trace), and its steps
    are the ones an engine running them takes."""
    from flax_models.serving.engine import Engine
    from flax_models.serving.runner import StepRunner
    from flax_models.serving.sampling import SamplingParams

    spec = serving_benchmark.TRACES["quick"]
    prompts, outputs = serving_benchmark.make_trace(100, spec)
    lengths = [len(p) for p in prompts]
    options = serving_benchmark.engine_options(True)
    model = serving_benchmark._tiny_model()
    block = model.cfg.mamba_chunk_size  # (the benchmark's KV block size)
    real = Engine(model, kv_block_size=block, **options)
    greedy = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in outputs]
    real.generate(prompts, sampling=greedy)

    def launch(*args, **kwargs):
        raise AssertionError("the schedule launched a step")

    monkeypatch.setattr(StepRunner, "launch", launch)
    buckets, stats, _ = serving_benchmark.schedule(lengths, outputs, options, block)
    assert buckets == real.step_buckets
    assert stats["prefill_tokens"] == real.stats["prefill_tokens"] == sum(lengths)


def test_serving_benchmark_quick(tmp_path):
    """Start-up compiles the trace's programs in two fresh processes (the second loads
    them from the compilation and executable caches the first filled); the measured
    process compiles them before the trace runs twice (neither run compiles), its
    schedule is the one the host-side analysis predicted, and the JSON holds every
    request's times."""
    out = tmp_path / "serving.json"
    rows = serving_benchmark.main(["--quick", "--startup", "--out", str(out)])
    payload = json.loads(out.read_text())
    harness.check_schema(payload)
    (written,) = payload["rows"]
    serving = written.pop("serving")
    assert [written] == json.loads(json.dumps(rows))
    (row,) = rows
    assert row["problem"] == "tiny/offline-32/sqrt2"
    assert row["op"] == "serving" and row["median_ms"] > 0 and row["roofline_fraction"] > 0
    # Engine.warmup compiled the analysis's programs: neither run compiles a step.
    assert row["compiles_in_measured_run"] == row["compiles_in_warmup_run"] == 0
    assert row["compile_s"] > 0
    assert row["schedule_matches_analysis"] is True
    assert 0 <= row["padding_fraction"] < 1 and row["output_tokens_per_s"] > 0
    requests = serving["requests"]
    assert len(requests) == serving["trace"]["requests"]
    assert sum(r["output_len"] for r in requests) == row["decode_tokens"] + len(requests)
    assert all(r["ttft_s"] > 0 and r["tpot_s"] >= 0 for r in requests)
    assert {a["policy"] for a in serving["bucket_policies"]} >= {"pow2", "sqrt2"}
    startup = serving["startup"]
    cold, warm, buckets = startup["cold"], startup["warm"], startup["step_buckets"]
    # The warm probe loads every step program from the executable cache the cold one wrote
    # and compiles only the samplers.
    assert cold["loaded"] == 0 and warm["loaded"] == buckets == row["programs"]
    assert cold["programs"] == warm["programs"] + buckets > buckets
    assert any(Path(startup["cache_dir"]).iterdir()), "the cold probe filled no cache"
    if importlib.util.find_spec("matplotlib") is not None:
        paths = plots.save_plots([plots.load(out)], tmp_path)
        assert {p.name for p in paths} >= {"serving_sqrt2_latency.png"}


def test_results_dir_keeps_the_rows_a_run_does_not_measure_again(tmp_path):
    """``--results-dir``: ``<dir>/<device>/<module>.json``; a second run of one problem
    replaces that problem's rows and keeps the others, each with its own run's date,
    command and ceilings."""
    ssd_benchmark.main(["--quick", "--results-dir", str(tmp_path)])
    path = harness.results_path("ssd", harness.device_name(), tmp_path)
    first = json.loads(path.read_text())
    harness.check_schema(first, path)
    (decode,) = {p.name for p in ssd_benchmark.decode_problems(quick=True)}
    ssd_benchmark.main(["--quick", "--only", decode, "--results-dir", str(tmp_path)])
    second = json.loads(path.read_text())
    harness.check_schema(second, path)
    assert second["command"].endswith(f"--only {decode} --results-dir {tmp_path}")
    assert sorted(map(harness._row_key, first["rows"])) == sorted(
        map(harness._row_key, second["rows"])
    )
    for r in second["rows"]:
        # This run's rows carry nothing of their own; the kept ones their run's.
        assert ("command" in r) == (r["problem"] != decode), r
        if r["problem"] != decode:
            assert r["command"] == first["command"] and r["ceilings"] == first["ceilings"]
    (report,) = plots.load_all([tmp_path])[0]
    assert report.module == "ssd" and len(report.rows) == len(second["rows"])


def test_run_all_quick_keeps_going_past_a_failing_module(tmp_path, monkeypatch):
    """One cheap module (each module's own smoke test is above) and one that cannot start:
    the first writes ``<device>/conv1d.json`` (and its plots), the second is reported with
    its error and log and writes nothing."""
    for name, value in fast_compile_env(os.environ).items():  # inherited by the modules
        monkeypatch.setenv(name, value)
    ok, failed = run_all.run(("conv1d", "no_such_module"), quick=True, out_dir=tmp_path, echo=False)
    assert ok.error is None and ok.path == tmp_path / ok.path.parent.name / "conv1d.json"
    assert "exit status" in failed.error and "no_such_module" in failed.log
    assert failed.path is None
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["conv1d.json"]
    report = plots.load(ok.path)
    assert {r["implementation"] for r in report.rows} >= {"xla", "triton"}
    assert all(r["median_ms"] > 0 for r in report.rows)
    if importlib.util.find_spec("matplotlib") is not None:
        # One plot per op of the module (rows carry their op).
        for op in ("causal_conv1d", "causal_conv1d_update", "gated_rms_norm"):
            assert (ok.path.parent / f"conv1d_{op}.png").stat().st_size > 0


def test_time_fn_runs_process_zeros_call_count(monkeypatch):
    """Under several processes every one runs the same number of calls (their collectives
    pair up, or they hang): process 0's count, not each one's own estimate."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(harness.multihost_utils, "broadcast_one_to_all", lambda x: np.int32(3))
    calls = []
    harness.time_fn(lambda: calls.append(1), warmup=2, samples=4)
    assert len(calls) == 2 + 4 * 3


def test_model_benchmark_under_two_processes(tmp_path, monkeypatch):
    """``--processes 2``: two processes joined by ``jax.distributed`` run one tp = 2 mesh
    over both (one device each) and the first writes the rows; both stop on their own."""
    out = tmp_path / "model.json"
    # One CPU device a process (no forced device count), compiled fast.
    env = fast_compile_env({k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    monkeypatch.setenv("XLA_FLAGS", env.get("XLA_FLAGS", ""))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    argv = ["--quick", "--implementations", "auto", "--mesh", "tp=2", "--processes", "2"]
    with pytest.raises(SystemExit) as stop:
        model_benchmark.main([*argv, "--out", str(out), "--only", "tiny@tp2/decode-1x48"])
    assert stop.value.code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["problem"], r["tp"], r["processes"]) for r in rows] == [
        ("tiny@tp2/decode-1x48", 2, 2)
    ]
    assert rows[0]["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "argv",
    [["--mock-devices", "1"], ["--mock-devices"], ["--mock-devices", "2", "--processes", "2"]],
)
def test_model_benchmark_rejects_bad_mock_devices(argv):
    """A count below two, or beside ``--processes``, stops before any device is touched."""
    with pytest.raises(SystemExit, match="--mock-devices"):
        model_benchmark.main(["--quick", *argv])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the mock topology is a GPU client's")
def test_model_benchmark_mock_devices_on_one_gpu(tmp_path):
    """``--mock-devices 2`` on one GPU: the tp = 2 rows run (collectives mocked) beside the
    tp = 1 rows of the same run. A subprocess: the topology holds for a whole process."""
    out = tmp_path / "model.json"
    only = ["tiny/decode-1x48", "tiny@tp2/decode-1x48"]
    argv = ["--quick", "--implementations", "auto", "--mesh", "tp=1", "tp=2"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.model", *argv, "--mock-devices", "2"]
        + ["--only", *only, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["problem"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(only)
    assert rows["tiny@tp2/decode-1x48"]["collectives"] == "mocked"
    assert "collectives" not in rows["tiny/decode-1x48"]
    assert rows["tiny@tp2/decode-1x48"]["speedup_vs_tp1"] > 0
    assert rows["tiny@tp2/decode-1x48"]["processes"] == 1


def test_online_benchmark_takes_a_single_dashed_serve_arg():
    from benchmarks import serving_online

    args = serving_online._parse(["--serve-args", "--no-access-log", "--quick"])
    assert args.serve_args == "--no-access-log" and args.quick
    spaced = serving_online._parse(["--serve-args", "--log-level debug --no-access-log"])
    assert spaced.serve_args == "--log-level debug --no-access-log"
