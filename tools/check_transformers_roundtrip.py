"""Check that transformers reads what ``save_hf_checkpoint`` writes, to the same logits.

For every fixture family under tests/fixtures (and two random models built from the
``HybridConfig.tiny()`` / ``tiny_moe()`` presets), the project's Python loads the fixture
with ``load_hf_checkpoint``, saves it with ``save_hf_checkpoint`` twice (once with the
fixture's own config.json, once with a config.json written from the ``HybridConfig``'s
fields, ``<family>-rewritten``), and records its own fp32 logits on the fixture's golden
input ids. Then this script, in a torch venv, loads each saved directory with
``AutoModelForCausalLM.from_pretrained`` (fp32, eager attention, CPU) and compares
transformers' logits with the JAX ones (relative error ‖a − b‖ / ‖b‖, and the largest
absolute difference). Exit status 1 when any is above ``--rtol`` (default 1e-4, the
parity tests' bound).

Needs two interpreters: this script runs in a Python 3.11 venv with torch and transformers
(as tools/make_hf_fixtures.py does), and runs the project's own Python (``--flax-python``,
default .venv/bin/python) for the JAX half:

    /root/.pyenv/versions/3.11.7/bin/python -m venv /root/hfenv
    /root/hfenv/bin/pip install torch==2.13.0          # must resolve to 2.13.0+cpu
    /root/hfenv/bin/pip install transformers==5.23.0 safetensors numpy
    /root/hfenv/bin/python tools/check_transformers_roundtrip.py [--out DIR]

``--save OUT`` is the JAX half by itself (what the script runs with ``--flax-python``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def save_all(out: Path) -> None:
    """The JAX half: every fixture (and the random presets) saved under ``out``, with
    ``jax_logits.npz`` (``input_ids``, ``logits``) beside each."""
    sys.path.insert(0, str(REPO))
    from flax import nnx

    from flax_models import HybridConfig, HybridLM, load_hf_checkpoint, save_hf_checkpoint
    from flax_models.save import hf_config_dict

    def save(model, name: str, input_ids: np.ndarray, *, rewrite: bool = False) -> None:
        directory = out / name
        save_hf_checkpoint(model, directory)
        if rewrite:  # config.json from the config's fields, not the file it was read from
            config = hf_config_dict(dataclasses.replace(model.cfg, hf_config=None))
            (directory / "config.json").write_text(json.dumps(config, indent=2))
        logits = np.asarray(model(input_ids), np.float32)
        np.savez(directory / "jax_logits.npz", input_ids=input_ids, logits=logits)
        print(f"saved {name}", flush=True)

    for fixture in sorted(p for p in FIXTURES.iterdir() if (p / "golden.npz").exists()):
        model = load_hf_checkpoint(fixture, implementation="xla")
        input_ids = np.load(fixture / "golden.npz")["input_ids"].astype(np.int32)
        save(model, fixture.name, input_ids)
        save(model, f"{fixture.name}-rewritten", input_ids, rewrite=True)
    for preset in ("tiny", "tiny_moe"):
        cfg = getattr(HybridConfig, preset)()
        model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0))
        input_ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 37)).astype(np.int32)
        save(model, f"random-{preset}", input_ids)


def compare_all(out: Path, rtol: float) -> int:
    """The torch half: each saved directory through transformers, against the JAX logits."""
    import torch
    import transformers

    torch.manual_seed(0)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'directory':32s} {'rel error':>10s} {'max |diff|':>11s}  architecture")
    failed = 0
    for directory in sorted(p for p in out.iterdir() if (p / "jax_logits.npz").exists()):
        saved = np.load(directory / "jax_logits.npz")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32, attn_implementation="eager"
            ).eval()
            with torch.no_grad():
                ids = torch.from_numpy(saved["input_ids"].astype(np.int64))
                logits = model(input_ids=ids, use_cache=False).logits.float().numpy()
        except Exception as e:  # report every directory, then fail
            failed += 1
            print(f"{directory.name:32s} FAIL: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        want = saved["logits"]
        error = float(np.linalg.norm(logits - want) / np.linalg.norm(want))
        diff = float(np.abs(logits - want).max())
        status = "" if error <= rtol else "  FAIL"
        failed += error > rtol
        print(f"{directory.name:32s} {error:10.2e} {diff:11.2e}  {type(model).__name__}{status}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", type=Path, help="only the JAX half: save under this directory")
    parser.add_argument("--out", type=Path, help="where to save (default a temporary directory)")
    parser.add_argument("--flax-python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--rtol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    if args.save is not None:
        save_all(args.save)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="hf-roundtrip-"))
    subprocess.run(
        [args.flax_python, __file__, "--save", str(out)],
        check=True,
        cwd=REPO,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    return compare_all(out, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
