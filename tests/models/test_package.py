"""The package's public names and its packaging metadata."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import flax_models

PYPROJECT = Path(__file__).parent.parent.parent / "pyproject.toml"


def test_flax_models_reexports_its_public_api():
    public = {  # DESIGN §9 "Imports"
        "HybridConfig",
        "HybridLM",
        "load_hf_checkpoint",
        "save_hf_checkpoint",
        "Engine",
        "LLM",
        "SamplingParams",
        "RequestOutput",
        "CompletionOutput",
    }
    assert public <= set(flax_models.__all__)
    for name in flax_models.__all__:
        assert getattr(flax_models, name) is not None, name
    assert flax_models.Engine.__module__ == "flax_models.serving.engine"
    assert flax_models.HybridLM.__module__ == "flax_models.model"
    assert flax_models.LLM.__module__ == "flax_models.serving.text"
    assert flax_models.SamplingParams.__module__ == "flax_models.serving.sampling"
    assert flax_models.RequestOutput.__module__ == "flax_models.serving.outputs"


def test_dependencies_cover_the_text_path():
    """LLM needs tokenizers and jinja2, the generate CLI tqdm; none is imported with the
    package, so `import flax_models` works without them."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() for d in dependencies}
    assert {"tokenizers", "jinja2", "tqdm"} <= names
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, flax_models; "
            "print(sorted({'tokenizers', 'jinja2', 'tqdm'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert loaded.stdout.strip() == "[]"


def test_license_is_an_spdx_expression_for_a_setuptools_that_reads_it():
    """setuptools 77 reads PEP 639 SPDX expressions and deprecates the ``{text = ...}`` table."""
    project = tomllib.loads(PYPROJECT.read_text())
    assert project["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    match = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools.replace(" ", ""))
    assert match and int(match.group(1)) >= 77, setuptools
