"""``tools/train_demo_model.py --quick``: trains, saves a directory the loader reads, and
the engine's log-probabilities equal the training forward's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from flax_models import HybridLM, load_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# KJV-style lines (the format of ``bible -f``): two books, a few chapters each.
VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
    "And God called the light Day, and the darkness he called Night.",
    "And the evening and the morning were the first day.",
]


def load_script():
    spec = importlib.util.spec_from_file_location(
        "train_demo_model", ROOT / "tools" / "train_demo_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_corpus(path: Path) -> None:
    lines = []
    for book in ("Ge", "Exo"):
        for chapter in range(1, 31):
            for verse in range(1, 9):
                text = VERSES[(chapter + verse) % len(VERSES)]
                lines.append(f"{book}{chapter}:{verse} {text}")
    path.write_text("\n".join(lines) + "\n")


def test_quick_run_saves_a_servable_model(tmp_path):
    script = load_script()
    corpus = tmp_path / "kjv.txt"
    write_corpus(corpus)
    documents = script.read_documents(corpus)
    assert len(documents) == 60  # one per chapter
    assert documents[0].splitlines()[0].startswith("And God said, Let there be light")
    out = tmp_path / "model"
    log = script.main(["--quick", "--corpus", str(corpus), "--output", str(out), "--seed", "1"])

    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_log.json",
    } <= names
    saved = json.loads((out / "training_log.json").read_text())
    assert saved["logprob_check"]["passed"] and saved["logprob_check"]["max_abs_diff"] <= 1e-3
    assert log["logprob_check"]["logprobs_compared"] > 0
    assert [p["step"] for p in saved["curve"]] == list(range(1, saved["steps_run"] + 1))
    assert np.isfinite(saved["held_out"]["perplexity"])
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0 and generation["temperature"] == 0.8

    model = load_hf_checkpoint(out)
    assert isinstance(model, HybridLM) and model.cfg.layer_pattern == "M*"
    params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params == saved["parameters"]

    # --evaluate-only re-derives the held-out split through the saved tokenizer and
    # scores the saved weights as the training run did.
    again = script.main(
        ["--quick", "--corpus", str(corpus), "--output", str(out), "--seed", "1", "--evaluate-only"]
    )
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["held_out_tokens"] == saved["corpus"]["held_out_tokens"]
    assert np.isclose(
        evaluation["held_out_saved_bf16"]["loss"], saved["held_out_saved_bf16"]["loss"], rtol=1e-6
    )
    assert again["logprob_check"]["passed"]
