"""Runs benchmark modules one after another into the results store; plots each file.

``python -m benchmarks.run_all [--quick] [--out-dir DIR] [--modules ssd conv1d ...]
[--timeout SECONDS]``

Each module runs in its own process, ``python -m benchmarks.<module> --results-dir DIR``,
and writes ``DIR/<device>/<module>.json`` itself (``benchmarks.harness``'s one schema;
rows of an earlier run there that this one does not measure again are kept), so a module
that raises, runs out of memory or hangs past ``--timeout`` leaves the others' files and
its own earlier one, and each module starts on a device no earlier module holds memory on.
A failed module is reported with its log's tail. The PNG plots go beside each JSON
(``benchmarks.plots``; skipped with a note when matplotlib is missing). ``DIR`` defaults to
``benchmarks/results``; with ``--quick`` (tiny shapes, a CPU smoke run) to a fresh
temporary directory, so a smoke run never overwrites GPU results.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import plots

MODULES = ("ssd", "conv1d", "attention", "grouped_matmul", "model")  # the default run
# Every module that writes to the store (serving, prefix and train take minutes to hours).
ALL_MODULES = (*MODULES, "serving", "prefix", "train")
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


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One module's run: the results file it wrote (None if it failed), or why not."""

    module: str
    path: Path | None
    seconds: float
    error: str | None = None
    log: str | None = None


def run_module(
    name: str, *, quick: bool, out_dir: Path, device: str, timeout_s: float, echo: bool = True
) -> Outcome:
    """Runs ``benchmarks.<name> --results-dir out_dir`` in a child process."""
    command = [sys.executable, "-m", f"benchmarks.{name}", "--results-dir", str(out_dir)]
    if quick:
        command.append("--quick")
    path = out_dir / device / f"{name}.json"
    before = path.stat().st_mtime_ns if path.exists() else None
    start = time.perf_counter()
    status, log = _run(command, timeout_s=timeout_s, echo=echo)
    seconds = time.perf_counter() - start
    if status is None:
        error = f"timed out after {timeout_s:.0f} s"
    elif status < 0:
        error = f"killed by signal {-status}"  # 9: often the kernel's out-of-memory killer
    elif status != 0:
        error = f"exit status {status}"
    elif not path.exists() or path.stat().st_mtime_ns == before:
        error = f"exited 0 but wrote no {path}"
    else:
        return Outcome(name, path, seconds)
    return Outcome(name, None, seconds, error=error, log=log)


def run(
    modules: Sequence[str] = MODULES,
    *,
    quick: bool = False,
    out_dir: str | Path | None = None,
    timeout_s: float = 1200.0,
    echo: bool = True,
) -> list[Outcome]:
    """Runs ``modules`` one after another into ``out_dir/<device>/``, then plots the files
    they wrote; returns each module's outcome."""
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="benchmarks_quick_") if quick else RESULTS
    out_dir = Path(out_dir)
    device = plots.slug(probe_device()["device"])
    outcomes = []
    for name in modules:
        print(f"\n=== benchmarks.{name} ===", flush=True)
        outcomes.append(
            run_module(
                name, quick=quick, out_dir=out_dir, device=device, timeout_s=timeout_s, echo=echo
            )
        )
    print(f"\n## {out_dir / device}")
    for o in outcomes:
        outcome = f"FAILED: {o.error}" if o.error else str(o.path)
        print(f"  {o.module:<14} {outcome} ({o.seconds:.0f} s)")
        if o.log and not echo:
            print("    " + o.log.rstrip().replace("\n", "\n    "))
    _plot([o.path for o in outcomes if o.path is not None])
    return outcomes


def _plot(paths: Sequence[Path]) -> list[Path]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots (later: python -m benchmarks.plots)")
        return []
    reports, skipped = plots.load_all(paths)
    for line in skipped:
        print(f"skipped {line}")
    written = plots.save_plots(reports)
    for png in written:
        print(f"wrote {png}")
    return written


def main(argv: Sequence[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description="benchmark modules into the results store")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="default: benchmarks/results (with --quick: a fresh temporary directory)",
    )
    parser.add_argument(
        "--modules", nargs="+", default=list(MODULES), choices=ALL_MODULES, metavar="MODULE"
    )
    parser.add_argument(
        "--timeout", type=float, default=1200.0, help="seconds per module (default 1200)"
    )
    args = parser.parse_args(argv)
    return run(
        args.modules,
        quick=args.quick,
        out_dir=args.out_dir,
        timeout_s=args.timeout,
    )


if __name__ == "__main__":
    main()
