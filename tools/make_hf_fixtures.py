"""Build tiny random Hugging Face reference models and golden logits for the parity tests.

For every family (mamba2, bamba, granitemoehybrid, granitemoehybrid_nope, nemotronh, and the
MoE variants granitemoehybrid_moe, nemotronh_moe) this builds a tiny float32 model from a
config with `transformers`, deterministically (fixed torch seeds), re-randomizes every
parameter whose library initial value is trivial (A_log, D, dt_bias, all RMSNorm weights incl.
the Mamba gated norm, conv1d bias, the router's score-correction bias; also all other weights,
so that every term of the forward contributes well above float32 noise), and writes

    <out_dir>/<family>/config.json         (save_pretrained)
    <out_dir>/<family>/model.safetensors   (save_pretrained, float32)
    <out_dir>/<family>/golden.npz          input_ids int32 [2, L], logits float32 [2, L, V],
                                           family, transformers_version, torch_version (str)

The logits come from the model's eval-mode forward with use_cache=False, eager attention, on
CPU with transformers' pure-torch fallbacks (no mamba_ssm / causal_conv1d installed), so the
Mamba2 layers run `mamba2_chunk_scan` (chunked SSD) in float32. L is chosen not to be a
multiple of the chunk size. The script reloads every saved directory with `from_pretrained`
and checks it reproduces the golden logits. For the MoE families the float64 reference also
requires every routing decision to clear the runner-up by > 1e-3 (no near-ties that fp32
implementations could break differently).

This is a developer tool; it is not run by the test suite (the fixtures are committed). It
needs torch and transformers, which the project itself does not depend on. How to run, from
the repository root (a venv outside the repo, Python 3.11, CPU torch):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /root/hfenv
    /root/hfenv/bin/pip install torch==2.13.0          # must resolve to 2.13.0+cpu, no CUDA
    /root/hfenv/bin/pip install transformers==5.23.0 safetensors numpy
    /root/hfenv/bin/python tools/make_hf_fixtures.py tests/fixtures

Optional: `--only FAMILY [FAMILY ...]` to rebuild a subset.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import safetensors.numpy
import torch
import transformers
from safetensors import safe_open
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

BATCH = 2


def _mamba2():
    # all-Mamba2; tied embeddings; n_groups=2; chunk 8; L=37 (4 full chunks + 5).
    config = Mamba2Config(
        vocab_size=160,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=16,
        head_dim=8,
        expand=2,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=True,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return Mamba2ForCausalLM, config, 37


def _bamba():
    # layers [mamba, attention, mamba]; GQA 4/2 heads of 16; partial RoPE 0.5 (8 of 16 dims);
    # n_groups=1; chunk 16; L=21; untied; non-trivial time_step_limit so both clamps bite.
    config = BambaConfig(
        vocab_size=192,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        time_step_limit=(0.01, 0.5),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return BambaForCausalLM, config, 21


def _granite(position_embedding_type: str, layer_types: list[str], **overrides):
    # dense (num_local_experts=0 -> shared_mlp only); Granite-4.0-H-like multipliers; GQA 4/2;
    # n_groups=2; chunk 8; tied embeddings. ``overrides`` replace fields (the MoE variant).
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,  # only used by routed experts; unused here
        shared_intermediate_size=96,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        position_embedding_type=position_embedding_type,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return GraniteMoeHybridConfig(**(fields | overrides))


def _granitemoehybrid():
    config = _granite("rope", ["mamba", "attention", "mamba"])
    return GraniteMoeHybridForCausalLM, config, 37


def _granitemoehybrid_nope():
    config = _granite("nope", ["mamba", "attention"])
    return GraniteMoeHybridForCausalLM, config, 21


def _nemotronh():
    # pattern M * M - ; relu2 MLP; attention without RoPE, GQA 4/2, head_dim 16;
    # mamba intermediate = mamba_num_heads * mamba_head_dim = 96 != expand * hidden (128), as in
    # Nemotron-H-9B-v2; dt clamp is (time_step_min, inf) -> time_step_min chosen so it bites.
    config = NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        hybrid_override_pattern="M*M-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attention_bias=False,
        intermediate_size=128,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        ssm_state_size=16,
        mamba_num_heads=12,
        mamba_head_dim=8,
        mamba_hidden_act="silu",
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        use_conv_bias=True,
        mamba_proj_bias=False,
        use_bias=False,
        time_step_min=0.02,
        time_step_max=0.1,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return NemotronHForCausalLM, config, 37


# --- MoE families (routed experts) -------------------------------------------------------------


def _granitemoehybrid_moe():
    # Granite-4.0-H Tiny/Small style: after every mixer, routed SwiGLU experts (8, top-2, width
    # 24, softmax over the top-k logits) summed with the shared MLP (width 48).
    config = _granite(
        "rope",
        ["mamba", "attention"],
        vocab_size=128,
        intermediate_size=24,
        shared_intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    return GraniteMoeHybridForCausalLM, config, 21


def _nemotronh_moe():
    # Nemotron 3 Nano style MoE blocks ('E'): sigmoid router + score-correction bias (selection
    # only), grouped top-k (8 experts in 2 groups, 1 group kept, top-3), renormalised and scaled
    # by routed_scaling_factor 2.5; relu2 experts without a gate (width 32) + one shared expert
    # (width 48). Pattern mixes all four block kinds.
    config = NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        hybrid_override_pattern="MEM*E-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attention_bias=False,
        intermediate_size=64,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_shared_experts=1,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        mamba_hidden_act="silu",
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        use_conv_bias=True,
        mamba_proj_bias=False,
        use_bias=False,
        time_step_min=0.02,
        time_step_max=0.1,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return NemotronHForCausalLM, config, 37


# --- Falcon-H1 (attention and Mamba2 in parallel in every layer) ----------------------------


def _falcon_h1():
    # Every µP multiplier != 1 and a non-trivial ssm_multipliers (mup) vector; mamba_rms_norm
    # False (as in the released Falcon-H1 models: y * silu(z), no norm); mamba_d_ssm = 96 !=
    # expand * hidden (128); attention head_dim 24 != hidden / heads (16), GQA 4/2; dt clamp
    # (0.02, 1.0) so both bounds bite; chunk 8, L = 21 (2 full chunks + 5); untied.
    config = FalconH1Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_d_ssm=96,
        mamba_n_heads=12,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        mamba_rms_norm=False,
        mamba_norm_before_gate=False,
        projectors_bias=False,
        time_step_limit=(0.02, 1.0),
        embedding_multiplier=2.5,
        lm_head_multiplier=0.4,
        attention_in_multiplier=0.7,
        attention_out_multiplier=0.8,
        key_multiplier=1.6,
        ssm_in_multiplier=1.3,
        ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.2, 0.75, 1.4, 0.5],
        mlp_multipliers=[0.8, 0.65],
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return FalconH1ForCausalLM, config, 21


def _falcon_h1_norm():
    # The other switches: gated RMSNorm on with norm_before_gate (rmsnorm(y) * silu(z), n_groups
    # 1), every bias on (in_proj, out_proj via projectors_bias, attention, MLP), no conv bias,
    # mamba_d_ssm None (= expand * hidden) and mamba_d_head "auto", tied embeddings, and a
    # partial_rotary_factor that Falcon-H1's default RoPE ignores (it rotates the whole head).
    # Smaller: hidden 32, chunk 4, L = 11 (2 full chunks + 3).
    config = FalconH1Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.5,
        },
        mamba_d_ssm=None,
        mamba_n_heads=8,
        mamba_d_head="auto",
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=4,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        projectors_bias=True,
        embedding_multiplier=0.6,
        lm_head_multiplier=1.7,
        attention_in_multiplier=1.25,
        attention_out_multiplier=0.9,
        key_multiplier=0.7,
        ssm_in_multiplier=0.8,
        ssm_out_multiplier=1.35,
        ssm_multipliers=[1.3, 0.7, 1.1, 0.85, 1.5],
        mlp_multipliers=[1.2, 0.75],
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return FalconH1ForCausalLM, config, 11


FAMILIES = {
    "mamba2": (_mamba2, 1001),
    "bamba": (_bamba, 1002),
    "granitemoehybrid": (_granitemoehybrid, 1003),
    "granitemoehybrid_nope": (_granitemoehybrid_nope, 1004),
    "nemotronh": (_nemotronh, 1005),
    "granitemoehybrid_moe": (_granitemoehybrid_moe, 1011),
    "nemotronh_moe": (_nemotronh_moe, 1012),
    "falcon_h1": (_falcon_h1, 1021),
    "falcon_h1_norm": (_falcon_h1_norm, 1022),
}


@torch.no_grad()
def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values of a sensible scale.

    The library's initial values (A_log = log(1..n), D = 1, dt_bias = 1 or inv_softplus(dt),
    norm weights = 1, conv bias = 0, padding row = 0, std-0.02 linears) hide mapping errors
    or make whole terms negligible, so every parameter is redrawn here:
      A_log ~ U(-1, 2)            (A = -exp(A_log) in [-7.4, -0.37])
      D ~ U(-0.5, 1.5)
      dt_bias ~ U(-4.5, 1.0)      (softplus in ~[0.011, 1.31])
      any norm weight ~ U(0.5, 1.5)  (RMSNorm weights and the Mamba gated norm)
      conv1d.bias ~ U(-0.5, 0.5);  conv1d.weight ~ U(-0.5, 0.5)
      embeddings ~ N(0, 0.5^2)
      other 2D weights (Linear [out, in]) ~ N(0, 1 / in)
      stacked expert weights [E, out, in] ~ N(0, 1 / in)
      other 1D (biases, none in these configs) ~ U(-0.2, 0.2)
      e_score_correction_bias (a buffer: Nemotron-H's router) ~ U(-0.2, 0.2)
    Tied parameters are visited once (named_parameters dedups them).
    """
    gen = torch.Generator().manual_seed(seed)

    def uniform(p, lo, hi):
        p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo)

    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            uniform(p, -1.0, 2.0)
        elif leaf == "D":
            uniform(p, -0.5, 1.5)
        elif leaf == "dt_bias":
            uniform(p, -4.5, 1.0)
        elif "norm" in name and leaf == "weight":
            uniform(p, 0.5, 1.5)
        elif "conv1d" in name:
            uniform(p, -0.5, 0.5)
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        elif p.ndim == 3:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[2]))
        else:
            uniform(p, -0.2, 0.2)
    # The sigmoid router's score-correction bias shifts which experts are chosen (scores lie
    # in (0, 1)); it is a buffer, so named_parameters skips it.
    for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
        if name.endswith("e_score_correction_bias"):
            uniform(b, -0.2, 0.2)


def dt_clamp_report(model, input_ids) -> str:
    """How often dt = softplus(in_proj dt part + dt_bias) falls outside the clamp (diagnostic)."""
    lines = []
    hooks = []
    captured = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "in_proj"):

            def hook(_lin, args, out, name=name, mixer=mod):
                captured[name] = (mixer, out.detach())

            hooks.append(mod.in_proj.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for h in hooks:
        h.remove()
    for name, (m, proj) in captured.items():
        if hasattr(m, "mup_vector"):  # Falcon-H1 scales in_proj's output per segment
            proj = proj * m.mup_vector
        dt = torch.nn.functional.softplus(proj[..., -m.num_heads :] + m.dt_bias)
        lo, hi = m.time_step_limit
        lines.append(
            f"    {name}: dt in [{dt.min():.4f}, {dt.max():.4f}], limit ({lo}, {hi}): "
            f"{(dt < lo).float().mean():.2%} below, {(dt > hi).float().mean():.2%} above"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Independent float64 numpy reference (sequential SSM recurrence, no chunking), reading only the
# saved config.json + model.safetensors. build() asserts it matches the torch golden logits, so
# the fixtures are known to encode exactly this math, which is what the JAX models must implement.
# ---------------------------------------------------------------------------------------------


def _json_float(v) -> float:
    # transformers 5 writes float("inf") in config.json as {"__float__": "Infinity"}.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _lin(x, W, name):
    """A torch Linear: x @ weight.T, plus its bias when the checkpoint has one."""
    return x @ W[name + ".weight"].T + W.get(name + ".bias", 0.0)


def _ref_mamba2(x, W, pre, nh, hd, N, G, K, eps, dt_lo, dt_hi, *, mup=1.0, gate="norm(y*silu(z))"):
    """mup: Falcon-H1's per-channel in_proj scale; gate: "norm(y*silu(z))" (Mamba2),
    "norm(y)*silu(z)" (norm before gate) or "y*silu(z)" (no norm: Falcon-H1's
    mamba_rms_norm=False)."""
    bsz, L, _ = x.shape
    di = nh * hd
    # in_proj output = [z (di) | xBC (di + 2*G*N) | dt (nh)]
    z, xbc, dt = np.split(_lin(x, W, pre + "in_proj") * mup, [di, 2 * di + 2 * G * N], axis=-1)
    cw = W[pre + "conv1d.weight"][:, 0, :]  # [conv_dim, K], causal depthwise, left zero pad K-1
    padded = np.concatenate([np.zeros((bsz, K - 1, xbc.shape[-1])), xbc], axis=1)
    conv = sum(padded[:, k : k + L, :] * cw[:, k] for k in range(K))
    if pre + "conv1d.bias" in W:
        conv = conv + W[pre + "conv1d.bias"]
    xbc = _silu(conv)
    xs, Bm, Cm = np.split(xbc, [di, di + G * N], axis=-1)
    xs = xs.reshape(bsz, L, nh, hd)
    Bm = Bm.reshape(bsz, L, G, N)
    Cm = Cm.reshape(bsz, L, G, N)
    dt = np.clip(np.logaddexp(0.0, dt + W[pre + "dt_bias"]), dt_lo, dt_hi)  # [B, L, nh]
    A = -np.exp(W[pre + "A_log"])
    D = W[pre + "D"]
    grp = np.arange(nh) // (nh // G)  # head h reads B/C group h // (nh / G)
    h = np.zeros((bsz, nh, hd, N))
    y = np.zeros((bsz, L, nh, hd))
    for t in range(L):
        Bt, Ct = Bm[:, t][:, grp], Cm[:, t][:, grp]  # [B, nh, N]
        h = h * np.exp(dt[:, t] * A)[:, :, None, None]
        h = h + (dt[:, t, :, None] * xs[:, t])[..., None] * Bt[:, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, Ct) + D[:, None] * xs[:, t]
    y = y.reshape(bsz, L, di)
    if gate != "norm(y)*silu(z)":
        y = y * _silu(z)  # gate first, then (if any) grouped RMS norm
    if gate != "y*silu(z)":
        yg = y.reshape(bsz, L, G, di // G)
        yg = yg / np.sqrt((yg * yg).mean(-1, keepdims=True) + eps)
        y = yg.reshape(bsz, L, di) * W[pre + "norm.weight"]
    if gate == "norm(y)*silu(z)":
        y = y * _silu(z)
    return _lin(y, W, pre + "out_proj")


def _ref_attention(
    x, W, pre, nh, nkv, hd, scaling, rope_theta, rotary_fraction, *, key_multiplier=1.0
):
    bsz, L, _ = x.shape
    q = _lin(x, W, pre + "q_proj").reshape(bsz, L, nh, hd)
    k = _lin(x, W, pre + "k_proj").reshape(bsz, L, nkv, hd) * key_multiplier
    v = _lin(x, W, pre + "v_proj").reshape(bsz, L, nkv, hd)
    if rope_theta is not None:  # rotate-half RoPE on the first rd dims of each head
        rd = int(hd * rotary_fraction)
        ang = np.arange(L)[:, None] * (1.0 / rope_theta ** (np.arange(0, rd, 2) / rd))[None]
        cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None]
        sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None]

        def rope(t):
            r, rest = t[..., :rd], t[..., rd:]
            half = np.concatenate([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
            return np.concatenate([r * cos + half * sin, rest], -1)

        q, k = rope(q), rope(k)
    kv_of = np.arange(nh) // (nh // nkv)  # GQA: query head h reads kv head h // (nh / nkv)
    s = np.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_of]) * scaling
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", s, v[:, :, kv_of]).reshape(bsz, L, nh * hd)
    return _lin(o, W, pre + "o_proj")


# Routing margins seen by the MoE references: per router decision, the smallest gap (over
# tokens) between the last chosen and the first rejected score. build() requires them well
# above float32 noise, so fp32 implementations cannot choose other experts than float64 does.
ROUTING_MARGINS: list[float] = []


def _topk_margin(scores: np.ndarray, k: int) -> float:
    ranked = -np.sort(-scores, axis=-1)
    return float((ranked[:, k - 1] - ranked[:, k]).min()) if k < scores.shape[-1] else math.inf


def _ref_experts(x, w_in, w_out, idx, weights, gated):
    """Routed experts token by token: sum_j weights[t, j] * expert_{idx[t, j]}(x[t]), with
    w_in [E, 2I (gate|up) or I, H], w_out [E, H, I]; gated: silu(gate) * up, else relu(up)^2."""
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j, e in enumerate(idx[t]):
            hidden = w_in[e] @ flat[t]
            if gated:
                gate, up = np.split(hidden, 2)
                hidden = _silu(gate) * up
            else:
                hidden = np.maximum(hidden, 0.0) ** 2
            out[t] += weights[t, j] * (w_out[e] @ hidden)
    return out.reshape(x.shape)


def _ref_granite_moe(x, W, pre, top_k):
    # softmax over the top-k router logits (= softmax over all, renormalised over the top k)
    logits = x.reshape(-1, x.shape[-1]) @ W[pre + "router.layer.weight"].T
    ROUTING_MARGINS.append(_topk_margin(logits, top_k))
    idx = np.argsort(-logits, axis=-1)[:, :top_k]
    top = np.take_along_axis(logits, idx, axis=-1)
    weights = np.exp(top - top.max(-1, keepdims=True))
    weights = weights / weights.sum(-1, keepdims=True)
    w_in, w_out = W[pre + "input_linear.weight"], W[pre + "output_linear.weight"]
    return _ref_experts(x, w_in, w_out, idx, weights, gated=True)


def _ref_nemotron_moe(x, W, m, cfg):
    # sigmoid scores; selection on scores + e_score_correction_bias, first the topk_group groups
    # with the largest sum of their two best scores, then top-k inside them; weights are the
    # plain scores, renormalised (norm_topk_prob) and scaled by routed_scaling_factor.
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    G, kg = cfg["n_group"], cfg["topk_group"]
    flat = x.reshape(-1, x.shape[-1])
    scores = 1.0 / (1.0 + np.exp(-(flat @ W[m + "gate.weight"].T)))
    choice = scores + W[m + "gate.e_score_correction_bias"]
    group_scores = -np.sort(-choice.reshape(-1, G, E // G), axis=-1)[..., :2].sum(-1)
    ROUTING_MARGINS.append(_topk_margin(group_scores, kg))
    kept = np.zeros(group_scores.shape, bool)
    np.put_along_axis(kept, np.argsort(-group_scores, axis=-1)[:, :kg], True, axis=-1)
    choice = np.where(np.repeat(kept, E // G, axis=-1), choice, -np.inf)
    ROUTING_MARGINS.append(_topk_margin(choice, k))
    idx = np.argsort(-choice, axis=-1)[:, :k]
    weights = np.take_along_axis(scores, idx, axis=-1)
    if cfg["norm_topk_prob"]:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * cfg["routed_scaling_factor"]
    w_in = np.stack([W[m + f"experts.{e}.up_proj.weight"] for e in range(E)])
    w_out = np.stack([W[m + f"experts.{e}.down_proj.weight"] for e in range(E)])
    routed = _ref_experts(x, w_in, w_out, idx, weights, gated=False)
    shared = np.maximum(x @ W[m + "shared_experts.up_proj.weight"].T, 0.0) ** 2
    return routed + shared @ W[m + "shared_experts.down_proj.weight"].T


def numpy_reference_logits(fdir: str, input_ids: np.ndarray) -> np.ndarray:
    ROUTING_MARGINS.clear()
    with open(os.path.join(fdir, "config.json")) as fh:
        cfg = json.load(fh)
    raw = safetensors.numpy.load_file(os.path.join(fdir, "model.safetensors"))
    W = {k: v.astype(np.float64) for k, v in raw.items()}
    mt = cfg["model_type"]
    ids = np.asarray(input_ids)

    if mt == "mamba2":
        eps = cfg["layer_norm_epsilon"]
        lo, hi = (_json_float(v) for v in cfg["time_step_limit"])
        emb = W["backbone.embeddings.weight"]
        h = emb[ids]
        for i in range(cfg["num_hidden_layers"]):
            p = f"backbone.layers.{i}."
            x = _rms(h, W[p + "norm.weight"], eps)
            h = h + _ref_mamba2(
                x,
                W,
                p + "mixer.",
                cfg["num_heads"],
                cfg["head_dim"],
                cfg["state_size"],
                cfg["n_groups"],
                cfg["conv_kernel"],
                eps,
                lo,
                hi,
            )
        h = _rms(h, W["backbone.norm_f.weight"], eps)
        return h @ (emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]).T

    if mt in ("bamba", "granitemoehybrid"):
        eps = cfg["rms_norm_eps"]
        lo, hi = (_json_float(v) for v in cfg["time_step_limit"])
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg["hidden_size"] // nh
        rope = cfg["rope_parameters"]
        if mt == "bamba":
            attn_idx = cfg["attn_layer_indices"] or []
            kinds = ["attn" if i in attn_idx else "mamba" for i in range(cfg["num_hidden_layers"])]
            emb_mult = res_mult = logits_div = 1.0
            scaling = hd**-0.5
            theta, frac = rope["rope_theta"], rope.get("partial_rotary_factor", 1.0)
            post_norm, final_norm = "pre_ff_layernorm", "model.final_layernorm.weight"
        else:
            mamba_names = ("mamba", "linear_attention")  # hub configs use "mamba"/"attention"
            kinds = ["mamba" if t in mamba_names else "attn" for t in cfg["layer_types"]]
            emb_mult = cfg["embedding_multiplier"]
            res_mult = cfg["residual_multiplier"]
            logits_div = cfg["logits_scaling"]
            scaling = cfg["attention_multiplier"]
            theta = rope["rope_theta"] if cfg["position_embedding_type"] == "rope" else None
            frac = 1.0
            post_norm, final_norm = "post_attention_layernorm", "model.norm.weight"
        emb = W["model.embed_tokens.weight"]
        h = emb[ids] * emb_mult
        for i, kind in enumerate(kinds):
            p = f"model.layers.{i}."
            x = _rms(h, W[p + "input_layernorm.weight"], eps)
            if kind == "mamba":
                x = _ref_mamba2(
                    x,
                    W,
                    p + "mamba.",
                    cfg["mamba_n_heads"],
                    cfg["mamba_d_head"],
                    cfg["mamba_d_state"],
                    cfg["mamba_n_groups"],
                    cfg["mamba_d_conv"],
                    eps,
                    lo,
                    hi,
                )
            else:
                x = _ref_attention(x, W, p + "self_attn.", nh, nkv, hd, scaling, theta, frac)
            h = h + x * res_mult
            x = _rms(h, W[p + post_norm + ".weight"], eps)
            if mt == "bamba":
                f = p + "feed_forward."
                x = _silu(x @ W[f + "gate_proj.weight"].T) * (x @ W[f + "up_proj.weight"].T)
                x = x @ W[f + "down_proj.weight"].T
            else:
                f = p + "shared_mlp."
                gate, up = np.split(x @ W[f + "input_linear.weight"].T, 2, axis=-1)
                out = (_silu(gate) * up) @ W[f + "output_linear.weight"].T
                if cfg["num_local_experts"]:  # routed experts beside the shared MLP
                    moe = p + "block_sparse_moe."
                    out = out + _ref_granite_moe(x, W, moe, cfg["num_experts_per_tok"])
                x = out
            h = h + x * res_mult
        h = _rms(h, W[final_norm], eps)
        lm = emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]
        return (h @ lm.T) / logits_div

    if mt == "nemotron_h":
        eps = cfg["layer_norm_epsilon"]
        kinds = cfg.get("layers_block_type")
        if kinds is None:  # hub configs: "hybrid_override_pattern": "M-M*-..."
            table = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            kinds = [table[c] for c in cfg["hybrid_override_pattern"]]
        emb = W["backbone.embeddings.weight"]
        h = emb[ids]
        for i, kind in enumerate(kinds):
            p = f"backbone.layers.{i}."
            m = p + "mixer."
            x = _rms(h, W[p + "norm.weight"], eps)
            if kind == "linear_attention":
                x = _ref_mamba2(
                    x,
                    W,
                    m,
                    cfg["mamba_num_heads"],
                    cfg["mamba_head_dim"],
                    cfg["ssm_state_size"],
                    cfg["n_groups"],
                    cfg["conv_kernel"],
                    eps,
                    cfg["time_step_min"],
                    math.inf,
                )
            elif kind == "full_attention":
                hd = cfg["head_dim"]
                nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
                x = _ref_attention(x, W, m, nh, nkv, hd, hd**-0.5, None, 1.0)
            elif kind == "mlp":
                x = np.maximum(x @ W[m + "up_proj.weight"].T, 0.0) ** 2  # relu2
                x = x @ W[m + "down_proj.weight"].T
            elif kind == "moe":
                x = _ref_nemotron_moe(x, W, m, cfg)
            else:
                raise NotImplementedError(kind)
            h = h + x
        h = _rms(h, W["backbone.norm_f.weight"], eps)
        return h @ (emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]).T

    if mt == "falcon_h1":
        # Every layer: h += mamba(x * ssm_in) * ssm_out + attn(x * attn_in) * attn_out with
        # x = input_layernorm(h); then h += down(up(x) * silu(gate(x) * g)) * d with
        # x = pre_ff_layernorm(h); logits = lm_head(final_layernorm(h)) * lm_head_multiplier.
        eps = cfg["rms_norm_eps"]
        lo, hi = (_json_float(v) for v in cfg["time_step_limit"])
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
        mh, G, N = cfg["mamba_n_heads"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
        d_ssm = cfg["mamba_d_ssm"] or cfg["mamba_expand"] * cfg["hidden_size"]
        mhd = d_ssm // mh
        mup = np.repeat(cfg["ssm_multipliers"], [d_ssm, d_ssm, G * N, G * N, mh])
        if not cfg["mamba_rms_norm"]:
            gate = "y*silu(z)"
        elif cfg["mamba_norm_before_gate"]:
            gate = "norm(y)*silu(z)"
        else:
            gate = "norm(y*silu(z))"
        theta = cfg["rope_parameters"]["rope_theta"]  # whole-head RoPE, whatever the factor
        g_mult, d_mult = cfg["mlp_multipliers"]
        emb = W["model.embed_tokens.weight"]
        h = emb[ids] * cfg["embedding_multiplier"]
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = _rms(h, W[p + "input_layernorm.weight"], eps)
            ssm = _ref_mamba2(
                x * cfg["ssm_in_multiplier"],
                W,
                p + "mamba.",
                mh,
                mhd,
                N,
                G,
                cfg["mamba_d_conv"],
                eps,
                lo,
                hi,
                mup=mup,
                gate=gate,
            )
            attn = _ref_attention(
                x * cfg["attention_in_multiplier"],
                W,
                p + "self_attn.",
                nh,
                nkv,
                hd,
                hd**-0.5,
                theta,
                1.0,
                key_multiplier=cfg["key_multiplier"],
            )
            h = h + ssm * cfg["ssm_out_multiplier"] + attn * cfg["attention_out_multiplier"]
            x = _rms(h, W[p + "pre_ff_layernorm.weight"], eps)
            f = p + "feed_forward."
            up = _lin(x, W, f + "up_proj") * _silu(_lin(x, W, f + "gate_proj") * g_mult)
            h = h + _lin(up, W, f + "down_proj") * d_mult
        h = _rms(h, W["model.final_layernorm.weight"], eps)
        lm = emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]
        return (h @ lm.T) * cfg["lm_head_multiplier"]

    raise NotImplementedError(mt)


def build(family: str, out_dir: str) -> None:
    make, seed = FAMILIES[family]
    model_cls, config, seq_len = make()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    torch.manual_seed(seed + 500)
    rerandomize(model, seed + 500)

    gen = torch.Generator().manual_seed(seed + 900)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, seq_len), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
    assert logits.shape == (BATCH, seq_len, config.vocab_size), logits.shape
    assert torch.isfinite(logits).all()

    fdir = os.path.join(out_dir, family)
    if os.path.isdir(fdir):
        shutil.rmtree(fdir)
    # safetensors is the only format transformers 5 writes (no safe_serialization kwarg).
    model.save_pretrained(fdir)
    gen_cfg = os.path.join(fdir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    np.savez(
        os.path.join(fdir, "golden.npz"),
        input_ids=input_ids.numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        family=np.array(family),
        transformers_version=np.array(transformers.__version__),
        torch_version=np.array(torch.__version__),
    )

    # Round trip: the saved directory alone reproduces the golden logits.
    reloaded = model_cls.from_pretrained(fdir, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        logits2 = reloaded(input_ids=input_ids, use_cache=False).logits.float()
    err = (logits2 - logits).abs().max().item()
    assert err == 0.0, f"{family}: reload mismatch {err}"

    # Independent check: float64 numpy forward from the saved files matches the golden logits.
    ref = numpy_reference_logits(fdir, input_ids.numpy())
    ref_err = float(np.abs(ref - logits.numpy()).max())
    assert ref_err <= 1e-4 * max(1.0, float(np.abs(ref).max())), f"{family}: ref err {ref_err}"
    margin = min(ROUTING_MARGINS, default=math.inf)
    assert margin > 1e-3, f"{family}: routing near a tie (margin {margin:.1e}); change the seed"

    size = sum(os.path.getsize(os.path.join(fdir, f)) for f in os.listdir(fdir))
    assert size < 1_000_000, f"{family}: fixture too large ({size} bytes)"
    with safe_open(os.path.join(fdir, "model.safetensors"), "pt") as f:
        n_tensors = len(list(f.keys()))
    chunk = getattr(config, "chunk_size", None) or getattr(config, "mamba_chunk_size", None)
    print(
        f"{family}: {fdir} {size / 1024:.1f} KiB, {n_tensors} tensors, L={seq_len} "
        f"(chunk {chunk}), V={config.vocab_size}, logits std {logits.std():.3f}, "
        f"max|logit| {logits.abs().max():.3f}, max|numpy64 ref - golden| {ref_err:.1e}"
        + (f", min routing margin {margin:.1e}" if ROUTING_MARGINS else "")
    )
    print(dt_clamp_report(model, input_ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="e.g. tests/fixtures")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=None)
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        print("note: CUDA is visible but unused; everything runs on CPU", file=sys.stderr)
    torch.set_num_threads(1)  # bitwise-reproducible CPU reductions
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    os.makedirs(args.out_dir, exist_ok=True)
    for family in args.only or list(FAMILIES):
        build(family, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
