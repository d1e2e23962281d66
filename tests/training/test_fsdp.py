"""FSDP over 4 CPU devices (a subprocess: the device count is fixed when JAX starts): the
parameters and optimizer state split over ``"fsdp"`` (alone and beside ``"tp"``), loss and
gradients equal to one device's, the split kept through a train step; and a model loaded
onto a tp mesh saves back the fixture's tensors (the tp-major layouts undone)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import cpu_devices_env, fast_compile_env, run_python

_SCRIPT = r"""
import json, tempfile
import numpy as np, jax, optax, safetensors.numpy
from flax import nnx
from jax.sharding import Mesh
from flax_models import HybridConfig, HybridLM, load_hf_checkpoint, save_hf_checkpoint
from flax_models.sharding import from_tp_layout, tp_size
from flax_models.training import loss_fn, make_optimizer, train_step
from flax_models.training.fsdp import FSDP, shard_batch, shard_fsdp

cfg = HybridConfig.tiny(layer_pattern="M*", mamba_chunk_size=4)
ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 8)).astype(np.int32)
grads = nnx.jit(nnx.value_and_grad(loss_fn))
flat = lambda s: {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(s)}
loss0, grads0 = grads(HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0)), ids)
out = {}
for shape, names in [((4,), ("fsdp",)), ((2, 2), ("fsdp", "tp"))]:
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(0),
                     mesh=mesh if "tp" in names else None)
    optimizer = make_optimizer(model, optax.adam(1e-3))
    shard_fsdp(mesh, model, optimizer)
    (x,) = shard_batch(mesh, ids)
    loss, g = grads(model, x)
    tp = tp_size(model.mesh)
    errors = {
        k: float(np.abs(from_tp_layout(tuple(k.split("/")), v, cfg, tp) - flat(grads0)[k]).max()
                 / np.abs(flat(grads0)[k]).max())
        for k, v in flat(g).items()
    }
    def split(tree):
        arrays = [a for a in jax.tree.leaves(nnx.state(tree)) if a.size >= 64]
        return sum(FSDP in jax.tree.leaves(tuple(a.sharding.spec)) for a in arrays), len(arrays)
    before = split(model), split(optimizer)
    train_step(model, optimizer, x)
    out["@".join(names)] = dict(
        loss=float(loss), loss0=float(loss0), errors=errors,
        split_before=before, split_after=(split(model), split(optimizer)),
        shard=model.layers[0].mixer.in_proj.kernel[...].addressable_shards[0].data.size,
        whole=model.layers[0].mixer.in_proj.kernel[...].size,
    )

mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
model = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=mesh)
directory = tempfile.mkdtemp()
save_hf_checkpoint(model, directory)
saved = safetensors.numpy.load_file(f"{directory}/model.safetensors")
fixture = safetensors.numpy.load_file("tests/fixtures/bamba/model.safetensors")
same = lambda k: k in saved and np.array_equal(saved[k], fixture[k])
out["tp_save"] = sorted(set(saved) ^ set(fixture)) + sorted(k for k in fixture if not same(k))
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    done = run_python(_SCRIPT, env=fast_compile_env(cpu_devices_env(4)), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("mesh", ["fsdp", "fsdp@tp"])
def test_fsdp_loss_and_gradients_equal_one_device(results, mesh):
    run = results[mesh]
    assert abs(run["loss"] - run["loss0"]) <= 1e-6 * run["loss0"]
    worst = max(run["errors"], key=run["errors"].get)
    assert run["errors"][worst] <= 1e-5, worst


@pytest.mark.parametrize("mesh", ["fsdp", "fsdp@tp"])
def test_fsdp_splits_parameters_and_optimizer_state(results, mesh):
    run = results[mesh]
    for split, total in (*run["split_before"], *run["split_after"]):
        assert split == total  # every array of 64 elements or more, still after a step
    assert run["shard"] * 4 == run["whole"]  # 1/4 of in_proj on each device


def test_tp_model_saves_back_the_fixture(results):
    assert results["tp_save"] == []
