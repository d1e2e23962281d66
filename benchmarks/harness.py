"""Timing, measured ceilings and reporting shared by every benchmark module.

Each figure is a median over repeated samples after warm-up; each sample times a batch of
back-to-back calls (at least ``min_sample_ms`` of work) ended by one ``block_until_ready``:
dispatch runs ahead of the GPU, so the host's per-call cost and the final synchronisation
are amortised and compile time stays out. Ops shorter than their own dispatch (decode
updates) are repeated inside one jitted program (:func:`time_cache_update`), so the figure
is the GPU's time per update, launch gaps included, not the host's. Ceilings (copy
bandwidth, bf16 matmul rate) are measured in the same run, never written down, and every
row reports its fraction of the roofline.

Every module writes one schema (:data:`SCHEMA_KEYS`: ``device``, ``jax``, ``date``,
``command``, ``ceilings``, ``rows``; one row per problem and implementation), to ``--out
PATH`` and/or, with ``--results-dir DIR``, to the results store ``DIR/<device>/<module>.json``
(``benchmarks/results/nvidia_h200/ssd.json``; :class:`Output`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from benchmarks import plots
from pallas_kernels.backend import Op

ROOT: Final = Path(__file__).resolve().parent.parent
# The results store: ``<device>/<module>.json``, one file per benchmark module and device
# (``nvidia_h200/ssd.json``, ``nvidia_h200x2/model.json``), each in the schema below, plots
# beside them (``nvidia_h200/ssd_<op>.png``).
RESULTS: Final = ROOT / "benchmarks" / "results"
# Every results file's top-level keys, and what each row must have. ``ceilings`` is the
# run's measured ``copy_gbps`` and ``matmul_tflops`` (empty for a module that measures no
# roofline); a row kept from an earlier run carries that run's ``date``, ``command`` and
# ``ceilings`` itself.
SCHEMA_KEYS: Final = ("device", "jax", "date", "command", "ceilings", "rows")
ROW_KEYS: Final = ("problem", "implementation")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out PATH`` and ``--results-dir DIR``: where a module writes its JSON."""
    parser.add_argument("--out", default=None, help="write the JSON here (replacing it)")
    parser.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="write DIR/<device>/<module>.json (benchmarks/results is the committed store), "
        "keeping the rows of an earlier run there that this run does not measure again",
    )


def output_for(args: argparse.Namespace, module: str, argv: Sequence[str]) -> Output:
    """The :class:`Output` of module ``benchmarks.<module>`` run with ``argv`` (its
    arguments as given, for the file's ``command``)."""
    return Output(
        module=module,
        command=shlex.join(["python", "-m", f"benchmarks.{module}", *argv]),
        path=None if args.out is None else Path(args.out),
        results_dir=None if args.results_dir is None else Path(args.results_dir),
    )


def parse_args(
    argv: Sequence[str] | None,
    description: str,
    *,
    module: str,
    command: Sequence[str] | None = None,
) -> argparse.Namespace:
    """``--out PATH`` / ``--results-dir DIR`` (JSON), ``--quick`` (tiny shapes, a CPU
    smoke run) and ``--only``: the arguments every benchmark module takes. ``args.output``
    is the :class:`Output` to report to; ``command`` is the module's whole argument list
    where it took some of ``argv``'s options itself (default ``argv``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=description)
    add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--only", nargs="+", default=None, metavar="PROBLEM", help="run only these problems"
    )
    args = parser.parse_args(argv)
    args.output = output_for(args, module, argv if command is None else command)
    return args


def device_name(devices: int = 1) -> str:
    """The results store's name of this machine's device kind run ``devices`` at a time:
    ``nvidia_h200``, ``nvidia_h200x2``."""
    kind = plots.slug(jax.devices()[0].device_kind)
    return kind if devices <= 1 else f"{kind}x{devices}"


def results_path(module: str, device: str, root: str | Path = RESULTS) -> Path:
    """``root/<device>/<module>.json``."""
    return Path(root) / device / f"{module}.json"


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """Rows of two runs are the same measurement when these agree (a tiling sweep's rows
    differ by their config)."""
    return (row.get("problem"), row.get("implementation"), row.get("config_name"))


@dataclasses.dataclass
class Output:
    """Where a module's report goes: ``path`` (``--out``, replaced) and/or
    ``results_dir/<device>/<module>.json`` (``--results-dir``; the rows of an earlier run
    there that this run does not measure again are kept, each with its own run's
    ``date``, ``command`` and ``ceilings``).

    Attributes:
      module: the benchmark module (``ssd``, ``model``, ...), the file's name in the store.
      command: the command line of this run.
      path: ``--out``, else None.
      results_dir: ``--results-dir``, else None.
      devices: how many devices a row runs on at most (a tp = 2 mesh: 2); names the
        store's device folder (``nvidia_h200x2``).
    """

    module: str
    command: str
    path: Path | None = None
    results_dir: Path | None = None
    devices: int = 1
    _kept: list[dict[str, Any]] | None = dataclasses.field(default=None, repr=False)

    def paths(self) -> list[Path]:
        store = (
            []
            if self.results_dir is None
            else [results_path(self.module, device_name(self.devices), self.results_dir)]
        )
        return ([] if self.path is None else [self.path]) + store

    def write(self, rows: Sequence[dict[str, Any]], ceilings: Ceilings | None) -> None:
        """Writes ``rows`` in the schema (first process only)."""
        if jax.process_index() != 0:
            return
        payload = dict(
            device=jax.devices()[0].device_kind,
            jax=jax.__version__,
            date=datetime.datetime.now(datetime.UTC).date().isoformat(),
            command=self.command,
            ceilings={} if ceilings is None else dataclasses.asdict(ceilings),
            rows=list(rows),
        )
        if self.devices > 1:
            payload["device"] = f"{self.devices} x {payload['device']}"
        if self.path is not None:
            _write_json(self.path, payload)
        if self.results_dir is not None:
            path = results_path(self.module, device_name(self.devices), self.results_dir)
            if self._kept is None:  # read once, before this run first writes the file
                self._kept = _earlier_rows(path)
            measured = {_row_key(r) for r in rows}
            kept = [r for r in self._kept if _row_key(r) not in measured]
            _write_json(path, payload | dict(rows=list(rows) + kept))


def _earlier_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of the results file at ``path`` (none if there is none), each with its run's
    ``date``, ``command`` and ``ceilings`` unless it carries its own."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    check_schema(earlier, path)
    run = {key: earlier[key] for key in ("date", "command", "ceilings")}
    return [run | r for r in earlier["rows"]]


def check_schema(payload: Any, source: str | Path = "results") -> None:
    """``ValueError`` unless ``payload`` is a results file: exactly :data:`SCHEMA_KEYS` at
    the top, ``ceilings`` a dict (empty, or both rates), ``rows`` a list of dicts with
    :data:`ROW_KEYS`."""
    if not isinstance(payload, dict) or set(payload) != set(SCHEMA_KEYS):
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{source}: top-level keys {keys}, expected {sorted(SCHEMA_KEYS)}")
    for key in ("device", "jax", "date", "command"):
        if not isinstance(payload[key], str) or not payload[key]:
            raise ValueError(f"{source}: {key}={payload[key]!r} is not a non-empty string")
    ceilings = payload["ceilings"]
    if not isinstance(ceilings, dict) or (
        ceilings and set(ceilings) != {f.name for f in dataclasses.fields(Ceilings)}
    ):
        raise ValueError(f"{source}: ceilings={ceilings!r}, expected copy_gbps, matmul_tflops")
    if not isinstance(payload["rows"], list):
        raise ValueError(f"{source}: rows is not a list")
    for i, r in enumerate(payload["rows"]):
        if not isinstance(r, dict) or any(not isinstance(r.get(k), str) for k in ROW_KEYS):
            raise ValueError(f"{source}: rows[{i}] lacks a string {' or '.join(ROW_KEYS)}")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    """Writes then renames, so a run killed mid-write leaves the previous file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=1, default=_json_default) + "\n")
    partial.replace(path)


# Set by :func:`spawn_processes` in each process it starts: "index/count/port".
PROCESS_ENV = "BENCHMARK_PROCESS"


def spawn_processes(count: int, module: str, argv: Sequence[str]) -> int:
    """Runs ``python -m module *argv`` as ``count`` processes of this host, joined by
    ``jax.distributed`` on 127.0.0.1 (:func:`join_processes`), one GPU each; returns the
    first non-zero exit code, else 0.

    One process per GPU is how a multi-host job runs; on one host it also gives every GPU
    a host thread of its own to launch its kernels (a process that drives several launches
    each step's kernels for all of them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A SIGTERM (a timeout) ends this process through the ``finally`` below, which takes
    # the children with it: left running, they would hold their GPUs.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = []
    try:
        for index in range(count):
            env = {**os.environ, PROCESS_ENV: f"{index}/{count}/{port}"}
            procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
        codes = [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        signal.signal(signal.SIGTERM, previous)
    return next((code for code in codes if code), 0)


def join_processes() -> None:
    """In a process started by :func:`spawn_processes`: ``jax.distributed.initialize`` with
    this process's GPU (CPU devices talk through gloo); the processes after the first print
    nothing (their rows are the first's). Elsewhere it does nothing. Call it before any
    device is touched."""
    spec = os.environ.get(PROCESS_ENV)
    if spec is None:
        return
    index, count, port = (int(field) for field in spec.split("/"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}",
        num_processes=count,
        process_id=index,
        local_device_ids=[index],  # GPUs only: CPU processes keep their own devices
        initialization_timeout=300,
    )
    if index:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def selected(name: str, only: Sequence[str] | None) -> bool:
    """Whether problem ``name`` runs under ``--only``."""
    return only is None or name in only


def runnable(op: Op) -> list[str]:
    """The backends of ``op`` this machine runs when named (sorted); whether one serves a
    given call is ``pk.backend_for``'s to say."""
    device = jax.devices()[0]
    return sorted(b.name for b in op.backends if b.device_reason(device, auto=False) is None)


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float


def time_fn(
    fn: Callable[[], Any], *, warmup: int = 3, samples: int = 15, min_sample_ms: float = 25.0
) -> Timing:
    """Times ``fn()`` (already jitted, arguments closed over): median ms per call."""
    for _ in range(max(warmup - 1, 0)):
        jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    once_ms = max((time.perf_counter() - start) * 1e3, 1e-3)
    calls = max(1, min(1000, round(min_sample_ms / once_ms)))
    if jax.process_count() > 1:
        # Every process must run the same programs (their collectives pair up): process
        # 0's count.
        calls = int(multihost_utils.broadcast_one_to_all(np.int32(calls)))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return Timing(statistics.median(times), min(times), max(times))


def time_cache_update(
    update: Callable[[Any], tuple[Any, Any]],
    make_cache: Callable[[], Any],
    *,
    repeats: int = 32,
    **kwargs: Any,
) -> Timing:
    """Times ``update(cache) -> (out, new_cache)`` as a serving step runs it: ``repeats``
    updates chained through the cache inside one jitted program with the cache donated
    (each feeds the next the cache it returns, so none can be elided), divided by
    ``repeats``. ``make_cache`` gives a fresh cache (a donated one cannot be reused)."""

    def chained(cache):
        outs = []
        for _ in range(repeats):
            out, cache = update(cache)
            outs.append(out)
        return outs[-1], cache

    step = jax.jit(chained, donate_argnums=0)
    state = {"cache": make_cache()}

    def call():
        out, state["cache"] = step(state["cache"])
        return out

    timing = time_fn(call, **kwargs)
    return Timing(*(t / repeats for t in dataclasses.astuple(timing)))


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured in this run: device-to-device copy (bytes read + written) and bf16 matmul."""

    copy_gbps: float
    matmul_tflops: float


def spin_up(seconds: float = 1.0) -> None:
    """Keeps the GPU busy for a while: an idle GPU sits at low clocks and takes a moment of
    load to ramp them, which would otherwise show up in the first measurements."""
    a = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.bfloat16)
    matmul = jax.jit(lambda u: u @ u)
    jax.block_until_ready(matmul(a))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready([matmul(a) for _ in range(10)])


def measure_ceilings(*, quick: bool = False) -> Ceilings:
    """Copy bandwidth (1 GiB read + 1 GiB written) and bf16 matmul rate (8192³ on random
    data), after a spin-up."""
    if not quick:
        spin_up()
    n = 1 << (20 if quick else 29)  # 1 GiB of bf16 on a GPU
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    # A plain copy: XLA's elementwise fusions (e.g. a * -1) reach only ~80% of it.
    copy = jax.jit(jnp.copy)
    t = time_fn(lambda: copy(x), samples=25, min_sample_ms=100.0).median_ms
    copy_gbps = 2 * x.nbytes / (t * 1e-3) / 1e9
    m = 512 if quick else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda u, w: jnp.dot(u, w, preferred_element_type=jnp.bfloat16))
    t = time_fn(lambda: matmul(a, b), samples=25, min_sample_ms=100.0).median_ms
    return Ceilings(copy_gbps=copy_gbps, matmul_tflops=2 * m**3 / (t * 1e-3) / 1e12)


def roofline_ms(flops: float, bytes_moved: float, ceilings: Ceilings) -> float:
    """The larger of the compute and memory floors."""
    return (
        max(flops / (ceilings.matmul_tflops * 1e12), bytes_moved / (ceilings.copy_gbps * 1e9)) * 1e3
    )


def row(
    problem: str,
    implementation: str,
    timing: Timing,
    *,
    flops: float,
    bytes_moved: float,
    ceilings: Ceilings,
    **extra: Any,
) -> dict[str, Any]:
    """One result row: time, rates and fraction of the roofline."""
    seconds = timing.median_ms * 1e-3
    floor = roofline_ms(flops, bytes_moved, ceilings)
    return dict(
        problem=problem,
        implementation=implementation,
        median_ms=timing.median_ms,
        min_ms=timing.min_ms,
        max_ms=timing.max_ms,
        tflops=flops / seconds / 1e12,
        gbps=bytes_moved / seconds / 1e9,
        roofline_ms=floor,
        roofline_fraction=floor / timing.median_ms,
        **extra,
    )


def peak_bytes() -> int | None:
    """The most memory device 0 has held so far (None where the backend keeps no stats;
    with a mesh every device holds its shards, so device 0 stands for each)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def failure_reason(error: BaseException) -> str:
    """The first line of an error (out of memory, a backend refusing the shapes): what a
    benchmark prints for a row it cannot time, then goes on."""
    return (str(error).strip().splitlines() or [""])[0][:200]


def add_speedups(rows: list[dict[str, Any]], baseline: str = "xla") -> None:
    """Adds ``speedup_vs_<baseline>`` to every row whose problem has a baseline row."""
    base = {r["problem"]: r["median_ms"] for r in rows if r["implementation"] == baseline}
    for r in rows:
        if r["problem"] in base:
            r[f"speedup_vs_{baseline}"] = base[r["problem"]] / r["median_ms"]


def report(
    title: str, rows: Sequence[dict[str, Any]], ceilings: Ceilings, output: Output | None
) -> None:
    """Prints the table and writes the JSON (:meth:`Output.write`)."""
    device = jax.devices()[0]
    print(
        f"\n## {title} on {device.device_kind} (jax {jax.__version__}); copy "
        f"{ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s"
    )
    header = (
        f"{'problem':<22}{'impl':<8}{'median ms':>10}{'TFLOP/s':>9}{'GB/s':>8}"
        f"{'roof ms':>9}{'% roof':>8}{'vs xla':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = r.get("speedup_vs_xla")
        print(
            f"{r['problem']:<22}{r['implementation']:<8}{r['median_ms']:>10.3f}"
            f"{r['tflops']:>9.1f}{r['gbps']:>8.0f}{r['roofline_ms']:>9.3f}"
            f"{100 * r['roofline_fraction']:>7.1f}%"
            f"{'' if speedup is None else f'{speedup:.2f}x':>8}"
        )
    write_report(rows, ceilings, output)


def write_report(
    rows: Sequence[dict[str, Any]], ceilings: Ceilings | None, output: Output | None
) -> None:
    """Writes :func:`report`'s JSON without printing (nothing when ``output`` is None): a
    long benchmark rewrites it after every row, so that a run stopped by a time limit keeps
    what it measured."""
    if output is not None:
        output.write(rows, ceilings)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {value!r}")
