"""Tensor and data parallelism (``flax_models.sharding``): sharded logits and generations
equal the single-device ones.

The checks that need several devices run in one subprocess with 4 CPU devices
(``--xla_force_host_platform_device_count`` must be set before JAX starts), one program per
fixture and tp; the layout helpers are tested here directly.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from flax_models import HybridConfig, HybridLM, load_hf_checkpoint
from flax_models.cache import cache_specs
from flax_models.serving.batching import BatchBuilder, Request
from flax_models.serving.prefix_cache import BlockHashes, BlockManager, GroupedBlockManager
from flax_models.sharding import (
    check_tp,
    dp_size,
    local_config,
    param_spec,
    split_groups,
    step_compiler_options,
    tp_layout,
    tp_size,
    with_tp_axis,
)
from tests.helpers import REPO_ROOT, cpu_devices_env, fast_compile_env, run_python

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
import json, sys, tempfile, time
start = time.perf_counter()
def lap(what):
    print(f"{what}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from flax_models import Engine, HybridConfig, HybridLM, load_hf_checkpoint
from flax_models.serving.batching import Request

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
    if name == "bamba":
        bamba_logits = want
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
init_compiles = []
def on_compile(event, secs, fun_name=None, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        init_compiles.append(fun_name)
jax.monitoring.register_event_duration_secs_listener(on_compile)
model = HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(3), mesh=mesh[2])
jax.monitoring.unregister_event_duration_listener(on_compile)
out["init_programs"] = init_compiles.count("jit(program)")
out["logits"]["tiny_init@2"] = rel(want, model(ids % cfg.vocab_size))
# jax.make_mesh gives Explicit axes by default: the model takes the same devices with Auto
# axes (before, creating it, and the forward of a model loaded on it, raised).
explicit = jax.make_mesh(
    (2,), ("tp",), devices=devices[:2], axis_types=(jax.sharding.AxisType.Explicit,)
)
out["logits"]["tiny_init@2_explicit_mesh"] = rel(
    want, HybridLM(cfg, implementation="xla", rngs=nnx.Rngs(3), mesh=explicit)(ids % cfg.vocab_size)
)
loaded = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=explicit)
out["logits"]["bamba@2_explicit_mesh"] = rel(bamba_logits, loaded(ids))
mixer = model.layers[0].mixer
out["specs"] = {
    name: [str(a) for a in param.sharding.spec] + ["None"] * (param.ndim - len(param.sharding.spec))
    for name, param in [
        ("in_proj", mixer.in_proj.kernel), ("out_proj", mixer.out_proj.kernel),
        ("A_log", mixer.A_log), ("q_proj", model.layers[2].mixer.q_proj.kernel),
        ("mlp.gate_up", model.layers[0].mlp.gate_up.kernel),
        ("mlp.down", model.layers[0].mlp.down.kernel), ("embed", model.embed.embedding),
        ("lm_head", model.lm_head.kernel),
    ]
}
# Traced, the logits stay split over the vocabulary (the head's columns); an eager call
# gathers them whole.
out["logits_spec"] = [
    [str(a) for a in logits.sharding.spec]
    for logits in (forward(model, ids % cfg.vocab_size), model(ids % cfg.vocab_size))
]
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
# The executable cache on the mesh: a second engine loads the tp = 2 step programs the
# first compiled (their shardings and device assignment with them) and gives its tokens.
with tempfile.TemporaryDirectory() as executables:
    kept = Engine(sharded, **options, executable_cache_dir=executables)
    kept.warmup(progress=False)
    again = Engine(sharded, **options, executable_cache_dir=executables)
    again.warmup(progress=False)
    out["executables"] = [
        len(again.builder.buckets()), again.runner.loaded_count, again.generate(prompts, 6)
    ]
# Prefix caching on the mesh: the prompts again after themselves hit their cached blocks
# (pages and Mamba snapshots sharded like the caches) and give the same tokens.
cached = Engine(sharded, **options, prefix_caching=True)  # blocks of one chunk (16)
out["prefix"] = [cached.generate(prompts + prompts, 6), cached.stats["prefix_hit_tokens"]]
# Steps of 64-256 rows a device at tp > 1 take the program compiled with XLA's split-K
# rewrite off (step_compiler_options); a one-row step the plain one.
wide = Engine(sharded, max_slots=64, max_len=40, token_budget=64, decode_buckets=(1, 64))
out["plain_program"] = [
    wide.runner.program(wide.builder.build([Request(s, [3], 5) for s in range(rows)], []))
    is wide.runner.step_program
    for rows in (1, 64)
]
lap("engine")

# A prefill step and a decode step at tp = 2: Bamba's one norm group spans both devices
# (Falcon-H1's too, normed before the gate), so each device's mixer runs the fused steps on
# in_proj's packed rows without the norm and ungated, and completes gate and norm around
# out_proj's all-reduce. The steps' logits are the single device's (which runs the fused
# steps with the norm).
from flax_models.layers import mamba2
fused_calls = []
real_ops = {op: getattr(mamba2.pk, op) for op in ("mamba2_decode", "mamba2_prefill")}
def counted(op):
    def call(*args, **kwargs):
        fused_calls.append([op, kwargs["norm_weight"] is not None, kwargs.get("gate", True)])
        return real_ops[op](*args, **kwargs)
    return call
for op in real_ops:
    setattr(mamba2.pk, op, counted(op))
out["fused_steps"] = {}
for name in ("bamba", "falcon_h1_norm"):
    logits, calls = {"prefill": [], "decode": []}, []
    path = f"tests/fixtures/{name}"
    if name == "bamba":
        models = (single, sharded)
    else:
        models = [load_hf_checkpoint(path, implementation="xla", mesh=m) for m in (None, mesh[2])]
    for m in models:
        fused_calls.clear()
        e = Engine(m, max_slots=2, max_len=40, token_budget=16, decode_buckets=(2,))
        prefill = [Request(0, prompts[0], 0), Request(1, prompts[2], 0)]
        logits["prefill"].append(np.asarray(e.step(e.builder.build([], prefill))))
        decode = [Request(0, [11], len(prompts[0])), Request(1, [12], len(prompts[2]))]
        logits["decode"].append(np.asarray(e.step(e.builder.build(decode, []))))
        calls.append(sorted({tuple(call) for call in fused_calls}))
    out["fused_steps"][name] = dict(
        errors={step: rel(*pair) for step, pair in logits.items()}, calls=calls
    )
for op, real in real_ops.items():
    setattr(mamba2.pk, op, real)
lap("fused steps")
out["cache_spec"] = [str(a) for a in engine.caches[0].ssm_state.sharding.spec]

# Data parallelism: the engine's slots in dp = 2 groups of 2 (a mesh dp x tp) on the prompts
# above twice (more than a group's slots: both groups, slot reuse): the single device's
# tokens; the caches split over dp; as many programs as a tp-only engine of the same buckets
# (one per bucket, whatever dp). dp x tp = 2 x 1 also runs prefix caching (each group its
# own cache: the second [7] * 20 hits). The plain forward runs replicated over dp.
import re
from jax.sharding import Mesh
from tests.serving.test_engine import program_count

# Where each collective of the compiled decode step of all the engine's slots reduces or
# gathers: "within" when every replica group lies inside one slot group (dp index; logical
# device i is mesh position i, so its dp index is i // tp), "across" otherwise, "unparsed"
# for a form not read here. HLO writes the groups as mesh axes, iota or explicit lists.
def replica_groups(text, num_devices):
    axes = re.match(r"mesh\[[^\]]*\] \{([^}]*)\}", text)
    if axes:
        return axes.group(1)
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        dims = [int(d) for d in iota.group(3).split(",")]
        ids = np.arange(num_devices).reshape(dims)
        if iota.group(4):
            ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
        return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()
    explicit = re.match(r"\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", text)
    if explicit:
        lists = re.findall(r"\{([\d,]*)\}", explicit.group(1))
        return [[int(i) for i in g.split(",") if i] for g in lists]
    return None

def step_collectives(engine, tp):
    arrays = engine.builder.build([Request(s, [3], 5) for s in range(4)], [])
    restore, snapshots = engine.scheduler.direct_step_extras(arrays)
    args, kwargs = engine.runner.step_arguments(arrays, restore, snapshots)
    hlo = engine.runner.step_program.lower(*args, **kwargs).compile().as_text()
    found = []
    kinds = "all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter"
    for line in hlo.splitlines():
        if re.search(rf"= (\S+|\([^)]*\)) ({kinds})(-start)?\(", line):  # or a tuple
            groups = replica_groups(line.split("replica_groups=")[-1], 2 * tp)
            if groups is None:
                found.append("unparsed")
            elif isinstance(groups, str):
                found.append("across" if "'dp'" in groups else "within")
            else:
                inside = all(len({i // tp for i in g}) == 1 for g in groups)
                found.append("within" if inside else "across")
    return found
dp_options = dict(options, max_slots=4, decode_buckets=(2,), token_buckets=(16,))
out["dp"] = {}
for dp, tp in ((2, 2), (2, 1)):
    dp_mesh = Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), ("dp", "tp"))
    dp_model = load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=dp_mesh)
    if tp == 2:
        out["logits"]["bamba@dp2xtp2"] = rel(bamba_logits, dp_model(ids))
    caching = tp == 1
    engine = Engine(dp_model, **dp_options, prefix_caching=caching)
    warm = engine.warmup() if caching else None
    out["dp"][f"{dp}x{tp}"] = dict(
        tokens=engine.generate(prompts * 2, 6),
        hits=engine.stats["prefix_hit_tokens"],
        warm=warm,
        compiled=engine.compile_count,
        programs=program_count(engine),
        specs=[
            [str(a) for a in leaf.sharding.spec]
            for leaf in jax.tree.leaves(engine.caches[:2])  # Mamba2 (snapshots), attention
        ],
    )
    out["dp"][f"{dp}x{tp}"]["collectives"] = step_collectives(engine, tp)
    lap(f"engine dp={dp} tp={tp}")
# The tp-only engine of the same buckets (2 slots): as many programs.
out["dp"]["tp_programs"] = program_count(Engine(sharded, **dict(dp_options, max_slots=2)))
out["dp"]["errors"] = {}
for name, value in (("max_slots", 3), ("num_kv_blocks", 5)):
    try:
        Engine(dp_model, **dict(dp_options, **{name: value}))
        out["dp"]["errors"][name] = None
    except ValueError as e:
        out["dp"]["errors"][name] = str(e)

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

# Training at tp = 2 through the Mosaic all-reduce's backward (a model on auto takes it on
# Hopper GPUs): every tp all-reduce routed to the kernel's differentiable op, its launch
# stood in for by psum (no Mosaic GPU here). Gradients of the parameters whose global
# shape tp keeps (embedding, norms, out_proj, the MLP, attention, head) against one device's.
import pallas_kernels as pk
from flax_models.training import loss_fn
from pallas_kernels.all_reduce import mosaic
launches = []
def launch(arrays, *, axis_name):
    launches.append(len(arrays))
    return jax.lax.psum(arrays, axis_name)
def kernel_all_reduce(x, axis_name, implementation):
    arrays = x if isinstance(x, tuple) else (x,)
    summed = mosaic.all_reduce(arrays, axis_name=axis_name)
    return summed if isinstance(x, tuple) else summed[0]
# flax_models.sharding asks the public op: that is the name routed to the kernel here.
real_launch, real_all_reduce = mosaic.summed_over_devices, pk.all_reduce
mosaic.summed_over_devices, pk.all_reduce = launch, kernel_all_reduce
grads = lambda model: nnx.jit(nnx.grad(lambda m: loss_fn(m, ids)))(model)
want = nnx.to_flat_state(grads(load_hf_checkpoint("tests/fixtures/bamba", implementation="xla")))
got = nnx.to_flat_state(
    grads(load_hf_checkpoint("tests/fixtures/bamba", implementation="xla", mesh=mesh[2]))
)
mosaic.summed_over_devices, pk.all_reduce = real_launch, real_all_reduce
out["grads"] = {"launches": launches, "errors": {}}
for (path, a), (_, b) in zip(want, got):
    a, b = np.asarray(a[...], np.float64), np.asarray(b[...], np.float64)
    if a.shape == b.shape:
        out["grads"]["errors"]["/".join(map(str, path))] = rel(a, b)
lap("grads")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    # Compiled fast (XLA's CPU backend optimisation off): both sides of every comparison are
    # this process's programs; its hundreds of compiles take a third less (93 -> 62 s alone).
    env = fast_compile_env(cpu_devices_env(4))
    done = run_python(_SCRIPT, json.dumps(_LOGIT_CASES), env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_sharded_logits_equal_single_device(results):
    expected = {f"{n}@{tp}" for n, tps in _LOGIT_CASES.items() for tp in tps}
    expected |= {
        "tiny_init@2",
        "bamba@dp2xtp2",
        "tiny_init@2_explicit_mesh",
        "bamba@2_explicit_mesh",
    }
    assert set(results["logits"]) == expected
    for case, error in results["logits"].items():
        assert error <= 1e-5, f"{case}: relative error {error}"


def test_sharded_gradients_through_the_kernel_all_reduce(results):
    """A tp = 2 model's gradients, its all-reduces through the Mosaic kernel's backward
    (launch stood in for), equal one device's; the backward launched the kernel too."""
    grads = results["grads"]
    errors = grads["errors"]
    assert {"embed/embedding", "lm_head/kernel", "layers/0/mixer/out_proj/kernel"} <= set(errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, f"{worst}: relative error {errors[worst]}"
    # Forward and backward: the Mamba mixers' (output, squares) pairs, attention, MLPs.
    assert len(grads["launches"]) == 2 * 6 and sorted(set(grads["launches"])) == [1, 2]


def test_random_init_compiles_one_program_a_kind_of_part(results):
    """A sharded random init (HybridConfig.tiny: layers "MM*M", an untied head) compiles
    one program for the embedding, one per kind of block (its three Mamba blocks share
    one), one for the final norm and one for the head: 5, not one a layer."""
    assert results["init_programs"] == 5


def test_parameters_and_caches_are_split(results):
    assert results["specs"] == {
        "in_proj": ["None", "tp"],
        "out_proj": ["tp", "None"],
        "A_log": ["tp"],
        "q_proj": ["None", "tp"],
        "mlp.gate_up": ["None", "None", "tp"],
        "mlp.down": ["tp", "None"],
        "embed": ["None", "None"],
        "lm_head": ["None", "tp"],
    }
    traced, eager = results["logits_spec"]
    assert traced[-1] == "tp" and "tp" not in eager
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
    buckets, loaded, from_cache = results["executables"]
    assert loaded == buckets and from_cache == single  # tp = 2 programs loaded from disk
    first, second = results["compiles"]
    assert second == first  # the second generation compiled nothing
    assert results["plain_program"] == [True, False]  # 1 row plain, 64 rows split-K off


@pytest.mark.parametrize("name", ["bamba", "falcon_h1_norm"])
def test_steps_on_a_mesh_run_the_fused_mixer(results, name):
    """tp = 2 with one norm group over both devices (normed after the gate, or before it):
    the prefill and decode steps' mixers run ``mamba2_prefill`` and ``mamba2_decode``
    without the norm and ungated (gate and norm completed around out_proj's all-reduce),
    and the steps' logits are the single device's (which runs them with the norm)."""
    steps = results["fused_steps"][name]
    single, sharded = steps["calls"]  # distinct [op, norm in the call, gate] of each model
    ops = ["mamba2_decode", "mamba2_prefill"]
    assert single == [[op, True, True] for op in ops]
    assert sharded == [[op, False, False] for op in ops]
    for step, error in steps["errors"].items():
        assert error <= 1e-5, (step, error)


def test_engine_prefix_caching_on_a_mesh(results):
    tokens, hit_tokens = results["prefix"]
    assert tokens == results["generate"][0] * 2
    assert hit_tokens > 0


def test_engine_on_dp_slot_groups_generates_the_single_device_tokens(results):
    dp, want = results["dp"], results["generate"][0] * 2
    assert dp["2x2"]["tokens"] == want
    assert dp["2x1"]["tokens"] == want
    assert dp["2x1"]["hits"] > 0  # its group's own prefix cache
    # Slots, pages and snapshot entries split over dp, heads over tp as before.
    mamba_conv, mamba_ssm, attention_k, attention_v = dp["2x2"]["specs"]
    assert mamba_conv == ["dp", "None", "tp"] and mamba_ssm == ["dp", "tp"]
    assert attention_k == attention_v == ["dp", "None", "tp"]
    assert len(dp["2x1"]["specs"]) == 6  # with the snapshot pools
    assert all(spec[0] == "dp" for spec in dp["2x1"]["specs"])
    # One program per bucket, as on tp alone; generating after warmup compiles nothing.
    assert dp["2x1"]["warm"] == dp["2x1"]["compiled"] == dp["2x1"]["programs"]
    assert dp["2x1"]["programs"] == dp["tp_programs"]
    assert dp["2x2"]["compiled"] <= dp["2x2"]["programs"] == dp["tp_programs"]
    for name, message in dp["errors"].items():
        assert message is not None and name in message and "dp=2" in message, (name, message)
    # A step never communicates across slot groups: at tp = 2 its collectives are the
    # mixers' all-reduces over tp and the greedy argmax's over the vocabulary split; at
    # tp = 1 it has none (no psum over one device, no all-gather of the hidden states for
    # the logits rows, and each group records its rows' tokens in its own slots).
    assert dp["2x2"]["collectives"] and set(dp["2x2"]["collectives"]) == {"within"}
    # Two all-reduces per layer of the 3-layer Bamba fixture (mixer or attention, then the
    # MLP): its one norm group's sums of squares ride in out_proj's all-reduce (three per
    # Mamba layer before); and two for the argmax over the head's split vocabulary.
    assert len(dp["2x2"]["collectives"]) == 2 * 3 + 2, dp["2x2"]["collectives"]
    assert dp["2x1"]["collectives"] == []


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
    assert param_spec(("layers", "0", "mixer", "in_proj", "kernel"), (64, 96), 2) == jax.P(
        None, "tp"
    )
    assert param_spec(("layers", "0", "mixer", "o_proj", "bias"), (64,), 2) == jax.P()
    assert param_spec(("layers", "0", "mixer", "conv_weight"), (96, 4), 2) == jax.P("tp", None)
    # The head splits its vocabulary when tp divides it, else stays whole.
    assert param_spec(("lm_head", "kernel"), (64, 256), 4) == jax.P(None, "tp")
    assert param_spec(("lm_head", "kernel"), (64, 250), 4) == jax.P()
    assert param_spec(("embed", "embedding"), (256, 64), 4) == jax.P()
    check_tp(HybridConfig.tiny(), 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_tp(HybridConfig.tiny(num_heads=6, num_kv_heads=3, mamba_groups=1), 2)
    with pytest.raises(ValueError, match="'tp'"):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        HybridLM(HybridConfig.tiny(), rngs=nnx.Rngs(0), mesh=mesh)


def test_dp_meshes_and_specs():
    assert split_groups(jax.P()) == jax.P("dp")
    assert split_groups(jax.P(None, None, "tp")) == jax.P("dp", None, "tp")
    with pytest.raises(ValueError, match="leading axis"):
        split_groups(jax.P("tp"))
    specs = cache_specs(HybridConfig.tiny(), snapshots=True, groups=2)
    assert specs[0].snapshot_ssm == jax.P("dp", "tp") and specs[2].k == jax.P("dp", None, "tp")
    dp_only = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    assert (tp_size(dp_only), dp_size(dp_only)) == (1, 1)
    assert with_tp_axis(dp_only).axis_names == ("dp", "tp")
    # jax.make_mesh's Explicit axes become Auto ones on the same devices, "tp" added or not.
    explicit, auto = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
    for names in (("tp",), ("dp",)):
        mesh = jax.make_mesh((1,), names, devices=jax.devices()[:1], axis_types=(explicit,))
        placed = with_tp_axis(mesh)
        assert placed.axis_types == (auto,) * len(placed.axis_names)
        assert placed.axis_names[: len(names)] == names
        assert placed.devices.ravel().tolist() == mesh.devices.ravel().tolist()
    assert with_tp_axis(mesh := jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))) is mesh
    # The loader accepts it as the model does (the specs name "tp": one of size 1).
    loaded = load_hf_checkpoint(REPO_ROOT / "tests/fixtures/bamba", mesh=dp_only)
    assert loaded.mesh.axis_names == ("dp", "tp")


def test_step_compiler_options_turn_split_k_off_where_measured():
    """XLA's split-K rewrite is off for tp > 1 steps of 64-256 rows a device and on
    elsewhere: with the split, the one-row tp = 2 step was faster, and so was tp = 1."""
    off = {"xla_gpu_experimental_force_split_k": 1}
    device = jax.devices()[0]
    tp2 = jax.sharding.Mesh(np.array([device, device]), ("tp",))  # only its shape is read
    dp2 = jax.sharding.Mesh(np.array([device, device]), ("dp",))
    chosen = [step_compiler_options(tp2, rows) for rows in (1, 63, 64, 256, 257)]
    assert chosen == [{}, {}, off, off, {}]
    assert step_compiler_options(None, 256) == step_compiler_options(dp2, 256) == {}


def test_grouped_step_layout():
    """Two slot groups of 2: each group's requests in its own rows, both groups padded to
    the buckets of the group that needs the largest; rows in request order."""
    builder = BatchBuilder(
        num_slots=4,
        max_len=64,
        decode_buckets=(1, 2),
        token_buckets=(4, 8),
        prefill_seqs=2,
        groups=2,
    )
    decode = [Request(3, [5], 7), Request(2, [6], 3), Request(0, [7], 1)]
    prefill = [Request(1, [1, 2, 3, 4, 5], 0)]
    step = builder.build(decode, prefill)
    assert step.bucket == (2, 8) and step.groups == 2
    # group 0: decode slot 0 + pad | prefill slot 1 + pad; group 1: decode 3, 2 | padding
    assert step.slot_ids.tolist() == [0, -1, 1, -1, 3, 2, -1, -1]
    assert step.query_start_loc.tolist() == [0, 1, 2, 7, 7, 0, 1, 2, 2, 2]
    assert step.tokens.tolist() == [7, 0, 1, 2, 3, 4, 5, 0, 0, 0] + [5, 6] + [0] * 8
    assert step.num_computed_tokens.tolist() == [1, 0, 0, 0, 7, 3, 0, 0]
    assert builder.request_rows(step).tolist() == [4, 5, 0, 2]
    assert step.query_lens.tolist() == [1, 1, 5, 0, 1, 1, 0, 0]
    assert builder.dummy(1, 4).query_start_loc.tolist() == [0, 1, 5, 5, 0, 1, 5, 5]
    one_row = dataclasses.replace(builder, decode_buckets=(1,))
    one_row.build([Request(0, [1], 0), Request(2, [1], 0)], [])  # one row in each group
    with pytest.raises(ValueError, match="2 decode rows of one slot group"):
        one_row.build([Request(0, [1], 0), Request(1, [1], 0)], [])
    with pytest.raises(ValueError, match="divisible"):
        dataclasses.replace(builder, num_slots=3)


def test_grouped_block_manager_takes_pages_from_the_slots_group():
    groups = [
        BlockManager(
            num_pages=3,
            block_size=4,
            num_slots=2,
            max_blocks=4,
            num_snapshots=2,
            prefix_caching=True,
            needs_state=True,
        )
        for _ in range(2)
    ]
    blocks = GroupedBlockManager(groups)
    assert (blocks.num_pages, blocks.num_snapshots) == (6, 4)
    keys = BlockHashes(4)
    assert blocks.admit(3, [1] * 9, keys, 12) is not None  # slot 3: group 1, local slot 1
    blocks.ensure(3, 12)
    assert blocks.slot_pages(3) == [0, 1, 2]  # group 1's own pages, numbered from 0
    assert groups[1].num_free_pages == 0 and groups[0].num_free_pages == 3
    assert blocks.tables[3, :3].tolist() == [0, 1, 2] and (blocks.tables[:3] == -1).all()
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.ensure(2, 1)  # group 1 is full, whatever group 0 holds
    # Snapshot entries: group 1's local entry e is global 2 + e.
    entry = groups[1].take_snapshot()
    blocks.publish(3, [1] * 9, keys, range(0, 1), {0: 2 + entry})
    assert groups[1].snapshot_of(keys[0]) == entry and groups[0].num_cached_blocks == 0
    blocks.release(3)
    assert blocks.num_free_pages == 6


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
    env = fast_compile_env(cpu_devices_env(2))  # XLA's CPU optimisation off, as above
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
            cwd=REPO_ROOT,
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
    single = load_hf_checkpoint(REPO_ROOT / "tests/fixtures/bamba", implementation="xla")
    want = np.asarray(single(ids))
    tokens = Engine(single, max_slots=2, max_len=40, token_budget=16).generate(_PROMPTS, 5)
    for out in outs:
        got = np.load(out)
        error = np.linalg.norm(got["logits"] - want) / np.linalg.norm(want)
        assert error <= 1e-5
        assert got["tokens"].tolist() == tokens
