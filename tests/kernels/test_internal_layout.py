"""The kernel-file convention of ``pallas_kernels`` (docs/design.md, layout), checked on the
source: per op folder and Pallas backend, ``<backend>.py`` (forward kernels and the
``jax.custom_vjp`` wiring), ``<backend>_vjp.py`` (backward kernels) and
``<backend>_config.py`` (block sizes, heuristics, shapes both need). These tests read the
package's files, not its API: they are internal by name.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "pallas_kernels"
MAX_LINES = 1000
# Calls that launch a kernel, and the keyword that names it in profiles and lowered HLO.
_LAUNCHES = {"pallas_call": "name", "kernel": "kernel_name"}


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts)


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Dotted names of the ``pallas_kernels`` modules ``path`` imports (``from a import b``
    counts as ``a.b``: b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("pallas_kernels")}


def _dotted(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_internal_every_kernel_launch_is_named(path):
    """Every ``pl.pallas_call`` passes ``name=`` and every Mosaic GPU ``plgpu.kernel``
    ``kernel_name=``: profiles and the lowered HLO show the kernel (and its config) by it."""
    unnamed = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        keyword = _LAUNCHES.get(node.func.attr)
        owner = node.func.value
        if keyword is None or not (isinstance(owner, ast.Name) and owner.id in ("pl", "plgpu")):
            continue
        if node.func.attr == "kernel" and owner.id != "plgpu":
            continue
        if not any(k.arg == keyword for k in node.keywords):
            unnamed.append(f"line {node.lineno}: {owner.id}.{node.func.attr} without {keyword}=")
    assert not unnamed, unnamed


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_internal_no_module_over_the_line_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines (> {MAX_LINES})"


def _backend_files() -> list[tuple[pathlib.Path, str]]:
    """``(op folder, backend)`` of every Pallas backend file of every op."""
    found = []
    for folder in sorted(p for p in PACKAGE.iterdir() if (p / "api.py").exists()):
        for backend in ("triton", "mosaic"):
            if (folder / f"{backend}.py").exists():
                found.append((folder, backend))
    return found


@pytest.mark.parametrize(
    ("folder", "backend"), _backend_files(), ids=lambda v: v.name if hasattr(v, "name") else v
)
def test_internal_forward_and_backward_files_import_in_one_direction(folder, backend):
    """The backward kernels never import the forward file (the forward wires them into its
    ``custom_vjp``), and the config file imports neither; a decode file imports no vjp."""
    package = _dotted(folder)
    forward, vjp, config = (f"{package}.{backend}{s}" for s in ("", "_vjp", "_config"))
    for path in folder.glob(f"{backend}_*.py"):
        imported = _imported_modules(path)
        if path.stem == f"{backend}_config":
            assert not imported & {forward, vjp}, (path.name, imported)
        elif path.stem == f"{backend}_vjp":
            assert forward not in imported, (path.name, imported)
        else:  # shared pieces (<backend>_common) and other kernels (<backend>_decode)
            assert not imported & {forward, vjp}, (path.name, imported)
