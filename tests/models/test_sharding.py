"""Tensor parallelism (``flax_models.sharding``): sharded logits and generations equal the
single-device ones.

The checks that need several devices run in one subprocess with 4 CPU devices
(``--xla_force_host_platform_device_count`` must be set before JAX starts), one program per
fixture and tp; the layout helpers are tested here directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from flax_models import HybridConfig, HybridLM
from flax_models.sharding import check_tp, local_config, param_spec, tp_layout

ROOT = Path(__file__).resolve().parents[2]

# Fixture → the tp sizes it is checked at. Together they cover: split and copied B/C groups
# (norm local, or its sum of squares all-reduced, normed before or after the gate), split
# and copied KV heads, Falcon-H1's parallel mixer, softmax (fused gate|up) and sigmoid
# (relu², shared expert) MoE.
_LOGIT_CASES = {
    "bamba": (2, 4),  # 1 group: norm all-reduced; at tp=4 2 KV heads copied
    "falcon_h1": (2, 4),  # 12 heads, 2 groups: at tp=4 one group per 2 devices
    "nemotronh_moe": (2, 4),
    "granitemoehybrid_moe": (2,),
    "falcon_h1_norm": (2,),  # 1 group, norm before the gate
}

_SCRIPT = r"""
import json, sys, time
start = time.perf_counter()
def lap(what):
    print(f"{what}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from flax_models import Engine, HybridConfig, HybridLM, load_hf_checkpoint

cases = json.loads(sys.argv[1])
devices = jax.devices()
mesh = {tp: jax.sharding.Mesh(np.array(devices[:tp]), ("tp",)) for tp in (2, 4)}
out = {"logits": {}, "errors": {}}

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))

ids = np.random.default_rng(0).integers(0, 96, (2, 19))
forward = nnx.jit(lambda model, ids: model(ids))  # one program, not op by op
for name, tps in cases.items():
    path = f"tests/fixtures/{name}"
    want = forward(load_hf_checkpoint(path, implementation="xla"), ids)
    for tp in tps:
        model = load_hf_checkpoint(path, implementation="xla", mesh=mesh[tp])
        out["logits"][f"{name}@{tp}"] = rel(want, model(ids))
        lap(f"{name}@{tp}")

# A tp=4 load reads each device's shards from the files (bytes read per tensor, counted
# under safe_open): a split tensor once in all, not once per device.
import flax_models.checkpoint as checkpoint
from safetensors.numpy import load_file
real_open, read = checkpoint.safe_open, {}
class CountingSlice:
    def __init__(self, name, inner): self.name, self.inner = name, inner
    def get_shape(self): return self.inner.get_shape()
    def __getitem__(self, key):
        out = self.inner[key]
        read[self.name] = read.get(self.name, 0) + out.nbytes
        return out
class CountingFile:
    def __init__(self, inner): self.inner = inner
    def keys(self): return self.inner.keys()
    def get_slice(self, name): return CountingSlice(name, self.inner.get_slice(name))
checkpoint.safe_open = lambda *args, **kwargs: CountingFile(real_open(*args, **kwargs))
load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=mesh[4])
checkpoint.safe_open = real_open
stored = load_file("tests/fixtures/bamba/model.safetensors")
out["bytes_read"] = {name: [read.get(name, 0), t.nbytes] for name, t in stored.items()}
lap("bytes read")

# Random init straight into shards equals the single-device init (same draws).
cfg = HybridConfig.tiny()
want = forward(HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(3)), ids % cfg.vocab_size)
model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(3), mesh=mesh[2])
out["logits"]["tiny_init@2"] = rel(want, model(ids % cfg.vocab_size))
mixer = model.layers[0].mixer
out["specs"] = {
    name: [str(a) for a in param.sharding.spec] + ["None"] * (param.ndim - len(param.sharding.spec))
    for name, param in [
        ("in_proj", mixer.in_proj.kernel), ("out_proj", mixer.out_proj.kernel),
        ("A_log", mixer.A_log), ("q_proj", model.layers[2].mixer.q_proj.kernel),
        ("mlp.down", model.layers[0].mlp.down.kernel), ("embed", model.embed.embedding),
    ]
}
out["shard_shape"] = list(mixer.in_proj.kernel[...].addressable_shards[0].data.shape)
out["full_shape"] = list(mixer.in_proj.kernel[...].shape)
lap("init")

# Greedy generation through the Engine at tp=2 (chunked prefill, decode and mixed steps):
# same tokens; generating again compiles nothing (the caches keep their shardings).
prompts = [[1, 2, 3, 4, 5], [7] * 20, [9, 3]]  # the second holds one full 16-token block
options = dict(max_slots=2, max_len=40, token_budget=16)
single = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla")
sharded = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=mesh[2])
engine = Engine(sharded, **options)
out["generate"] = [Engine(single, **options).generate(prompts, 6), engine.generate(prompts, 6)]
compiled = engine.compile_count
out["generate"].append(engine.generate(prompts, 6))
out["compiles"] = [compiled, engine.compile_count]
# Prefix caching on the mesh: the prompts again after themselves hit their cached blocks
# (pages and Mamba snapshots sharded like the caches) and give the same tokens.
cached = Engine(sharded, **options, prefix_caching=True)  # blocks of one chunk (16)
out["prefix"] = [cached.generate(prompts + prompts, 6), cached.stats["prefix_hit_tokens"]]
lap("engine")
out["cache_spec"] = [str(a) for a in engine.caches[0].ssm_state.sharding.spec]

# Configs tp cannot split raise ValueError naming the field.
bad = {
    "mamba_num_heads": HybridConfig.tiny(mamba_num_heads=6, mamba_groups=1),
    "num_heads": HybridConfig.tiny(num_heads=2, num_kv_heads=1),
    "intermediate_size": HybridConfig.tiny(intermediate_size=130),
    "moe_intermediate_size": HybridConfig.tiny_moe(moe_intermediate_size=30),
}
for field, bad_cfg in bad.items():
    try:
        HybridLM(bad_cfg, implementation="xla", rngs=nnx.Rngs(0), mesh=mesh[4])
        out["errors"][field] = None
    except ValueError as e:
        out["errors"][field] = str(e)
lap("errors")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(_LOGIT_CASES)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_sharded_logits_equal_single_device(results):
    expected = {f"{n}@{tp}" for n, tps in _LOGIT_CASES.items() for tp in tps} | {"tiny_init@2"}
    assert set(results["logits"]) == expected
    for case, error in results["logits"].items():
        assert error <= 1e-5, f"{case}: relative error {error}"


def test_parameters_and_caches_are_split(results):
    assert results["specs"] == {
        "in_proj": ["None", "tp"],
        "out_proj": ["tp", "None"],
        "A_log": ["tp"],
        "q_proj": ["None", "tp"],
        "mlp.down": ["tp", "None"],
        "embed": ["None", "None"],
    }
    full, shard = results["full_shape"], results["shard_shape"]
    assert shard == [full[0], full[1] // 2]
    assert results["cache_spec"][:2] == ["None", "tp"]


def test_a_sharded_load_reads_each_shard_from_the_files(results):
    read = results["bytes_read"]
    # Row- and column-split tensors: every byte once over the four devices.
    for name in ("mamba.out_proj", "feed_forward.up_proj"):
        name = f"model.layers.0.{name}.weight"
        assert read[name][0] == read[name][1], name
    # in_proj: z, x and dt split; the one B/C group copied to every device (16 rows each).
    copies = 3 * 2 * 16 * 64 * 4
    name = "model.layers.0.mamba.in_proj.weight"
    assert read[name][0] == read[name][1] + copies
    total_read, total = (sum(v[i] for v in read.values()) for i in (0, 1))
    assert total <= total_read <= 1.5 * total  # not four times over


def test_engine_generates_the_single_device_tokens(results):
    single, sharded, again = results["generate"]
    assert sharded == single == again
    first, second = results["compiles"]
    assert second == first  # the second generation compiled nothing


def test_engine_prefix_caching_on_a_mesh(results):
    tokens, hit_tokens = results["prefix"]
    assert tokens == results["generate"][0] * 2
    assert hit_tokens > 0


def test_configs_tp_cannot_split_name_the_field(results):
    for field, message in results["errors"].items():
        assert message is not None and field in message, (field, message)


# ---------------------------------------------------------------- in-process


def test_tp_major_layout_puts_each_devices_segments_together():
    cfg = HybridConfig.tiny(mamba_num_heads=4, mamba_head_dim=1, mamba_state_size=2, mamba_groups=1)
    # in_proj columns: z 0-3 | x 4-7 | B 8-9 | C 10-11 | dt 12-15; one group, copied.
    columns = np.arange(cfg.mamba_in_proj_dim)[None, :]
    got = tp_layout(("in_proj", "kernel"), columns, cfg, 2)[0]
    device0 = [0, 1, 4, 5, 8, 9, 10, 11, 12, 13]
    device1 = [2, 3, 6, 7, 8, 9, 10, 11, 14, 15]
    assert got.tolist() == device0 + device1
    local = local_config(cfg, 2)
    assert 2 * local.mamba_in_proj_dim == got.shape[0]
    assert tp_layout(("out_proj", "kernel"), columns, cfg, 2) is columns


def test_param_specs_and_checks():
    assert param_spec(("layers", "0", "mixer", "in_proj", "kernel"), 2) == jax.P(None, "tp")
    assert param_spec(("layers", "0", "mixer", "o_proj", "bias"), 1) == jax.P()
    assert param_spec(("layers", "0", "mixer", "conv_weight"), 2) == jax.P("tp", None)
    check_tp(HybridConfig.tiny(), 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_tp(HybridConfig.tiny(num_heads=6, num_kv_heads=3, mamba_groups=1), 2)
    with pytest.raises(ValueError, match="'tp'"):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0), mesh=mesh)


# ---------------------------------------------------------------- two processes

_PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, [9, 3]]
_HOST_SCRIPT = r"""
import sys
import jax
import numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=2, process_id=process, initialization_timeout=60
)
from flax_models import Engine, load_hf_checkpoint

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))  # 2 processes x 2 devices
ids = np.random.default_rng(0).integers(0, 96, (2, 19))
model = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=mesh)
logits = model(ids)  # replicated: every process holds all of it
# The engine on the global mesh: every process runs the same scheduler on the same requests.
engine = Engine(model, max_slots=2, max_len=40, token_budget=16)
tokens = engine.generate(PROMPTS, 5)
np.savez(out, logits=np.asarray(logits.addressable_shards[0].data), tokens=np.asarray(tokens))
jax.distributed.shutdown()
"""


def test_two_processes_match_a_single_device(tmp_path):
    """tp = 4 over two CPU processes of two devices each, under
    ``jax.distributed.initialize()`` on 127.0.0.1; both processes stop on their own. The
    logits and the engine's greedy tokens are the single device's."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    outs = [tmp_path / f"out_{p}.npz" for p in (0, 1)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"PROMPTS = {_PROMPTS!r}\n" + _HOST_SCRIPT,
                str(port),
                str(p),
                str(outs[p]),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for p in (0, 1)
    ]
    try:
        logs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, log in zip(procs, logs, strict=True):
        assert proc.returncode == 0, log[-4000:]
    from flax_models import Engine, load_hf_checkpoint

    ids = np.random.default_rng(0).integers(0, 96, (2, 19))
    single = load_hf_checkpoint(ROOT / "tests/fixtures/bamba", implementation="xla")
    want = np.asarray(single(ids))
    tokens = Engine(single, max_slots=2, max_len=40, token_budget=16).generate(_PROMPTS, 5)
    for out in outs:
        got = np.load(out)
        error = np.linalg.norm(got["logits"] - want) / np.linalg.norm(want)
        assert error <= 1e-5
        assert got["tokens"].tolist() == tokens
