"""The notebooks run top to bottom (small sizes on a CPU) and are committed without outputs.

Each runs in a fresh kernel of this interpreter, from ``notebooks/`` as the working
directory (on a CPU with XLA's backend optimisation off: they compile many small programs
once each); a cell that raises fails the test with the cell and its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.helpers import fast_compile_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
kernelspec = pytest.importorskip("ipykernel.kernelspec")
pytest.importorskip("matplotlib")
KernelManager = pytest.importorskip("jupyter_client.manager").KernelManager
KernelSpecManager = pytest.importorskip("jupyter_client.kernelspec").KernelSpecManager

NOTEBOOK_DIR = Path(__file__).parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL = "pallas-hybrid-tests"
CELL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory) -> list[str]:
    """A kernelspec for this interpreter (not whatever ``python3`` kernel the user has)."""
    kernels = tmp_path_factory.mktemp("kernels")
    kernelspec.write_kernel_spec(kernels / KERNEL, overrides={"display_name": KERNEL})
    return [str(kernels)]


def execute(notebook, kernel_dirs: list[str]) -> None:
    """Runs every cell; ``nbclient.exceptions.CellExecutionError`` if one raises."""
    manager = KernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=kernel_dirs)
    )
    client = nbclient.NotebookClient(
        notebook,
        km=manager,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute(env=fast_compile_env(os.environ))


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_kernels.ipynb",
        "02_hybrid_model.ipynb",
        "03_benchmarks.ipynb",
        "04_finetune.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"cell {i} has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_dirs):
    execute(nbformat.read(path, as_version=4), kernel_dirs)


def test_a_cell_that_raises_fails_the_run(kernel_dirs):
    flags = fast_compile_env(os.environ).get("XLA_FLAGS")
    notebook = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "import os, sys\n"
                f"assert sys.executable == {sys.executable!r}\n"
                f"assert os.environ.get('XLA_FLAGS') == {flags!r}"
            ),
            nbformat.v4.new_code_cell("raise RuntimeError('boom')"),
        ]
    )
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
        execute(notebook, kernel_dirs)
