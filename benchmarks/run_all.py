"""Runs every benchmark module; writes one combined JSON and one PNG plot per op.

``python -m benchmarks.run_all [--quick] [--out-dir DIR] [--modules ssd conv1d ...]
[--timeout SECONDS] [--fresh]``

Each module runs in its own process, ``python -m benchmarks.<module> --out FILE``, so a
module that raises, runs out of memory or hangs past ``--timeout`` is recorded with its
error and the log's tail while the others still run, and each starts on a device no earlier
module holds memory on. The combined file ``<out-dir>/<device>.json`` (the device name
slugified, e.g. ``nvidia_h200.json``) holds::

    {"title", "device", "platform", "jax", "host", "quick",
     "modules": {"ssd": <the report benchmarks.harness.report writes + "seconds", "started">,
                 "attention": {"error", "log", "seconds", "started"}, ...}}

It is rewritten after every module, so an interrupted run keeps what finished, and a run of
some modules keeps the others' entries from an earlier run (``--fresh`` drops them). Plots go
next to it, ``<device>_<op>.png`` (``benchmarks.plots``; skipped with a note when
matplotlib is missing). The output directory defaults to ``benchmarks/results``; with
``--quick`` (tiny shapes, a CPU smoke run) to a fresh temporary directory, so a smoke run
never overwrites GPU results.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import plots

MODULES = ("ssd", "conv1d", "attention", "grouped_matmul", "model")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LOG_TAIL_LINES = 40

_PROBE = (
    "import json, jax; d = jax.devices()[0]; "
    "print(json.dumps(dict(device=d.device_kind, platform=d.platform, jax=jax.__version__)))"
)


def _run(command: list[str], *, timeout_s: float, echo: bool) -> tuple[int | None, str]:
    """Runs ``command`` from the repository root, echoing its output as it comes.

    Returns:
      ``(exit status, the last LOG_TAIL_LINES lines of output)``; status None when it was
      killed at the timeout.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as process:
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            process.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            assert process.stdout is not None
            for line in process.stdout:
                tail.append(line)
                if echo:
                    print(line, end="", flush=True)
            status = process.wait()
        finally:
            timer.cancel()
    return (None if timed_out.is_set() else status), "".join(tail)


def probe_device(timeout_s: float = 300.0) -> dict[str, str]:
    """``device``, ``platform`` and ``jax`` version as the benchmark processes see them.

    Asked in a child process: this one never initialises a backend, so it holds no device
    memory while the modules run."""
    status, output = _run([sys.executable, "-c", _PROBE], timeout_s=timeout_s, echo=False)
    lines = output.strip().splitlines()
    if status != 0 or not lines:
        raise RuntimeError(f"cannot initialise JAX (status {status}):\n{output}")
    return json.loads(lines[-1])


def run_module(
    name: str, *, quick: bool, json_path: Path, timeout_s: float, echo: bool = True
) -> dict[str, Any]:
    """Runs ``benchmarks.<name>`` in a child process; returns its report (the JSON it
    wrote, plus ``seconds``) or ``{"error", "log", "seconds"}``."""
    command = [sys.executable, "-m", f"benchmarks.{name}", "--out", str(json_path)]
    if quick:
        command.append("--quick")
    start = time.perf_counter()
    status, log = _run(command, timeout_s=timeout_s, echo=echo)
    seconds = time.perf_counter() - start
    if status is None:
        error = f"timed out after {timeout_s:.0f} s"
    elif status < 0:
        error = f"killed by signal {-status}"  # 9: often the kernel's out-of-memory killer
    elif status != 0:
        error = f"exit status {status}"
    elif not json_path.exists():
        error = "exited 0 but wrote no JSON"
    else:
        return json.loads(json_path.read_text()) | dict(seconds=seconds)
    return dict(error=error, log=log, seconds=seconds)


def run(
    modules: Sequence[str] = MODULES,
    *,
    quick: bool = False,
    out_dir: str | Path | None = None,
    timeout_s: float = 1200.0,
    fresh: bool = False,
    echo: bool = True,
) -> Path:
    """Runs ``modules`` one after another; returns the combined JSON's path.

    Modules not run this time are kept from an existing combined file of the same device
    (unless ``fresh``), so a long run can be split into several calls."""
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="benchmarks_quick_") if quick else RESULTS
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = probe_device()
    path = out_dir / f"{plots.slug(device['device'])}.json"
    kept: dict[str, Any] = {}
    if path.exists() and not fresh:
        earlier = json.loads(path.read_text())
        kept = {k: v for k, v in earlier.get("modules", {}).items() if k not in modules}
        if kept:
            print(f"keeping {sorted(kept)} from the earlier run in {path}")
    payload: dict[str, Any] = dict(
        title="pallas_kernels benchmarks",
        **device,
        host=platform.node(),
        quick=quick,
        modules=kept,
    )
    with tempfile.TemporaryDirectory(prefix="benchmarks_") as scratch:
        for name in modules:
            print(f"\n=== benchmarks.{name} ===", flush=True)
            started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
            result = run_module(
                name,
                quick=quick,
                json_path=Path(scratch) / f"{name}.json",
                timeout_s=timeout_s,
                echo=echo,
            )
            payload["modules"][name] = result | dict(started=started)
            _write_json(path, payload)
    print(f"\n## {path}")
    for name, result in payload["modules"].items():
        outcome = (
            f"FAILED: {result['error']}" if "error" in result else f"{len(result['rows'])} rows"
        )
        print(f"  {name:<10} {outcome} ({result['seconds']:.0f} s)")
    _plot(path)
    return path


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes then renames, so a run killed mid-write leaves the previous file intact."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=2))
    partial.replace(path)


def _plot(path: Path) -> list[Path]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"matplotlib is not installed: no plots (later: python -m benchmarks.plots {path})")
        return []
    reports = [r for r in plots.load(path) if not r.error]
    written = plots.save_plots(reports, path.parent)
    for png in written:
        print(f"wrote {png}")
    return written


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="every benchmark module, one combined JSON")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="default: benchmarks/results (with --quick: a fresh temporary directory)",
    )
    parser.add_argument(
        "--modules", nargs="+", default=list(MODULES), choices=MODULES, metavar="MODULE"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200.0, help="seconds per module (default 1200)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="drop the modules an earlier run left in the combined file",
    )
    args = parser.parse_args(argv)
    return run(
        args.modules,
        quick=args.quick,
        out_dir=args.out_dir,
        timeout_s=args.timeout,
        fresh=args.fresh,
    )


if __name__ == "__main__":
    main()
