"""Benchmark results as tables and plots: time per problem and implementation, next to the
roofline and the in-run baselines.

Reads the results store, ``benchmarks/results/<device>/<module>.json``: every file in the
one schema ``benchmarks.harness`` writes (``device``, ``jax``, ``date``, ``command``,
``ceilings`` with ``copy_gbps`` and ``matmul_tflops``, and ``rows``: ``problem``,
``implementation``, ``median_ms``, ``roofline_ms``, ``roofline_fraction``,
``speedup_vs_xla``, ...). Rows without a time (a prefix-caching run's) are tables only;
rows of a tiling sweep (``sweep: true``) are left out of the plots.

A row with a ``serving`` record (``benchmarks.serving``) also gets its latency plot,
``serving_<policy>_latency.png``: the distributions of time to first token and time per
output token over the trace's requests.

``python -m benchmarks.plots [FILE_OR_DIR ...] [--out-dir DIR]`` (default: the whole store)
writes one PNG per op beside each JSON: ``<module>_<op>.png``, or ``<module>.png`` where the
op is the module's name (``nvidia_h200/conv1d_causal_conv1d.png``, ``nvidia_h200/model.png``).
Rows are grouped by their ``op`` field where they have one, else by module. matplotlib is
imported only to draw (the JSON side needs nothing but the standard library).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS = Path(__file__).resolve().parent / "results"
# Baselines first, then the Pallas backends, then anything else in name order.
_IMPLEMENTATION_ORDER = ("xla", "cudnn", "triton", "mosaic", "auto")
# A results file's top-level keys (``benchmarks.harness.SCHEMA_KEYS``; repeated here so
# reading needs no JAX).
_SCHEMA_KEYS = frozenset(("device", "jax", "date", "command", "ceilings", "rows"))


@dataclasses.dataclass(frozen=True)
class Report:
    """One results file: one module's rows on one device.

    Attributes:
      source: the JSON file.
      module: the benchmark module (the file's name: ``ssd``, ``conv1d``, ``model``, ...).
      device: the device the numbers were measured on (``NVIDIA H200``, ``2 x NVIDIA H200``).
      date: the day of the run (rows kept from earlier runs carry their own ``date``).
      command: the command line of the run.
      ceilings: measured ``copy_gbps`` and ``matmul_tflops`` (empty where none were).
      rows: the result rows.
    """

    source: Path
    module: str
    device: str
    date: str
    command: str
    ceilings: dict[str, float]
    rows: tuple[dict[str, Any], ...]

    @property
    def title(self) -> str:
        return f"benchmarks.{self.module}, {self.date}"

    def timed(self) -> list[dict[str, Any]]:
        """The rows with a time, tiling sweeps left out: what the plots show."""
        return [r for r in self.rows if "median_ms" in r and not r.get("sweep")]

    def ops(self) -> dict[str, list[dict[str, Any]]]:
        """Timed rows grouped by op (a row's ``op`` field, else the module name), in order."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in self.timed():
            groups.setdefault(str(row.get("op", self.module)), []).append(row)
        return groups


def slug(text: str) -> str:
    """A file-name-safe lower-case form: ``"NVIDIA H200"`` -> ``"nvidia_h200"``."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def load(path: str | Path) -> Report:
    """The report of one results file; ``ValueError`` for a JSON of another shape."""
    path = Path(path)
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or set(payload) != _SCHEMA_KEYS:
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path}: not a benchmark result (keys {keys})")
    return Report(
        source=path,
        module=path.stem,
        device=str(payload["device"]),
        date=str(payload["date"]),
        command=str(payload["command"]),
        ceilings=dict(payload["ceilings"] or {}),
        rows=tuple(payload["rows"]),
    )


def load_all(paths: Iterable[str | Path] = (RESULTS,)) -> tuple[list[Report], list[str]]:
    """Reports from files and directories (every ``*.json`` under a directory, sorted).

    Returns:
      ``(reports, skipped)``: the reports, and one line per file that could not be read.
    """
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.rglob("*.json")) if path.is_dir() else [path]
    reports: list[Report] = []
    skipped: list[str] = []
    for file in files:
        try:
            reports.append(load(file))
        except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
            skipped.append(f"{file}: {error}")
    return reports, skipped


def _implementations(rows: Sequence[dict[str, Any]]) -> list[str]:
    names = {r["implementation"] for r in rows}
    known = [n for n in _IMPLEMENTATION_ORDER if n in names]
    return known + sorted(names - set(known))


def _problems(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["problem"] for r in rows))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A text table: time, roofline and speedup per (problem, implementation)."""
    header = (
        f"{'problem':<24}{'impl':<8}{'median ms':>11}{'roof ms':>10}{'% roof':>8}"
        f"{'TFLOP/s':>9}{'GB/s':>8}{'vs xla':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        roof = r.get("roofline_ms") or 0.0
        speedup = r.get("speedup_vs_xla")
        lines.append(
            f"{r['problem']:<24}{r['implementation']:<8}{r['median_ms']:>11.4g}"
            + (
                f"{roof:>10.4g}{100 * r.get('roofline_fraction', 0.0):>7.1f}%"
                if roof
                else f"{'':>18}"
            )
            + f"{r.get('tflops', 0.0):>9.2f}{r.get('gbps', 0.0):>8.0f}"
            + ("" if speedup is None else f"{speedup:>7.2f}x")
        )
    return "\n".join(lines)


def plot_op(
    rows: Sequence[dict[str, Any]], *, title: str, ceilings: dict[str, float] | None = None
) -> Figure:
    """One op: median time per problem and implementation (log scale, min-max whiskers)
    with each problem's roofline floor as a black bar, speedups over ``xla`` above the
    bars; beside it, the fraction of the roofline each implementation reaches."""
    from matplotlib.figure import Figure

    problems, impls = _problems(rows), _implementations(rows)
    by_key = {(r["problem"], r["implementation"]): r for r in rows}
    has_roofline = any((r.get("roofline_ms") or 0.0) > 0 for r in rows)
    width = 0.8 / len(impls)
    fig = Figure(figsize=(max(7.0, 3.0 + 0.9 * len(problems)), 7.5 if has_roofline else 4.5))
    axes = fig.subplots(2 if has_roofline else 1, 1, squeeze=False)[:, 0]
    ax = axes[0]
    for i, impl in enumerate(impls):
        xs, ms, low, high, speedups = [], [], [], [], []
        for p, problem in enumerate(problems):
            r = by_key.get((problem, impl))
            if r is None:
                continue
            xs.append(p + (i - (len(impls) - 1) / 2) * width)
            ms.append(r["median_ms"])
            low.append(r["median_ms"] - r.get("min_ms", r["median_ms"]))
            high.append(r.get("max_ms", r["median_ms"]) - r["median_ms"])
            speedups.append(r.get("speedup_vs_xla") if impl != "xla" else None)
        ax.bar(xs, ms, width, yerr=[low, high], capsize=2, label=impl, color=_color(impl, impls))
        tops = [m + h for m, h in zip(ms, high, strict=True)]  # above the whisker
        for x, top, s in zip(xs, tops, speedups, strict=True):
            if s is not None:
                ax.annotate(
                    f"{s:.3g}x",
                    (x, top),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=7,
                )
    label = "roofline"
    for p, problem in enumerate(problems):
        floor = max((r.get("roofline_ms") or 0.0) for r in rows if r["problem"] == problem)
        if floor > 0:
            ax.hlines(floor, p - 0.45, p + 0.45, color="k", lw=2.5, label=label)
            label = None  # one legend entry
    ax.set_yscale("log")
    ax.set_ylabel("median time per call (ms)")
    ax.set_xticks(range(len(problems)))
    ax.set_xticklabels(problems, rotation=20, ha="right", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title("time (lower is better)", fontsize=9)
    if has_roofline:
        frac = axes[1]
        for i, impl in enumerate(impls):
            points = [
                (p + (i - (len(impls) - 1) / 2) * width, 100 * r["roofline_fraction"])
                for p, problem in enumerate(problems)
                if (r := by_key.get((problem, impl))) is not None and r.get("roofline_ms")
            ]
            if points:
                x, y = zip(*points, strict=True)
                frac.bar(x, y, width, label=impl, color=_color(impl, impls))
        frac.axhline(100, color="k", lw=1, ls="--")
        frac.set_ylabel("% of roofline (higher is better)")
        frac.set_xticks(range(len(problems)))
        frac.set_xticklabels(problems, rotation=20, ha="right", fontsize=8)
        frac.set_title("fraction of the roofline", fontsize=9)
    caption = title
    if ceilings:
        caption += (
            f"\nroofline: copy {ceilings.get('copy_gbps', 0):.4g} GB/s, "
            f"bf16 matmul {ceilings.get('matmul_tflops', 0):.3g} TFLOP/s (measured in the run)"
        )
    fig.suptitle(caption, fontsize=10)
    fig.tight_layout()
    return fig


def overview(reports: Sequence[Report]) -> Figure:
    """Every problem of every report (of one device) in one figure: each non-``xla``
    implementation's speedup over ``xla`` and its fraction of the roofline. Problems are
    labelled ``module: problem``, prefixed with the file when the reports come from several."""
    from matplotlib.figure import Figure

    several_files = len({r.source for r in reports}) > 1
    entries = []  # (label, implementation, speedup, roofline fraction)
    for report in reports:
        for r in report.timed():
            if r["implementation"] != "xla":
                label = f"{report.module}: {r['problem']}"
                if several_files:
                    label = f"{report.source.parent.name}/{report.source.name} {label}"
                roof = r.get("roofline_fraction") if r.get("roofline_ms") else None
                entries.append((label, r["implementation"], r.get("speedup_vs_xla"), roof))
    labels = list(dict.fromkeys(e[0] for e in entries))
    impls = _implementations([{"implementation": e[1]} for e in entries]) if entries else []
    fig = Figure(figsize=(11, 1.5 + 0.28 * max(len(labels), 1)))
    speed, roof = fig.subplots(1, 2, sharey=True)
    height = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        offset = (i - (len(impls) - 1) / 2) * height
        for ax, column in ((speed, 2), (roof, 3)):
            points = [
                (labels.index(e[0]) + offset, e[column] * (100 if column == 3 else 1))
                for e in entries
                if e[1] == impl and e[column] is not None
            ]
            if points:
                y, x = zip(*points, strict=True)
                ax.barh(y, x, height, color=_color(impl, impls), label=impl)
    speed.axvline(1, color="k", lw=1)
    speed.set_xscale("log")
    speed.set_xlabel("speedup over xla (log)")
    roof.axvline(100, color="k", lw=1, ls="--")
    roof.set_xlabel("% of roofline")
    speed.set_yticks(range(len(labels)))
    speed.set_yticklabels(labels, fontsize=8)
    speed.invert_yaxis()
    speed.legend(fontsize=8)
    devices = ", ".join(sorted({r.device for r in reports}))
    fig.suptitle(f"all benchmarks on {devices}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_serving(serving: dict[str, Any], *, title: str) -> Figure:
    """A serving trace's latencies (``benchmarks.serving``): the CDF over requests of the
    time to first token and of the time per output token, p50 and p99 marked."""
    from matplotlib.figure import Figure

    requests = serving.get("requests") or []
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    for ax, key, label, scale in (
        (axes[0], "ttft_s", "time to first token (s)", 1.0),
        (axes[1], "tpot_s", "time per output token (ms)", 1e3),
    ):
        values = sorted(
            r[key] * scale for r in requests if r.get(key) is not None and r[key] == r[key]
        )
        if not values:
            ax.set_axis_off()
            continue
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", color="C4")
        for q, style in ((0.5, "--"), (0.99, ":")):
            # Linear interpolation between ranks (NumPy's default, as the JSON's p50/p99).
            position = q * (len(values) - 1)
            low = int(position)
            high = min(low + 1, len(values) - 1)
            value = values[low] + (values[high] - values[low]) * (position - low)
            ax.axvline(value, color="k", lw=1, ls=style, label=f"p{round(100 * q)} {value:.3g}")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8, loc="lower right")
    run = serving.get("run") or {}
    engine = serving.get("engine") or {}
    caption = title
    if run:
        caption += (
            f"\n{len(requests)} requests, {run.get('output_tokens_per_s', 0):.4g} output tok/s, "
            f"{run.get('total_tokens_per_s', 0):.4g} tok/s, {run.get('steps', 0)} steps, "
            f"{run.get('programs', 0)} programs, padding {run.get('padding_fraction', 0):.1%}"
        )
    if engine:
        caption += (
            f"\n{engine.get('max_slots')} slots, token budget {engine.get('token_budget')}, "
            f"token buckets {engine.get('bucket_policy', '?')}"
        )
    fig.suptitle(caption, fontsize=9)
    fig.tight_layout()
    return fig


def _color(impl: str, impls: Sequence[str]) -> str:
    fixed = {"xla": "C0", "triton": "C1", "mosaic": "C2", "cudnn": "C3", "auto": "C4"}
    return fixed.get(impl, f"C{5 + impls.index(impl) % 5}")


def figures(report: Report) -> dict[str, Figure]:
    """One figure per op of ``report``, named as its PNG (without ``.png``), and one
    ``serving_<policy>_latency`` for each serving trace's row."""
    result = {}
    for op, rows in report.ops().items():
        name = report.module if slug(op) == report.module else f"{report.module}_{slug(op)}"
        title = f"{op}: {report.title} on {report.device}"
        result[name] = plot_op(rows, title=title, ceilings=report.ceilings)
    for row in report.rows:
        serving = row.get("serving") or {}
        if serving.get("requests"):
            policy = slug(row["problem"].rsplit("/", 1)[-1])
            title = f"{row['problem']}: {report.title} on {report.device}"
            result[f"serving_{policy}_latency"] = plot_serving(serving, title=title)
    return result


def save_plots(reports: Iterable[Report], out_dir: str | Path | None = None) -> list[Path]:
    """Writes every figure of every report as ``<name>.png`` beside its JSON (or in
    ``out_dir``); returns the paths."""
    written = []
    for report in reports:
        directory = report.source.parent if out_dir is None else Path(out_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for name, fig in figures(report).items():
            path = directory / f"{name}.png"
            fig.savefig(path, dpi=120)
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description="PNG plots of benchmark JSON results")
    parser.add_argument(
        "paths", nargs="*", default=[str(RESULTS)], help="JSON files or directories of them"
    )
    parser.add_argument("--out-dir", default=None, help="default: beside each JSON file")
    args = parser.parse_args(argv)
    reports, skipped = load_all(args.paths)
    for line in skipped:
        print(f"skipped {line}")
    written = save_plots(reports, args.out_dir)
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
