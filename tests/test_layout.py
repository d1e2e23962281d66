"""The tree's shape (DESIGN §2, §9 "Imports"): no import cycles, no module-level
``__getattr__``, ``flax_models`` on ``pallas_kernels``' public names only, files of a
readable size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGES = ("pallas_kernels", "flax_models")
MAX_LINES = 1000
# What flax_models may import of pallas_kernels: the package's exported names and its
# public modules.
PUBLIC_KERNEL_MODULES = {"pallas_kernels", "pallas_kernels.slots", "pallas_kernels.testing"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules ``name`` imports, at any depth of its code (a function-level
    import that dodges a cycle is still a cycle)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b`` runs ``a/__init__.py`` first; an ``__init__`` that re-exports its
    submodules is not a cycle with them, so edges into a package's own ``__init__`` from
    inside the package are left out."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_find_cycle_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = _without_package_inits({name: _imports(name, path) for name, path in MODULES.items()})
    assert _find_cycle(graph) is None, _find_cycle(graph)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_getattr(name):
    tree = ast.parse(MODULES[name].read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "__getattr__" not in names


def test_flax_models_imports_only_public_kernel_names():
    private = []
    for name, path in MODULES.items():
        if not name.startswith("flax_models"):
            continue
        for target in _imports(name, path):
            if target.startswith("pallas_kernels") and target not in PUBLIC_KERNEL_MODULES:
                private.append((name, target))
        for node in ast.walk(ast.parse(path.read_text())):
            attribute = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            if attribute and node.value.id == "pk" and node.attr.startswith("_"):
                private.append((name, f"pk.{node.attr}"))
    assert not private


def test_no_file_over_the_size_limit():
    long = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long
